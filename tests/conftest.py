"""Replica pools shared by the whole session: each is started once and reused by
every Hypothesis example."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from tests.replicas import close_pools, shared_pool

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


@pytest.fixture(scope="session", params=WORLDS)
def pool(request):
    return shared_pool(request.param)


@pytest.fixture(scope="session")
def xla4():
    return shared_pool("xla-cpu-4")


def pytest_sessionfinish(session, exitstatus):
    close_pools()
