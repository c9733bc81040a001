"""Replica pools shared by the whole session: each is started once and reused by
every Hypothesis example."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from tests.replicas import InlinePool
from xcoll.testing import GlooPool, XlaPool

_pools: dict[str, object] = {}

# In CI the examples are derived from the test names, so a run is reproducible;
# elsewhere Hypothesis explores new examples each run.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

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


def _make(name: str):
    if name == "local-1":
        return InlinePool()
    if name == "xla-tpu":
        if os.environ.get("PJRT_DEVICE") != "TPU":
            pytest.skip("tpu: no TPU here (set PJRT_DEVICE=TPU on a TPU host to run)")
        return XlaPool(int(os.environ.get("XCOLL_TPU_REPLICAS", "4")), device="TPU")
    kind, w = name.rsplit("-", 1)
    return (XlaPool if kind == "xla-cpu" else GlooPool)(int(w), timeout=240)


@pytest.fixture(scope="session", params=WORLDS)
def pool(request):
    name = request.param
    if name not in _pools:
        _pools[name] = _make(name)
    return _pools[name]


@pytest.fixture(scope="session")
def xla4():
    if "xla-cpu-4" not in _pools:
        _pools["xla-cpu-4"] = _make("xla-cpu-4")
    return _pools["xla-cpu-4"]


def pytest_sessionfinish(session, exitstatus):
    for p in _pools.values():
        p.close()
