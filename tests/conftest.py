"""Replica pools shared by the whole session: each is started once and reused by
every Hypothesis example."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from tests.helpers import build_wheel, installed_from_wheel
from tests.replicas import close_pools, shared_pool

# In CI the examples are derived from the test names, so a run is reproducible;
# elsewhere (and in CI's exploration step, XCOLL_EXPLORE=1) Hypothesis draws new
# examples each run, from the seed it prints (replay: --hypothesis-seed=N). A
# failure always prints its example and a @reproduce_failure blob.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", print_blob=True)
_PROFILE = "ci" if os.environ.get("CI") and not os.environ.get("XCOLL_EXPLORE") else "explore"
settings.load_profile(_PROFILE)


def pytest_report_header(config):
    seed = config.getoption("hypothesis_seed", None)
    drawn = (
        "derived from the test names (CI)"
        if _PROFILE == "ci"
        else f"random, seed {seed}" if seed is not None else "random (replay a run: --hypothesis-seed=N)"
    )
    return f"xcoll: property examples {drawn}, {os.environ.get('XCOLL_EXAMPLES', '20')} per test"

# Every property test runs on each of these worlds.
WORLDS = [
    pytest.param("local-1", id="local-1"),
    pytest.param("xla-cpu-1", id="xla-cpu-1"),
    pytest.param("xla-cpu-2", id="xla-cpu-2"),
    pytest.param("xla-cpu-4", id="xla-cpu-4"),
    pytest.param("gloo-1", id="gloo-1"),
    pytest.param("gloo-2", id="gloo-2"),
    pytest.param("gloo-4", id="gloo-4"),
    pytest.param("xla-tpu", id="xla-tpu", marks=pytest.mark.tpu),
]


@pytest.fixture(scope="session", params=WORLDS)
def pool(request):
    return shared_pool(request.param)


@pytest.fixture(scope="session")
def xla4():
    return shared_pool("xla-cpu-4")


@pytest.fixture(scope="session")
def wheel(tmp_path_factory):
    """xcoll's wheel, built once per session from this checkout."""
    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="session")
def from_wheel(tmp_path_factory, request) -> dict[str, str]:
    """The environment variables under which a subprocess started outside the
    checkout (its cwd elsewhere) imports xcoll as its wheel installs it:
    none where xcoll is installed from it (.ci/run's newest-torch
    environment), else ``PYTHONPATH`` to this checkout's wheel, unpacked
    (an editable install's finder comes after it)."""
    if installed_from_wheel():
        return {}
    import zipfile

    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(request.getfixturevalue("wheel")) as z:
        z.extractall(site)
    return {"PYTHONPATH": str(site)}


def pytest_sessionfinish(session, exitstatus):
    close_pools()
