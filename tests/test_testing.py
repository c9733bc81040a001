"""The replica pool turns hangs, aborts and exceptions into prompt test failures
and recovers afterwards."""

from __future__ import annotations

import time

import pytest
import torch

import xcoll
from tests.replicas import device
from xcoll.testing import GlooPool, PoolCrashed, ReplicaError, XlaPool


@pytest.fixture(scope="module", params=["xla", "gloo"])
def pool2(request):
    if request.param == "xla":
        p = XlaPool(2, timeout=60, grace=2)
    else:
        p = GlooPool(2, timeout=60, grace=2, collective_timeout=5)
    with p:
        yield p


def _ranks(_=None):
    return xcoll.gather(xcoll.rank())


def _only_rank1_communicates(_):
    if xcoll.rank() == 1:  # rank 0 skips the collective: rank 1 waits forever
        xcoll.gather(torch.ones(2).to(device()))
    return xcoll.rank()


def _rank1_raises_rank0_waits(_):
    if xcoll.rank() == 1:
        raise KeyError("rank 1 gave up")
    return xcoll.gather(torch.ones(2).to(device())).cpu()


def _sleep(seconds):
    time.sleep(seconds)


# (gloo's pool only: on XLA the skipped collective waits for XLA's abort, 10 s
# and a restart, which test_mismatch's xla case runs on the same pool class)
@pytest.mark.parametrize("pool2", ["gloo"], indirect=True)
def test_a_skipped_collective_fails_within_bounds_with_stderr(pool2):
    # gloo raises in the waiting rank after the pool's collective_timeout.
    t0 = time.monotonic()
    with pytest.raises((PoolCrashed, ReplicaError), match="Termination timeout|Timed out|timeout"):
        pool2.run(_only_rank1_communicates, [None, None])
    assert time.monotonic() - t0 < 45
    assert pool2.run(_ranks) == [[0, 1], [0, 1]]


def test_an_exception_is_reported_not_hung(pool2):
    t0 = time.monotonic()
    with pytest.raises(ReplicaError) as e:
        pool2.run(_rank1_raises_rank0_waits, [None, None])
    assert time.monotonic() - t0 < 30
    assert e.value.failures[1].type_name == "builtins.KeyError"
    assert "rank 1 gave up" in str(e.value)
    assert e.value.failures[0].type_name == "xcoll.testing.DidNotReturn"
    assert pool2.run(_ranks) == [[0, 1], [0, 1]]


def test_a_timeout_kills_and_restarts(pool2):
    with pytest.raises(PoolCrashed, match="did not finish within 2 s"):
        pool2.run(_sleep, [30, 0], timeout=2)
    assert pool2.run(_ranks) == [[0, 1], [0, 1]]


def test_per_rank_args_must_match_world_size(pool2):
    with pytest.raises(ValueError, match="3 entries for 2 replicas"):
        pool2.run(_sleep, [0, 0, 0])


def _rank1_crashes_natively(_):
    if xcoll.rank() == 1:
        import ctypes

        ctypes.string_at(0)  # SIGSEGV, as a crash inside XLA would be
    return xcoll.rank()


def test_a_native_crash_is_reported_with_the_python_stack(pool2):
    with pytest.raises(PoolCrashed, match="Segmentation fault") as e:
        pool2.run(_rank1_crashes_natively, [None, None])
    assert "_rank1_crashes_natively" in str(e.value)  # the crashing thread's stack
    assert pool2.run(_ranks) == [[0, 1], [0, 1]]


def _rank1_drops_pending_work_in_a_cycle(_):
    # (as a metric object kept by one replica for its own logging is dropped:
    # its states are pending, and it is in a reference cycle)
    if xcoll.rank() == 1:
        holder: dict = {"state": torch.ones(3).to(device()) * 3}
        holder["self"] = holder
    return xcoll.rank()


def _a_step(_):
    out = xcoll.gather(torch.ones(2).to(device()) * (xcoll.rank() + 2), sync=False)
    xcoll.sync()
    return out.cpu()


def test_a_runs_cyclic_garbage_never_joins_the_next_runs_steps():
    # The pool collects garbage between runs: left to the collector, rank 1's
    # pending tensor joined its next step alone (a program rank 0 never made),
    # and XLA aborted the process.
    with XlaPool(2, timeout=60, grace=2) as pool:
        pool.run(_ranks)  # (each replica's first call is checked in full)
        for _ in range(3):
            assert pool.run(_rank1_drops_pending_work_in_a_cycle, [None, None]) == [0, 1]
            outs = pool.run(_a_step, [None, None])
            assert all(torch.equal(o, torch.tensor([2.0, 2.0, 3.0, 3.0])) for o in outs)
