"""Calls in flight on torch.distributed: ``sync=False`` starts a call's
collectives and returns; the call completes at ``xcoll.sync()`` or at the
first use of an output (docs/design.md, "Calls in flight"). Real gloo
processes at W=2 and W=4."""

from __future__ import annotations

import pathlib
import time

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

import xcoll
from tests import strategies as S
from tests.helpers import PROPERTY, assert_trees, leaves, same_bits
from tests.replicas import shared_pool, to_cpu
from tests.test_properties import _flip, _reduce_case
from xcoll._core import ops as _ops
from xcoll._core.pending import PendingTensor

WORLDS = ["gloo-2", "gloo-4"]


@pytest.fixture(scope="session", params=WORLDS)
def gloo(request):
    return shared_pool(request.param)


# ---- the same values and verdicts as a blocking call ---------------------------


def _in_flight(args):
    """The call blocking, then in flight; the caller changes its inputs as
    soon as the call returns and writes into its outputs after the sync."""
    name, tree, kwargs, alone = args
    with _ops.tuned(alone=alone):  # (a bucket of one tensor from ``alone`` bytes travels as itself)
        want = to_cpu(getattr(xcoll, name)(tree, **kwargs))
        got = getattr(xcoll, name)(tree, sync=False, **kwargs)
    kinds = sorted({type(t).__name__ for t in leaves(got) if isinstance(t, torch.Tensor)})
    _flip(tree)  # (the caller reuses its inputs at once)
    xcoll.sync()
    _flip(tree)
    out = to_cpu(got)
    _flip(got)  # if any output aliased an input, the input would change
    return {"want": want, "out": out, "kinds": kinds, "inputs_after": to_cpu(tree)}


def _case(data, w: int):
    name = data.draw(st.sampled_from(["gather", "reduce", "broadcast", "reduce_scatter", "all_to_all"]), "name")
    if name in ("reduce", "reduce_scatter"):  # (tensor leaves: cut into parts, which a reduce keeps)
        op, trees = data.draw(_reduce_case(w, 0))
        return name, trees, {"op": op}
    skeleton = data.draw(S.skeletons(scalars=False), "skeleton")
    kwargs: dict = {}
    if name in ("reduce_scatter", "all_to_all"):
        skeleton = S.scatterable(skeleton, w, 0)
    elif name == "gather":
        kwargs = {"dim": data.draw(st.sampled_from([0, -1]), "dim"), "stack": data.draw(st.booleans())}
    else:
        kwargs = {"src": data.draw(st.integers(0, w - 1), "src")}
    return name, data.draw(S.rank_trees(skeleton, w), "trees"), kwargs


@PROPERTY
@given(data=st.data())
def test_a_call_in_flight_gives_the_blocking_calls_values(gloo, data):
    w = gloo.world_size
    name, trees, kwargs = _case(data, w)
    alone = data.draw(st.sampled_from([1 << 24, 16]), "alone")
    reports = gloo.run(_in_flight, [(name, t, kwargs, alone) for t in trees])
    for r, (rep, tree) in enumerate(zip(reports, trees, strict=True)):
        assert_trees(rep["out"], rep["want"], same_bits, f"{name} in flight on rank {r}")
        assert_trees(rep["inputs_after"], tree, same_bits, "an input changed")
        assert rep["kinds"] in ([], ["PendingTensor"]), rep["kinds"]


def _changed_at_once(name):
    """A large leaf, which travels as itself, changed by its caller as soon
    as the call returns, while the peers have not called yet (gloo has sent
    part of it at most: the rest would be the changed values, were the
    wire the caller's tensor)."""
    rank = xcoll.rank()
    x = torch.arange(1 << 21, dtype=torch.float32) + rank
    want = getattr(xcoll, name)(x.clone())
    if rank != 0:
        time.sleep(0.5)
    with _ops.tuned(alone=16):
        got = getattr(xcoll, name)(x, sync=False)
    x.neg_()
    xcoll.sync()
    return torch.equal(got, want)


@pytest.mark.parametrize("name", ["gather", "broadcast", "reduce"])
def test_the_caller_may_change_a_large_input_at_once(gloo, name):
    assert gloo.run(_changed_at_once, [name] * gloo.world_size) == [True] * gloo.world_size


