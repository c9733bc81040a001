"""Replica pools shared by the whole session: each is started once and reused by
every Hypothesis example."""

from __future__ import annotations

import os
import re

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
    (an editable install's path comes after it)."""
    if installed_from_wheel():
        return {}
    import zipfile

    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(request.getfixturevalue("wheel")) as z:
        z.extractall(site)
    return {"PYTHONPATH": str(site)}


#: The quick tier (``pytest -m quick``, README "Developing"), for the
#: change-test loop: each test of these files once per world, on its smallest
#: real worlds only (a world of one, gloo and XLA:CPU at W=2), which between
#: them run every module of xcoll; the full suite before a commit.
QUICK_FILES = {
    "test_api_reference.py",
    "test_check_state.py",
    "test_compile.py",
    "test_counters.py",
    "test_demo_and_docs.py",
    "test_exact_ints.py",
    "test_grad.py",
    "test_header.py",
    "test_import.py",
    "test_in_flight.py",
    "test_kernels.py",
    "test_many_leaves.py",
    "test_mismatch.py",
    "test_objects.py",
    "test_out_of_step.py",
    "test_pack.py",
    "test_properties.py",
    "test_rng.py",
    "test_samples.py",
    "test_structure.py",
    "test_torchmetrics.py",
    "test_uneven.py",
    "test_wire.py",
    "test_xla_steps.py",
}
_QUICK_WORLDS = {"local-1", "gloo-2", "xla-cpu-2", 2}
#: Tests of those files that the quick tier leaves to the full suite: each
#: takes 6 s or more (a diagnosis that waits for a watchdog or an engine's
#: timeout, a torchrun job, a wheel, a benchmark), and what it runs of xcoll
#: the quick tier's other tests run too.
_SLOW = {
    "test_a_first_call_on_a_subgroup_is_not_one_on_the_world",
    "test_a_first_call_of_thousands_of_leaves_compiles_a_few_programs",
    "test_a_replica_in_mode_never_among_checked_ones_is_told_so",
    "test_a_replica_that_skips_the_call_is_an_error_within_bounds",
    "test_after_an_overlap_an_xla_replica_makes_no_more_collectives",
    "test_an_output_read_before_any_sync_works_or_is_named_before_xla_aborts",
    "test_an_xla_first_call_that_a_peer_skips_is_diagnosed_before_xla_aborts",
    "test_bench_check_runs_and_reports_the_guard_costs_no_execution",
    "test_crossed_calls_on_overlapping_sub_groups_are_diagnosed",
    "test_bench_grad_counts_the_backwards_collectives",
    "test_bench_scatter_counts_one_collective_per_call_against_one_per_leaf",
    "test_a_call_in_flight_that_times_out_says_which_call",
    "test_a_call_in_flight_completed_during_another_threads_call_raises",
    "test_a_sync_that_waits_for_a_late_peer_is_diagnosed",
    "test_bench_first_calls_checks_its_results",
    "test_bench_outputs_reports_a_compile_per_output_count",
    "test_bench_quick_runs_and_reports_well_formed_numbers",
    "test_demo_runs_from_the_wheel_and_matches_the_single_process_reference",
    "test_dtypes_the_device_narrows_are_refused_on_every_replica",
    "test_states_cross_the_dtypes_an_xla_setting_narrows",
    "test_objects_cross_an_xla_setting_that_narrows_int64",
    "test_an_uneven_gather_crosses_an_xla_setting_that_narrows_int64",
    "test_a_float16_nan_fetched_on_some_replicas_while_another_compiles_meets",
    "test_a_replicas_own_item_while_another_compiles_a_call_meets",
    "test_readme_pool_example_runs_as_a_script",
    "test_sub_group_messages_say_which_ranks_they_name",
    "test_the_contrastive_example_under_torchrun_matches_one_process",
    "test_the_contrastive_training_loop_under_torch_xla_defaults_matches_one_process",
    "test_xla_kernels_give_the_torch_kernels_bits_for_every_dtype_and_op",
}
_WORLD = re.compile(r"^((local|gloo|xla-cpu)-\d+|xla-tpu)$")


def _quick(item: pytest.Item) -> tuple | None:
    """The key under which ``item`` is in the quick tier (a test on replicas:
    its test and its worlds, the first item of each), or None where it is not."""
    name = getattr(item, "originalname", item.name)
    if item.path.name not in QUICK_FILES or name in _SLOW:
        return None
    spec = getattr(item, "callspec", None)
    params = spec.params if spec is not None else {}
    worlds = tuple(
        v
        for k, v in params.items()
        if (isinstance(v, str) and _WORLD.match(v)) or (k == "world" and isinstance(v, int))
    )
    if not all(w in _QUICK_WORLDS for w in worlds):
        return None
    if not worlds:  # (no replicas: every case, a doctest per module among them)
        return item.path.name, item.name
    return item.path.name, name, worlds


def pytest_collection_modifyitems(config, items):
    seen: set[tuple] = set()
    for item in items:
        key = _quick(item)
        if key is not None and key not in seen:
            seen.add(key)
            item.add_marker(pytest.mark.quick)


def pytest_sessionfinish(session, exitstatus):
    close_pools()
