"""XLA steps as users write them, on thread-per-device replicas (XLA:CPU):
small calls back to back, and syncs with nothing pending while another
replica's collective is in flight."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

import xcoll
from tests.replicas import device, shared_pool


def _small_calls(n: int) -> int:
    """``n`` small calls back to back, of Python scalars (nothing is pending
    on the device before or after them) and of a tensor; returns how many
    gave the expected values."""
    rank, world = xcoll.rank(), xcoll.world_size()
    x = torch.full((2,), float(rank)).to(device())
    good = 0
    for i in range(n):
        ranks = xcoll.gather(rank)
        total = xcoll.reduce({"i": i, "x": x})
        good += ranks == list(range(world)) and total["i"] == i * world
        good += bool((total["x"].cpu() == sum(range(world))).all())
    return good


@pytest.mark.parametrize("world", ["xla-cpu-2", "xla-cpu-4"])
def test_small_calls_back_to_back_meet(world):
    # Regression: a small call with nothing to run before its collective
    # once stepped torch_xla, whose empty step waited for replica 0's
    # execution, which waited for this replica: deadlock at the second call
    pool = shared_pool(world)
    assert pool.run(_small_calls, [100] * pool.world_size) == [200] * pool.world_size


def _sync_with_nothing_pending(n: int) -> str:
    rank = xcoll.rank()
    for _ in range(n):
        xcoll.gather(rank)  # (its outputs are Python values: nothing pending after it)
        if rank == 1:
            time.sleep(0.02)  # replica 0 is in its next call's collective by then
        xcoll.sync()  # nothing pending on this replica's device
    return "ok"


def test_a_sync_with_nothing_pending_does_not_wait_for_another_replica():
    # torch_xla's step with nothing pending locks device 0 as its barrier:
    # replica 1's would wait for replica 0's collective, which waits for it
    pool = shared_pool("xla-cpu-2")
    assert pool.run(_sync_with_nothing_pending, [20, 20]) == ["ok", "ok"]


def _process_and_replica(_):
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    return (
        xr.process_index(),
        xr.process_count(),
        xr.global_ordinal(),
        xr.world_size(),
        xr.local_ordinal(),
        xm.is_master_ordinal(local=True),
    )


def test_a_pools_replica_threads_are_process_0_of_1_and_their_own_ordinals():
    # (the runtime started as process 0 of 1, as xmp.spawn starts it for its
    # threads; each thread its own ordinal of the replicas. The local ordinal,
    # which data loaders shard by and local-master logging reads, is the
    # process's local rank times its devices plus the thread's device: a
    # process started as 1 of 1 would shift every thread's by W)
    got = shared_pool("xla-cpu-2").run(_process_and_replica, [None, None])
    assert got == [(0, 1, 0, 2, 0, True), (0, 1, 1, 2, 1, False)], got


def test_a_binding_this_torch_xla_lacks_is_named():
    from xcoll._backends import _xlac

    with pytest.raises(RuntimeError, match=r"has no torch_xla\._XLAC\._no_such_binding, which xcoll needs"):
        _xlac._binding("_no_such_binding")


# ---- the syncs users write (issue: XLA steps as users write them) -------------------

# A lock of the caller's own around its syncs (the usual cure for compile races).
_CALLERS_LOCK = threading.Lock()
# Steps back to back: torch_xla.sync is xcoll's step without its wait there,
# and a replica that ran ahead once hung every replica after a few dozen calls.
STEPS = 40


def _sync_false_calls(how: str) -> list[float]:
    """A loop of ``sync=False`` reduces above 4 KiB (in the caller's graph),
    each run by a sync of the caller's own (``how``), its output read after
    it; returns the values read."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    rank, world = xcoll.rank(), xcoll.world_size()
    x = torch.arange(1024.0).to(device())
    mine = torch.tensor([float(rank)]).to(device())
    got = []
    for i in range(STEPS):
        out = xcoll.reduce({"x": x * (i + 2) + mine}, sync=False)
        if how == "torch_xla.sync":
            torch_xla.sync()
        elif how == "xm.mark_step":
            xm.mark_step()
        else:
            with _CALLERS_LOCK:
                torch_xla.sync()
        got.append(float(out["x"][1].cpu()) - world * (i + 2) - sum(range(world)))
    xcoll.sync()
    return got


@pytest.mark.parametrize("how", ["torch_xla.sync", "xm.mark_step", "locked torch_xla.sync"])
@pytest.mark.parametrize("world", ["xla-cpu-2", "xla-cpu-4"])
def test_a_callers_own_sync_runs_sync_false_calls(world, how):
    # torch_xla's own sync from every replica thread compiled a new graph once
    # per thread (XLA's abort); under the caller's lock it deadlocked on the
    # verdict's step closure, which fetched while the others waited for that lock
    pool = shared_pool(world)
    assert pool.run(_sync_false_calls, [how] * pool.world_size) == [[0.0] * STEPS] * pool.world_size


def _sync_false_calls_and_one_synced_call(how: str) -> tuple[list[float], float, float]:
    """The sync=False loop's values read, then a synced reduce over 4 KiB:
    its largest error and its count's."""
    big = torch.arange(2048.0).to(device()) + xcoll.rank()
    whole = xcoll.reduce({"big": big, "n": torch.tensor(1.0).to(device())})
    want = xcoll.world_size() * torch.arange(2048.0) + sum(range(xcoll.world_size()))
    error = float((whole["big"].cpu() - want).abs().max())
    return _sync_false_calls(how), error, float(whole["n"].cpu()) - xcoll.world_size()


_HOWS = ["torch_xla.sync", "locked torch_xla.sync"]


def test_steps_under_torch_xla_debugging_settings(tmp_path):
    # xcoll's step keeps torch_xla.sync's step log and metrics file, and
    # not its XLA_SYNC_WAIT, whose wait under xcoll's lock hung the replicas
    # queued behind it (_xlac.step). The caller's syncs, plain and locked
    pytest.importorskip("torch_xla")
    from xcoll.testing import XlaPool

    metrics = tmp_path / "metrics"
    env = {"XLA_SYNC_WAIT": "1", "XLA_EMIT_STEPLOG": "1", "XLA_METRICS_FILE": str(metrics)}
    with XlaPool(2, env=env) as pool:
        got = [pool.run(_sync_false_calls_and_one_synced_call, [how, how]) for how in _HOWS]
        log = pool.stderr_tail(10**6)
    assert got == [[([0.0] * STEPS, 0.0, 0.0)] * 2] * 2, got
    assert log.count("torch_xla.torch_xla::sync\n") >= 4 * STEPS, log[-2000:]
    # (torch_xla's name for the first replica's file where the world is over 1)
    assert metrics.with_name("metrics.0").read_text().count("[MetricsData; step=") >= 2 * STEPS
    assert not metrics.with_name("metrics.1").exists()


def _eval_over_mp_device_loader(n: int) -> list[float]:
    """An eval loop over ``MpDeviceLoader`` (which calls ``torch_xla.sync()``
    before each batch), its metrics reduced with ``sync=False``."""
    from torch.utils.data import DataLoader, TensorDataset
    from torch_xla.distributed.parallel_loader import MpDeviceLoader

    rows = torch.arange(n * 600.0).reshape(n, 600)  # (a batch: over 4 KiB)
    loader = MpDeviceLoader(DataLoader(TensorDataset(rows), batch_size=2), device())
    total = None
    for (batch,) in loader:
        sums = xcoll.reduce({"sum": batch.sum(0)}, sync=False)["sum"]
        total = sums if total is None else total + sums
    xcoll.sync()
    assert total is not None
    return (total.cpu() - xcoll.world_size() * rows.sum(0)).abs().max().tolist()


@pytest.mark.parametrize("world", ["xla-cpu-2", "xla-cpu-4"])
def test_an_eval_loop_over_mp_device_loader(world):
    pool = shared_pool(world)
    assert pool.run(_eval_over_mp_device_loader, [8] * pool.world_size) == [0.0] * pool.world_size


def _differing_call_run_by_the_callers_sync(_=None) -> str:
    """A ``sync=False`` call whose tree differs on rank 0 (the same program:
    only the guard's header differs), run by the caller's own locked sync;
    the next xcoll call reads its verdict."""
    import torch_xla

    x = torch.ones(1100).to(device())
    key = "a" if xcoll.rank() == 0 else "b"
    xcoll.reduce({key: x}, sync=False)
    with _CALLERS_LOCK:
        torch_xla.sync()
    try:
        xcoll.reduce({"next": 1})
    except xcoll.CollectiveMismatchError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("world", ["xla-cpu-2", "xla-cpu-4"])
def test_a_verdict_run_by_the_callers_sync_raises_at_the_next_call(world):
    pool = shared_pool(world)
    for text in pool.run(_differing_call_run_by_the_callers_sync, [None] * pool.world_size):
        assert "xcoll.reduce" in text and ("tree['a']" in text or "tree['b']" in text), text


def _differing_call_then_a_call(nxt: str) -> str:
    """A ``sync=False`` call whose tree differs on rank 0, then a blocking
    call: a large one of a device tensor, which runs the pending work in its
    own sync and fetches its outputs; or a small one of a scalar (on the
    host: it leaves the pending work pending), then ``xcoll.sync()``."""
    xcoll.reduce({"first": 1})  # (a group's first call is checked in full, before it communicates)
    x = torch.ones(1100).to(device())
    key = "a" if xcoll.rank() == 0 else "b"
    xcoll.reduce({key: x}, sync=False)
    try:
        xcoll.reduce({"next": 1} if nxt == "small" else {"next": x * 2})
        if nxt == "small":
            xcoll.sync()
    except xcoll.CollectiveMismatchError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("nxt", ["small", "large"])
@pytest.mark.parametrize("world", ["xla-cpu-2", "xla-cpu-4"])
def test_a_blocking_call_after_a_differing_call_in_flight_raises_its_verdict(world, nxt):
    # (the later call syncs and fetches: the earlier call's verdict is read then, on every replica)
    pool = shared_pool(world)
    for text in pool.run(_differing_call_then_a_call, [nxt] * pool.world_size):
        assert "xcoll.reduce" in text and "tree['a']" in text and "tree['b']" in text, text


def _per_replica_scalars(_=None) -> list[float]:
    """Work pending before a call (above 4 KiB: in its program), traced from
    per-replica Python values that are 0 or 1 on some replica."""
    rank, world = xcoll.rank(), xcoll.world_size()
    x = torch.arange(1100.0).to(device())
    shifted = x + 10 * rank  # 0 on rank 0
    scaled = ((x * (rank + 1)) ** 2).sum()  # a factor 1 on rank 0
    out = xcoll.reduce({"shifted": shifted, "scaled": scaled})
    expected_shifted = world * x[3].item() + 10 * sum(range(world))
    expected_scaled = float((x.cpu() ** 2).sum()) * sum((r + 1) ** 2 for r in range(world))
    return [
        float(out["shifted"][3].cpu()) - expected_shifted,
        float(out["scaled"].cpu()) / expected_scaled - 1,
    ]


@pytest.mark.parametrize("world", ["xla-cpu-2", "xla-cpu-4"])
def test_per_replica_python_scalars_of_zero_and_one_make_one_program(world):
    # torch_xla's cache of scalar data shared 10 * 0 with other zeros of the
    # graph on rank 0 alone: different programs, XLA's abort
    pool = shared_pool(world)
    for shifted, scaled in pool.run(_per_replica_scalars, [None] * pool.world_size):
        assert shifted == 0 and abs(scaled) < 1e-6, (shifted, scaled)


def _read_before_any_sync(how: str) -> list[float]:
    """A ``sync=False`` call's output read before any sync has run it."""
    x = torch.arange(1100.0).to(device())
    out = xcoll.reduce({"x": x * 3}, sync=False)["x"]
    if how == "item":
        got = out[1].item()
    elif how == "cpu":
        got = float(out.cpu()[1])
    else:
        print(out[1])
        got = float(out[1])
    xcoll.sync()
    return [got - 3 * xcoll.world_size()]


# (each mode on W=2, and W=4 once: each case mostly waits for XLA's abort)
@pytest.mark.parametrize(
    "world, how", [("xla-cpu-2", "item"), ("xla-cpu-2", "cpu"), ("xla-cpu-2", "print"), ("xla-cpu-4", "item")]
)
def test_an_output_read_before_any_sync_works_or_is_named_before_xla_aborts(world, how):
    # torch_xla compiles that graph once per replica thread: their collectives
    # never meet, and XLA aborts the process after 10 s, with no word of
    # xcoll's (or the values, where the threads happened to compile in turn)
    from xcoll.testing import PoolCrashed

    pool = shared_pool(world)
    try:
        got = pool.run(_read_before_any_sync, [how] * pool.world_size, timeout=60)
    except PoolCrashed as e:
        log = str(e)
        # (the hint, whole: it names the call and the replica)
        named = re.search(
            r"xcoll: xcoll\.reduce on rank [0-9], made with sync=False 5 s ago, has not been run "
            + re.escape(
                "by a sync yet (xcoll.sync(), torch_xla.sync(), or a later xcoll call). If this "
                "replica waits in an .item(), .cpu() or print of a tensor computed from its "
                "outputs: on XLA:CPU replica threads, that graph is compiled once per replica, "
                "their collectives never meet, and XLA aborts the process; call xcoll.sync() "
                "before reading the outputs (docs/launchers.md)."
            ),
            log,
        )
        assert named is not None and named.start() < log.find("Termination timeout"), log[-3000:]
    else:
        assert got == [[0.0]] * pool.world_size


def _two_syncs_one_replica_late(late: float) -> list[float]:
    """A ``sync=False`` call run by the caller's ``torch_xla.sync()``, then
    work on its output and a second sync straight after; replica 1 reaches
    the first sync ``late`` seconds after the others."""
    import torch_xla

    out = xcoll.reduce({"x": torch.ones(3).to(device())}, sync=False)
    if xcoll.rank() == 1:
        time.sleep(late)
    torch_xla.sync()
    y = out["x"] * 2 + 1
    torch_xla.sync()
    return y.cpu().tolist()


@pytest.mark.parametrize("world", ["xla-cpu-2", "xla-cpu-4"])
def test_a_sync_right_after_a_sync_waits_for_a_late_replica_outside_the_lock(world):
    # Regression: the second step held the lock while torch_xla waited for
    # the first step's execution, which waited at its all-reduce for replica
    # 1, queued behind that lock for its first step: XLA aborted the process
    pool = shared_pool(world)
    w = pool.world_size
    assert pool.run(_two_syncs_one_replica_late, [0.5] * w) == [[2.0 * w + 1] * 3] * w


def _own_items_while_another_compiles(calls: int) -> list[list[float]]:
    """``calls`` calls of new shapes (each compiles its exchange); before
    each, every odd replica reads ``.item()`` of graphs of its own, each
    compiled (a new shape), while the others are in that call."""
    rank = xcoll.rank()
    got = []
    for k in range(calls):
        if rank % 2:
            for j in range(24):
                (torch.ones(24 * k + j + 1).to(device()) * 2).sum().item()
        out = xcoll.broadcast({"y": torch.full((k + 1,), float(rank)).to(device())}, src=1)
        got.append(out["y"].cpu().tolist())
    return got


def test_a_replicas_own_item_while_another_compiles_a_call_meets():
    # Regression: the lock let its waiters go once torch_xla's process-wide
    # compile counts changed, which an odd replica's own .item() did while
    # replica 0 compiled the call's exchange; a waiter then compiled that
    # exchange again, their all-gathers never met, and XLA aborted the
    # process (4 of 8 fresh W=4 pools at their first call). Fresh pools: a
    # shared one has compiled these graphs already.
    from xcoll.testing import XlaPool

    want = [[1.0] * (k + 1) for k in range(4)]
    for _ in range(3):
        with XlaPool(4, timeout=120) as pool:
            assert pool.run(_own_items_while_another_compiles, [4] * 4) == [want] * 4


def _nan_on_odd_ranks(_=None) -> float:
    """A fresh pool's first call, small (hosted: downloaded, then one
    exchange), with a float16 NaN on every other replica: their download
    fetches its bits again (one small graph of their own)."""
    rank = xcoll.rank()
    x = torch.tensor(float("nan") if rank % 2 else 1.0, dtype=torch.float16).to(device())
    out = xcoll.broadcast({"x": x, "y": torch.ones(3).to(device())}, src=0, to_cpu=True)
    return out["x"].item()


def test_a_float16_nan_fetched_on_some_replicas_while_another_compiles_meets():
    # Regression (found by a random-seed run of test_broadcast[xla-cpu-4]):
    # the NaN's bits were compiled outside the compile lock, which let a
    # replica queued behind another's compile of the exchange go on and
    # compile it again; their all-gathers never met and XLA aborted the
    # process, in 9 of 10 fresh pools. Each pool here is fresh.
    from xcoll.testing import XlaPool

    for _ in range(3):
        with XlaPool(4, timeout=120) as pool:
            assert pool.run(_nan_on_odd_ranks, [None] * 4) == [1.0] * 4