# ---- it returns before a late peer has called ------------------------------------


def _before_the_late_peer(args):
    """Rank 0 calls first; the others call only once rank 0's call has
    returned (or after a minute). Rank 0 reports whether any had called
    by then: a call that waited for them could not have returned first."""
    folder, name = pathlib.Path(args[0]), args[1]
    rank = xcoll.rank()
    x = torch.arange(8.0).reshape(4, 2) + rank
    xcoll.barrier()  # (a group's first call is checked in full: it waits for every replica)
    if rank != 0:
        deadline = time.monotonic() + 60
        while not (folder / "returned").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        (folder / f"called-{rank}").touch()
    out = getattr(xcoll, name)(x, sync=False)
    called = sorted(p.name for p in folder.glob("called-*"))
    if rank == 0:
        (folder / "returned").touch()
    want = getattr(xcoll, name)(x)
    return called, torch.equal(out, want)


@pytest.mark.parametrize("name", ["gather", "reduce", "broadcast", "reduce_scatter", "all_to_all"])
def test_a_call_in_flight_returns_before_a_late_peer_has_called(gloo, tmp_path, name):
    reports = gloo.run(_before_the_late_peer, [(str(tmp_path), name)] * gloo.world_size)
    assert reports[0] == ([], True)
    assert all(equal for _, equal in reports)


# ---- in order, completed by the first use of an output ---------------------------


def _several(n: int):
    """Four calls in flight (a reduce of two dtypes: its second collective
    starts when it completes), of leaves of ``n`` elements; the last one's
    output used first, then the sync."""
    rank = xcoll.rank()
    a = {"f": torch.arange(float(n)) + rank, "i": torch.arange(n) * (rank + 1)}
    b = {"h": torch.ones(n, dtype=torch.float16) * rank, "d": torch.full((n,), 0.5 + rank, dtype=torch.float64)}
    blocking = [xcoll.gather(a), xcoll.reduce(b), xcoll.broadcast(a, src=1), xcoll.reduce(b, "max")]
    calls = [
        xcoll.gather(a, sync=False),
        xcoll.reduce(b, sync=False),
        xcoll.broadcast(a, src=1, sync=False),
        xcoll.reduce(b, "max", sync=False),
    ]
    first = calls[-1]["h"] + 0  # (completes every call before it on the group)
    done = [t._call.outputs is not None for c in calls for t in leaves(c)]
    xcoll.sync()
    same = [all(torch.equal(c[k], w[k]) for k in w) for c, w in zip(calls, blocking, strict=True)]
    return done, same, torch.equal(first, blocking[-1]["h"])


@pytest.mark.parametrize("n", [3, 2048])
def test_calls_in_flight_complete_in_order_at_the_first_use_of_an_output(gloo, n):
    # (small calls share one hosted exchange; 2048 elements are over its
    # 4 KiB: each call's collectives its own, completed in their order)
    for done, same, first in gloo.run(_several, [n] * gloo.world_size):
        assert all(done) and all(same) and first


def _threads_in_turn(_=None):
    """Two reduces of two dtypes in flight on one group, made by two threads
    in turn (their second collectives start at completion); rank 0 then
    completes the later one first, the others the earlier one: the order
    kept per group makes every replica complete them in the calls' order."""
    import threading

    rank = xcoll.rank()
    b = {"h": torch.ones(4, dtype=torch.float16) * rank, "d": torch.full((2,), 0.5 + rank, dtype=torch.float64)}
    want = [xcoll.reduce(b), xcoll.reduce(b, "max")]
    made = []
    thread = threading.Thread(target=lambda: made.append(xcoll.reduce(b, sync=False)))
    thread.start()
    thread.join()
    made.append(xcoll.reduce(b, "max", sync=False))
    made[1 if rank == 0 else 0]["d"] + 0
    xcoll.sync()
    return [all(torch.equal(m[k], w[k]) for k in w) for m, w in zip(made, want, strict=True)]


def test_calls_in_flight_from_two_threads_complete_in_their_groups_order(gloo):
    assert gloo.run(_threads_in_turn, [None] * gloo.world_size) == [[True, True]] * gloo.world_size


def _printed(_=None):
    """print, item, tolist and numpy of outputs in flight, and operations
    whose keyword-only arguments reach the value with it (a sum's dtype, an
    add's alpha)."""
    x = torch.tensor([1.5, 2.5]) * (xcoll.rank() + 1)
    got = [xcoll.reduce(x, sync=False) for _ in range(6)]
    summed = torch.sum(got[4], dtype=torch.float64)
    return (
        repr(got[0]),
        got[1][0].item(),
        got[2].tolist(),
        got[3].numpy().tolist(),
        (summed.dtype, summed.item()),
        got[5].add(1, alpha=2).tolist(),
    )


def test_outputs_in_flight_print_and_convert_to_their_values(gloo):
    w = gloo.world_size
    total = [1.5 * w * (w + 1) / 2, 2.5 * w * (w + 1) / 2]
    for text, item, values, array, summed, added in gloo.run(_printed, [None] * w):
        assert text == repr(torch.tensor(total)) and item == total[0]
        assert values == total and array == total
        assert summed == (torch.float64, sum(total)) and added == [t + 2 for t in total]


def _chained(_=None):
    """Outputs in flight passed to the next calls, copied and pickled."""
    import copy
    import io

    x = torch.arange(4.0) + xcoll.rank()
    a = xcoll.gather(x, sync=False)
    b = xcoll.gather(a, sync=False)  # (its packing completes ``a``)
    c = xcoll.reduce({"a": a, "b": b})
    buf = io.BytesIO()
    torch.save(b, buf)
    buf.seek(0)
    saved = torch.load(buf)  # (this test's own file, not another replica's data)
    xcoll.sync()
    return [to_cpu(t) for t in (a, b, c["b"], copy.deepcopy(b), saved)], type(saved).__name__


def test_outputs_in_flight_are_inputs_copies_and_pickles_of_their_values(gloo):
    w = gloo.world_size
    x = [torch.arange(4.0) + r for r in range(w)]
    a = torch.cat(x)
    b = torch.cat([a] * w)
    for got, kind in gloo.run(_chained, [None] * w):
        assert kind == "Tensor"
        for t, want in zip(got, [a, b, b * w, b, b], strict=True):
            assert torch.equal(t, want)


# ---- a mismatch raises from the sync, on every replica -------------------------


def _mismatched(how):
    rank = xcoll.rank()
    xcoll.barrier()  # (a group's first call is checked in full, before it communicates)
    x = torch.arange(3.0 + (rank == 1 and how == "shape"))
    # (a broadcast's verdict on gloo is its receivers', read when it ends)
    name = "broadcast" if how == "broadcast tag" else "gather"
    got = getattr(xcoll, name)(x, sync=False, tag=f"t{rank}" if "tag" in how else None)
    try:
        xcoll.sync()
    except xcoll.CollectiveMismatchError as e:
        return type(e).__name__, f"xcoll.{name}" in str(e)
    return to_cpu(got)


@pytest.mark.parametrize("how", ["shape", "tag", "broadcast tag"])
def test_a_call_in_flight_that_differs_raises_from_the_sync_on_every_replica(gloo, how):
    # (a small broadcast's header is summed: src raises too)
    reports = gloo.run(_mismatched, [how] * gloo.world_size)
    assert reports == [("CollectiveMismatchError", True)] * len(reports)


def _mismatched_use(_=None):
    xcoll.barrier()  # (as above)
    got = xcoll.gather(torch.arange(3.0 + (xcoll.rank() == 1)), sync=False)
    try:
        got + 1
    except xcoll.CollectiveMismatchError as e:
        again = None
        try:  # (a failed call's outputs do not exist: a clear error, every time)
            got.sum()
        except RuntimeError as f:
            again = "failed when it completed (CollectiveMismatchError: " in str(f)
        xcoll.sync()
        return type(e).__name__, "xcoll.gather" in str(e), again
    return None


def test_a_call_in_flight_that_differs_raises_at_the_first_use_on_every_replica(gloo):
    reports = gloo.run(_mismatched_use, [None] * gloo.world_size)
    assert reports == [("CollectiveMismatchError", True, True)] * gloo.world_size


def _differing_call_read_early_by_rank_0(_=None):
    """A call in flight that differs between replicas, whose output rank 0
    alone reads before the next call: every replica's error names it (rank
    0's at its read, the others' at the next call, which completes it
    first), and the group goes on."""
    rank = xcoll.rank()
    xcoll.barrier()  # (as above)
    got = xcoll.gather(torch.arange(3.0 + (rank == 1)), sync=False, tag="differs")
    said = []
    try:
        if rank == 0:
            got + 1
        xcoll.gather(torch.ones(2), tag="next")
    except xcoll.CollectiveMismatchError as e:
        # (the differing call's shapes, both replicas': not the next call's)
        said.append("tensor of shape (3)" in str(e) and "tensor of shape (4)" in str(e))
    return said, xcoll.gather(torch.ones(1) * rank).tolist()


def test_a_differing_call_in_flight_read_early_by_some_replicas_raises_on_every_replica(gloo):
    # (the completion of a call that differs exchanges descriptions: a
    # collective, which every replica makes before its next call's)
    w = gloo.world_size
    assert gloo.run(_differing_call_read_early_by_rank_0, [None] * w) == [
        ([True], [float(r) for r in range(w)])
    ] * w


def _synced_by_group(_=None):
    """``xcoll.sync(group=g)`` completes the calls in flight on ``g``, and
    only those: a call on ``g`` that differs raises there, a call on the
    default group stays in flight until the next sync."""
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")
    xcoll.barrier(group=group)  # (as above: a group's first call is checked in full)
    xcoll.barrier()
    world = xcoll.gather(torch.ones(2), sync=False)
    xcoll.gather(torch.arange(3.0 + (xcoll.rank() == 1)), sync=False, group=group)
    raised = None
    try:
        xcoll.sync(group=group)
    except xcoll.CollectiveMismatchError as e:
        raised = type(e).__name__
    in_flight = world._call.outputs is None
    xcoll.sync()
    return raised, in_flight, world.tolist()


def test_a_sync_of_one_group_completes_that_groups_calls_alone(gloo):
    w = gloo.world_size
    assert gloo.run(_synced_by_group, [None] * w) == [("CollectiveMismatchError", True, [1.0] * 2 * w)] * w


def _completed_by_another_threads_call(_=None):
    """A call in flight, then another thread of this process enters a call on
    the same group (on a fresh group): its entry completes the call in
    flight first, in order, so this thread's use of an output overlaps
    nothing."""
    import threading

    import torch.distributed as dist

    from xcoll import _backends
    from xcoll._guard import check as _check
    from xcoll._guard import entry as _entry

    group = dist.new_group(backend="gloo")
    out = xcoll.gather(torch.ones(2) * xcoll.rank(), sync=False, group=group)
    inside, done = threading.Event(), threading.Event()

    def other():
        t = _backends.current(group)
        # (entered as a public call is, in mode "never": no collective of its own)
        with xcoll.consistency_checks("never"), _entry.entered(t, "xcoll.other", "", _check.NO_TREE):
            inside.set()
            done.wait(60)

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    assert inside.wait(60)
    completed = out._call.outputs is not None
    got = (out + 1).tolist()
    done.set()
    thread.join(60)
    return completed, got


def test_a_call_in_flight_is_completed_by_another_threads_call_on_its_group():
    pool = shared_pool("gloo-2")
    got = pool.run(_completed_by_another_threads_call, [None] * 2)
    assert got == [(True, [1.0, 1.0, 2.0, 2.0])] * 2, got


def _a_call_meanwhile(group=None):
    """Another thread of this process that calls on ``group`` in 1 s (inside a
    wait of this thread's for a late peer); the ConcurrentCallError it meets,
    up to its thread's name, lands in the list returned with the thread."""
    import threading

    raised: list[str] = []

    def other():
        time.sleep(1.0)
        try:
            xcoll.gather(torch.ones(2), group=group)
        except xcoll.ConcurrentCallError as e:
            raised.append(str(e).split(" from thread")[0])

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    return thread, raised


def _another_threads_call_during_a_completion(_=None):
    """Rank 0 completes a call in flight that waits for rank 1 (late), and
    another of its threads calls on the group meanwhile: that call raises at
    once, and so does the completion it overlapped, when it ends."""
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")
    xcoll.barrier(group=group)  # (a group's first call is checked in full: it waits)
    if xcoll.rank() == 1:
        time.sleep(3.0)
        return xcoll.gather(torch.ones(2), sync=False, group=group).tolist()
    out = xcoll.gather(torch.ones(2), sync=False, group=group)
    thread, raised = _a_call_meanwhile(group)
    try:
        got = out.tolist()
    except xcoll.ConcurrentCallError as e:
        got = str(e).split(" (")[0]
    thread.join(60)
    return got, raised


def test_a_completion_that_another_threads_call_overlapped_raises_when_it_ends():
    pool = shared_pool("gloo-2")
    got = pool.run(_another_threads_call_during_a_completion, [None] * 2)
    assert got == [
        (
            "xcoll.gather: another thread called xcoll on the same process group while "
            "this call",
            ["xcoll.gather: called on rank 0 of the group (global rank 0)"],
        ),
        [1.0] * 4,
    ], got


def _late_at_the_sync(_=None):
    """Rank 0's sync waits for a peer that calls late: the watchdog's
    diagnosis (after 1 s here) names the call in flight."""
    from tests.test_out_of_step import _stderr_and_watchdog

    xcoll.barrier()  # (a group's first call is checked in full: it waits for every replica)
    with _stderr_and_watchdog(1.0) as err:
        if xcoll.rank() == 1:
            time.sleep(2.5)
        out = xcoll.gather(torch.ones(2), sync=False)
        xcoll.sync()
    return err.getvalue(), out.tolist()


def test_a_sync_that_waits_for_a_late_peer_is_diagnosed():
    printed, values = shared_pool("gloo-2").run(_late_at_the_sync, [None] * 2)[0]
    assert values == [1.0] * 4
    assert "xcoll: xcoll.gather made with sync=False has waited 1 s to complete" in printed, printed
    assert "a replica has not reached this call" in printed, printed
    assert "programs differ" not in printed, printed  # (XLA's cause alone: not an eager engine's)


def _skipped_by_a_peer(_=None):
    xcoll.barrier()
    if xcoll.rank() == 1:
        return "skipped"
    out = xcoll.gather(torch.ones(2), sync=False)
    try:
        xcoll.sync()
    except RuntimeError as e:
        # (the call, the replica, and the engine's own error after them)
        return str(e).split(": ")[:3]
    return out.tolist()


def test_a_call_in_flight_that_times_out_says_which_call():
    from xcoll.testing import GlooPool

    with GlooPool(2, timeout=120, collective_timeout=3) as pool:
        got = pool.run(_skipped_by_a_peer, [None] * 2)
    assert got[1] == "skipped", got
    assert got[0][:2] == ["xcoll.gather", "a collective did not complete on rank 0"], got
    assert "Timed out" in got[0][2] or "timed out" in got[0][2], got


def _skipped_and_overlapped(_=None):
    """As :func:`_skipped_by_a_peer`, and another thread of rank 0 calls on
    the group while its sync waits: that call raises at once; the sync's own
    error (the engine's) is still the one the sync raises."""
    xcoll.barrier()
    if xcoll.rank() == 1:
        return "skipped"
    out = xcoll.gather(torch.ones(2), sync=False)
    thread, raised = _a_call_meanwhile()
    try:
        xcoll.sync()
    except RuntimeError as e:
        got = [type(e).__name__, *str(e).split(": ")[:2]]
    else:
        got = out.tolist()
    thread.join(60)
    return got, raised


def test_a_call_in_flight_that_times_out_while_another_thread_calls_says_which_call():
    from xcoll.testing import GlooPool

    with GlooPool(2, timeout=120, collective_timeout=3) as pool:
        got = pool.run(_skipped_and_overlapped, [None] * 2)
    assert got == [
        (
            ["RuntimeError", "xcoll.gather", "a collective did not complete on rank 0"],
            ["xcoll.gather: called on rank 0"],
        ),
        "skipped",
    ], got


# ---- gradients through a call in flight ------------------------------------------


def _grads(sync: bool):
    rank = xcoll.rank()
    x = (torch.arange(6.0, dtype=torch.float64).reshape(3, 2) + rank).requires_grad_()
    w = torch.arange(6.0 * xcoll.world_size(), dtype=torch.float64).reshape(-1, 2)
    every = xcoll.gather(x, grad=True, sync=sync)
    (every * w).sum().backward()
    xcoll.sync()
    return x.grad


def test_the_gradient_through_a_call_in_flight_is_the_blocking_calls(gloo):
    w = gloo.world_size
    for blocking, flying in zip(gloo.run(_grads, [True] * w), gloo.run(_grads, [False] * w), strict=True):
        assert torch.equal(blocking, flying)


def test_a_world_of_one_completes_at_once():
    out = xcoll.gather(torch.ones(2), sync=False)
    assert type(out) is torch.Tensor and not isinstance(out, PendingTensor)


def _freed(_):
    import gc
    import weakref

    out = xcoll.gather({"x": torch.ones(4)}, sync=False)["x"]
    assert out.sum().item() == 4 * xcoll.world_size()  # (its first use completes it)
    call = weakref.ref(out._call)
    del out
    gc.collect()
    return call() is None


def test_a_completed_call_is_freed_with_its_outputs(gloo):
    # (kept as the group's latest call in flight, its outputs would live
    # until the group's next call)
    assert gloo.run(_freed, [None] * gloo.world_size) == [True] * gloo.world_size


# ---- collectives in the calls' order, whoever reads first ------------------------


def _two_dtypes(rank):
    # (two buckets over 4 KiB: two collectives, the second after the first's header)
    return {"a": torch.ones(1) * (rank + 1), "b": torch.full((512,), 1000.5 + rank, dtype=torch.float64)}


def _next_calls(rank):
    """The calls a replica makes after the call in flight, by the test's name."""
    return {
        "two dtypes": lambda: xcoll.reduce(_two_dtypes(rank)),
        "metrics": lambda: xcoll.reduce({"loss": torch.tensor(0.5 * rank), "count": torch.tensor(rank)}),
        "gather next": lambda: xcoll.gather(torch.arange(3.0) + rank),
        "17 MiB gather": lambda: xcoll.reduce(_two_dtypes(rank), "max"),
        "barrier next": lambda: xcoll.barrier("next"),
        "object next": lambda: xcoll.gather_object({"rank": rank}),
    }


def _in_flight_call(case, rank):
    if case == "metrics":
        return lambda **k: xcoll.reduce({"loss": torch.tensor(0.25 + rank), "count": torch.tensor(3 + rank)}, **k)
    if case == "17 MiB gather":  # (a bucket of 16 MiB or more travels alone: two collectives)
        big = {"big": torch.arange(17 << 18, dtype=torch.float32) + rank, "small": torch.ones(3) * rank}
        return lambda **k: xcoll.gather(big, **k)
    return lambda **k: xcoll.reduce(_two_dtypes(rank), **k)


def _read_early_by_some(args):
    """A call in flight read (printed) by ``readers`` alone before the next
    call, which every replica then makes (or a raw ``dist.all_reduce``);
    the others read it after. Every value is the blocking calls'."""
    import io

    import torch.distributed as dist

    case, readers = args
    rank = xcoll.rank()
    call = _in_flight_call(case, rank)
    raw = case.startswith("raw")
    after = None if raw else _next_calls(rank)[case]
    want = to_cpu(call())
    want_after = None if raw else to_cpu(after())
    got = call(sync=False)
    if rank in readers:
        print(got, file=io.StringIO())  # (as rank-0 logging does)
    if raw:
        t = torch.arange(4.0) * (rank + 1)
        dist.all_reduce(t)
        got_after = t
    else:
        got_after = to_cpu(after())
    out = to_cpu(got)
    w = xcoll.world_size()
    if raw:
        want_after = torch.arange(4.0) * (w * (w + 1) // 2)
    return _equal(out, want), _equal(got_after, want_after)


def _equal(got, want) -> bool:
    pairs = zip(leaves(got), leaves(want), strict=True)
    return all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in pairs)


_ORDER_CASES = ["two dtypes", "metrics", "gather next", "17 MiB gather", "barrier next", "object next", "raw dist"]


@pytest.mark.parametrize("case", _ORDER_CASES)
@pytest.mark.parametrize("readers", ["rank 0", "the others"])
def test_a_call_in_flight_read_early_by_some_replicas_keeps_the_calls_order(gloo, case, readers):
    w = gloo.world_size
    who = [0] if readers == "rank 0" else list(range(1, w))
    assert gloo.run(_read_early_by_some, [(case, who)] * w, timeout=240) == [(True, True)] * w


# ---- the tensor API of an output in flight ------------------------------------


def _storage_api(_=None):
    """What reads an output's storage itself (which a wrapper has none of):
    each completes the call and reads the value's."""
    x = torch.arange(6.0).reshape(2, 3) + xcoll.rank()
    want = xcoll.gather(x)
    a, b = xcoll.gather(x, sync=False), xcoll.gather(x * 2, sync=False)
    ptrs = a.data_ptr(), b.data_ptr()
    if hasattr(torch.Tensor, "const_data_ptr"):  # (newer torch's)
        c = xcoll.gather(x, sync=False)
        ptrs = ptrs if c.const_data_ptr() == c.value().data_ptr() != 0 else (0, 0)
    dl = torch.from_dlpack(xcoll.gather(x, sync=False))
    shared = xcoll.gather(x, sync=False)
    same = shared.share_memory_() is shared
    storage = xcoll.gather(x, sync=False).untyped_storage()
    return (
        ptrs[0] != ptrs[1] and 0 not in ptrs,
        torch.equal(dl, want),
        same and shared.is_shared() and torch.equal(shared, want),
        bytes(storage) == want.numpy().tobytes(),
        torch.equal(torch.tensor(xcoll.gather(x, sync=False).storage().tolist()).view(want.shape), want),
    )


def test_outputs_in_flight_read_their_values_storage(gloo):
    w = gloo.world_size
    assert gloo.run(_storage_api, [None] * w) == [(True,) * 5] * w


# (the zero-argument methods whose outputs are the same on a value and on an
# output in flight: those that draw random numbers, or name an object, differ)
_OWN = {"__hash__", "__getstate__", "__dlpack__", "__iter__", "__sizeof__", "__dir__", "__init_subclass__"}
_OWN |= {"data_ptr", "const_data_ptr"}  # (the value's: _storage_api)


def _every_method(_=None):
    """Every zero-argument method of a tensor, on an output in flight and on
    the blocking call's value: each completes the call and gives the value's
    outcome (the same exception, or the same result for the deterministic
    ones); none crashes the process."""
    import contextlib
    import io
    import warnings

    warnings.simplefilter("ignore")
    x = torch.arange(6.0).reshape(2, 3) + xcoll.rank()
    want = xcoll.gather(x)
    differ = {}
    for name in sorted(dir(torch.Tensor)):
        if name.startswith("__") and name not in ("__array__", "__repr__", "__len__", "__dlpack_device__"):
            continue
        if not callable(getattr(torch.Tensor, name)) or name in _OWN:
            continue
        outcomes = []
        for t in (xcoll.gather(x, sync=False), want.clone()):
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    outcomes.append(repr(getattr(t, name)()))
            except Exception as e:
                outcomes.append(type(e).__name__)
        if outcomes[0] != outcomes[1] and not name.endswith("_"):  # (in place: random draws)
            differ[name] = outcomes
    return differ


def test_every_method_of_an_output_in_flight_gives_its_values_outcome(gloo):
    w = gloo.world_size
    assert gloo.run(_every_method, [None] * w) == [{}] * w


def _dropped(_=None):
    """Calls in flight whose outputs are dropped unused: the RSS (MB) after
    300 of them, and after 3,000."""
    import gc

    x = torch.ones(1 << 14) * xcoll.rank()  # (64 KiB)

    def rss() -> float:
        gc.collect()
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    for _ in range(300):
        xcoll.gather(x, sync=False)
    after_300 = rss()
    for _ in range(2700):
        xcoll.gather(x, sync=False)
    return after_300, rss()


def test_outputs_dropped_unused_release_their_buffers(gloo):
    for after_300, after_3000 in gloo.run(_dropped, [None] * gloo.world_size, timeout=600):
        assert after_3000 - after_300 < 20, (after_300, after_3000)
