"""torch.distributed specifics: agreement with accelerate's per-leaf collectives,
one collective call per bucket, sub-groups, and the same results as XLA."""

from __future__ import annotations

import collections
import os

import hypothesis.strategies as st
import optree
import pytest
import torch
import torch.distributed as dist
from hypothesis import given

import xcoll
from tests import strategies as S
from tests.helpers import PROPERTY, assert_trees, same_bits, same_values
from tests.replicas import device, engine_calls, shared_pool, to_cpu, to_device
from xcoll.testing import GlooPool

_pools: dict[int, GlooPool] = {}


@pytest.fixture(scope="module", params=["gloo-2", "gloo-4"])
def gloo(request):
    return shared_pool(request.param)


# ---- accelerate ----------------------------------------------------------------


def _with_accelerate(tree):
    os.environ["USE_TORCH_XLA"] = "0"  # accelerate would otherwise import torch_xla
    from accelerate import PartialState
    from accelerate.utils import broadcast, gather, reduce

    PartialState(cpu=True)  # joins the process group that is already initialised
    clone = lambda t: optree.tree_map(torch.clone, t)  # noqa: E731 - accelerate's broadcast is in place
    return {
        "gather": (to_cpu(gather(clone(tree))), to_cpu(xcoll.gather(tree))),
        "sum": (to_cpu(reduce(clone(tree), "sum")), to_cpu(xcoll.reduce(tree, "sum"))),
        "mean": (
            to_cpu(reduce(optree.tree_map(lambda t: t.double(), tree), "mean")),
            to_cpu(xcoll.reduce(optree.tree_map(lambda t: t.double(), tree), "mean")),
        ),
        "broadcast": (
            to_cpu(broadcast(clone(tree), from_process=1)),
            to_cpu(xcoll.broadcast(tree, src=1)),
        ),
    }


def _tensor_skeletons():
    dtypes = [torch.float32, torch.float64, torch.int32, torch.int64]
    shapes = st.lists(st.integers(1, 3), min_size=1, max_size=3).map(tuple)
    leaf = st.builds(S.TensorSpec, st.sampled_from(dtypes), shapes, st.just(False))
    return st.dictionaries(
        st.text("abcd", min_size=1, max_size=2),
        leaf | st.lists(leaf, max_size=2),
        min_size=1,
        max_size=4,
    )


def _alone(tree):
    """:func:`_with_accelerate` with every move's bucket of one tensor of 16
    bytes or more travelling alone (xcoll's threshold is 16 MiB), and no output
    sharing memory with an input."""
    from xcoll._core import ops as _ops

    with _ops.tuned(alone=16):
        report = _with_accelerate(tree)
        mine = {t.untyped_storage().data_ptr() for t in optree.tree_leaves(tree)}
        # (a reduce encodes its own buffer in place: never the leaves)
        for out in (xcoll.gather(tree), xcoll.broadcast(tree), xcoll.reduce(tree, "max")):
            for t in optree.tree_leaves(out):
                assert t.untyped_storage().data_ptr() not in mine
        return report


@PROPERTY
@given(data=st.data())
@pytest.mark.parametrize("run", [_with_accelerate, _alone], ids=["packed", "alone"])
def test_same_values_as_accelerate(gloo, run, data):
    skeleton = data.draw(_tensor_skeletons(), "skeleton")
    # (same dict order on every rank: accelerate's per-leaf collectives follow it)
    trees = data.draw(S.rank_trees(skeleton, gloo.world_size, exact=True, reorder=False), "trees")
    for r, report in enumerate(gloo.run(run, trees)):
        for what, (theirs, ours) in report.items():
            equal = same_bits if what in ("gather", "broadcast") else same_values
            assert_trees(ours, theirs, equal, f"rank {r}: {what}")


# ---- one collective call per bucket ---------------------------------------------------

# the process group's collectives, by the method xcoll's DistTransport calls
# (tests/replicas.py: engine_calls)
GATHER = "_allgather_base"


def _count_calls(n_leaves, big=2, widen=None):
    """Calls xcoll on a tree of ``n_leaves`` leaves of 5 dtypes (the first of
    ``big`` rows, the others of 2) with the process group's collectives
    recorded (and ``Tuning.widen`` set to ``widen``, if given), and returns how
    often each was called."""
    from xcoll._core import ops as _ops

    xcoll.gather(xcoll.rank())  # a process's first call is checked in full: not counted here
    dtypes = [torch.float32, torch.int64, torch.bfloat16, torch.int32, torch.uint8]
    tree = {
        f"x{i:03d}": torch.full(
            (big if i == 0 else 2, 3), xcoll.rank() + i, dtype=dtypes[i % len(dtypes)]
        )
        for i in range(n_leaves)
    }
    calls = {}
    changes = {} if widen is None else {"widen": widen}
    with engine_calls() as engine, _ops.tuned(**changes):
        # (a guarded call of at most 4 KiB is one all-gather, whatever its
        # buckets: docs/reliability.md; the buckets' own collectives are those
        # of an unguarded call, and of a larger one)
        xcoll.reduce(tree, "sum")
        calls["guarded sum"] = dict(collections.Counter(name for name, _ in engine))
    with engine_calls() as engine, _ops.tuned(**changes), xcoll.consistency_checks("never"):
        for what, fn in [
            ("gather", lambda: xcoll.gather(tree)),
            ("sum", lambda: xcoll.reduce(tree, "sum")),
            (
                "mean+max",
                lambda: xcoll.reduce(
                    tree,
                    {k: ("mean" if v.is_floating_point() else "max") for k, v in tree.items()},
                ),
            ),
            ("broadcast", lambda: xcoll.broadcast(tree, src=xcoll.world_size() - 1)),
        ]:
            start = len(engine)
            out = fn()
            calls[what] = dict(collections.Counter(name for name, _ in engine[start:]))
            for key, got in out.items():  # and the values, on every rank
                assert torch.equal(got, _expected(what, tree[key], int(key[1:]))), (what, key)
    return calls


def _expected(what: str, leaf: torch.Tensor, i: int) -> torch.Tensor:
    """What ``_count_calls``'s call ``what`` gives for leaf ``i``, whose rank r holds r + i."""
    w = xcoll.world_size()
    if what == "gather":
        return torch.cat([torch.full_like(leaf, r + i) for r in range(w)])
    value = {
        "sum": sum(r + i for r in range(w)),
        "mean+max": (w - 1) / 2 + i if leaf.is_floating_point() else w - 1 + i,
        "broadcast": w - 1 + i,
    }[what]
    return torch.full_like(leaf, value)


@pytest.mark.parametrize("n_leaves", [5, 60])
def test_one_collective_call_per_move_and_per_reduced_bucket(gloo, n_leaves):
    expected = {
        "guarded sum": {GATHER: 1},
        "gather": {GATHER: 1},  # every dtype in one buffer
        # bfloat16 joins float32 (it accumulates in float32 anyway), int32 and
        # uint8 join int64 (every value fits; sums wrap the same once cast back)
        "sum": {"allreduce": 2},
        "mean+max": {"allreduce": 2},  # float32 and bfloat16 mean, the integers' max
        "broadcast": {"broadcast": 1},
    }
    assert gloo.run(_count_calls, [n_leaves] * gloo.world_size) == [expected] * gloo.world_size


def _wrapping(_):
    """Merged integer reduces against one torch.distributed all-reduce per
    leaf in its own dtype, with values whose sums and products wrap: ``(op,
    all-reduce calls merged, unmerged, every output equal bit for bit)``."""
    from xcoll._core import ops as _ops

    r = xcoll.rank()
    tree = {
        "i32": torch.tensor([2**31 - 10 - 7 * r, 65536 + r], dtype=torch.int32),
        "u8": torch.tensor([200 + r, 3 + r], dtype=torch.uint8),
        "i8": torch.tensor([-120 - r, 100 + r], dtype=torch.int8),
        "i64": torch.tensor([-(2**62) - r, 2**40 + r], dtype=torch.int64),
    }
    flags = {"flag": torch.tensor([r == 0, True, False])}
    reduce_op = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT}
    reduce_op.update({"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN})

    def per_leaf(t, op):
        x = t.to(torch.uint8) if t.dtype == torch.bool else t.clone()
        dist.all_reduce(x, reduce_op[op])
        return x.bool() if t.dtype == torch.bool else x

    out = []
    for op in ("sum", "prod", "max", "min"):
        x = tree | (flags if op in ("max", "min") else {})
        expected = {k: per_leaf(t, op) for k, t in x.items()}
        got = []
        for widen in (_ops.Tuning().widen, 0):
            # (unguarded: a guarded call this small is one all-gather)
            with engine_calls() as engine, _ops.tuned(widen=widen), xcoll.consistency_checks("never"):
                result = xcoll.reduce(x, op)
            got.append(sum(name == "allreduce" for name, _ in engine))
            got.append(
                all(
                    torch.equal(result[k], v) and result[k].dtype == v.dtype
                    for k, v in expected.items()
                )
            )
        out.append((op, *got))
    return out


def test_merged_integer_reduces_wrap_as_each_dtype_does(gloo):
    if gloo.world_size == 1:
        pytest.skip("nothing wraps with one replica")
    w = gloo.world_size
    # merged: one all-reduce (int64 holds every value); apart: one per dtype
    expected = [("sum", 1, True, 4, True), ("prod", 1, True, 4, True)]
    expected += [("max", 1, True, 5, True), ("min", 1, True, 5, True)]
    assert gloo.run(_wrapping, [None] * w) == [expected] * w


# Integer dtypes in the order of xcoll._encode.wire.INTS: a merged bucket takes the
# widest one present (the last), which holds every value of each one before it,
# except uint8's in int8.
_INT_ORDER = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
# Per dtype, values on both sides of its sign bit (or of 128 for uint8), and
# its extremes, whose sums and products wrap; rolled by rank, so that every
# element's replicas hold values on both sides (a max of uint8 200 and 3 that
# travelled as int8 would be 3).
_CROSSING = {
    torch.bool: [True, False, True, False, False, True],
    torch.uint8: [200, 3, 130, 127, 255, 0],
    torch.int8: [-120, 100, -1, 0, 127, -128],
    torch.int16: [32000, -32000, 200, -129, 32767, -32768],
    torch.int32: [2**31 - 10, -(2**31), 65536, -1, 200, 3],
    torch.int64: [-(2**62), 2**40, 2**63 - 1, -1, 200, 3],
}


def _each_widest(_):
    """For each integer dtype in turn as the widest: every op on a tree of it
    and every integer dtype before it (and bools, for the ops that take them),
    merged and with Tuning.widen=0, against the fold over every rank's leaf in its own
    dtype (gloo has no int16 collective to compare with): ``(widest, op,
    all-reduce calls merged, equal, calls apart, equal)`` each."""
    from xcoll._core import ops as _ops

    r, w = xcoll.rank(), xcoll.world_size()
    fold = {"sum": torch.add, "prod": torch.mul, "max": torch.maximum, "min": torch.minimum}
    bools = {"prod": torch.logical_and, "max": torch.logical_or, "min": torch.logical_and}

    def per_leaf(d, op):
        f = bools[op] if d == torch.bool else fold[op]
        acc = torch.tensor(_CROSSING[d], dtype=d)
        for k in range(1, w):  # (each rank's leaf, in its own dtype: integers wrap)
            acc = f(acc, torch.tensor(_CROSSING[d], dtype=d).roll(k))
        return acc

    out = []
    for widest in _INT_ORDER[1:]:
        dtypes = _INT_ORDER[1 : _INT_ORDER.index(widest) + 1]
        for op in ("sum", "prod", "max", "min"):
            with_bools = [torch.bool] if op != "sum" else []
            tree = {
                str(d).removeprefix("torch."): torch.tensor(_CROSSING[d], dtype=d).roll(r)
                for d in with_bools + dtypes
            }
            expected = {k: per_leaf(t.dtype, op) for k, t in tree.items()}
            got = [str(widest).removeprefix("torch."), op]
            for widen in (_ops.Tuning().widen, 0):
                # (unguarded: a guarded call this small is one all-gather)
                never = xcoll.consistency_checks("never")
                with engine_calls() as engine, _ops.tuned(widen=widen), never:
                    result = xcoll.reduce(tree, op)
                got.append(sum(name == "allreduce" for name, _ in engine))
                same = [torch.equal(result[k], e) for k, e in expected.items()]
                got.append(all(same) and all(result[k].dtype == tree[k].dtype for k in tree))
            out.append(tuple(got))
    return out


def test_merged_integer_buckets_whose_widest_dtype_is_each_integer_dtype(gloo):
    w = gloo.world_size
    expected = []
    for widest in _INT_ORDER[1:]:
        name = str(widest).removeprefix("torch.")
        n = _INT_ORDER.index(widest)  # integer dtypes in the tree
        for op in ("sum", "prod", "max", "min"):
            bools = op != "sum"
            # merged: one all-reduce, and uint8 its own beside int8 (int8 cannot
            # hold it), and a prod's bools their own (a bool's prod is its min);
            # apart: one per dtype
            merged = (2 if widest == torch.int8 else 1) + (op == "prod")
            expected.append((name, op, merged, True, n + bools, True))
    assert gloo.run(_each_widest, [None] * w) == [expected] * w


def _count_unwidened(_):
    return _count_calls(5, widen=0)


def test_integers_too_large_to_widen_keep_their_own_collective(gloo):
    expected = {
        "guarded sum": {GATHER: 1},
        "gather": {GATHER: 1},
        "sum": {"allreduce": 4},  # float32 with bfloat16; int64, int32, uint8 each
        "mean+max": {"allreduce": 4},
        "broadcast": {"broadcast": 1},
    }
    assert gloo.run(_count_unwidened, [None] * gloo.world_size) == [expected] * gloo.world_size


def _widened_at_the_bound(_):
    """Two int32 leaves of 5 elements and an int64 one, reduced with
    ``Tuning.widen`` at 80 and at 79 bytes: the int32 bucket widened to int64
    is 10 elements of 8 bytes. Returns the all-reduces of each call and
    whether its values are the sums."""
    from xcoll._core import ops as _ops

    rank, w = xcoll.rank(), xcoll.world_size()
    tree = {
        "wide": torch.full((1,), rank + 2**40, dtype=torch.int64),
        "a": torch.arange(5, dtype=torch.int32) + rank,
        "b": torch.arange(5, dtype=torch.int32) - rank,
    }
    ranks = sum(range(w))
    want = {
        "wide": torch.full((1,), ranks + w * 2**40, dtype=torch.int64),
        "a": torch.arange(5, dtype=torch.int32) * w + ranks,
        "b": torch.arange(5, dtype=torch.int32) * w - ranks,
    }
    out = []
    for widen in (80, 79):
        with engine_calls() as engine, _ops.tuned(widen=widen), xcoll.consistency_checks("never"):
            got = xcoll.reduce(tree, "sum")
        exact = all(same_values(got[k], want[k]) for k in want)
        out.append((sum(name == "allreduce" for name, _ in engine), exact))
    return out


def test_the_widening_bound_counts_a_buckets_elements_not_each_leafs(gloo):
    # (each int32 leaf alone is 40 bytes widened, within either bound)
    want = [(1, True), (2, True)]
    assert gloo.run(_widened_at_the_bound, [None] * gloo.world_size) == [want] * gloo.world_size


def _count_alone(_):
    from xcoll._core import ops as _ops

    with _ops.tuned(alone=1024):
        return _count_calls(3, big=256)


def test_a_large_leaf_travels_alone_after_the_rest(gloo):
    # x000 (float32, 256 x 3: 3 KiB) alone; the header, x001 and x002 in one buffer
    expected = {
        "guarded sum": {GATHER: 1},
        "gather": {GATHER: 2},
        "sum": {"allreduce": 2},
        "mean+max": {"allreduce": 2},
        "broadcast": {"broadcast": 2},
    }
    assert gloo.run(_count_alone, [None] * gloo.world_size) == [expected] * gloo.world_size


# Per leaf, its 16-bit dtype and four bit patterns: float16's and bfloat16's a
# NaN with a payload, an infinity, a subnormal and negative zero; int16's
# extremes, -1, 1.
_PATTERNS = {
    "h": (torch.float16, (0x7C01, 0xFC00, 0x0001, 0x8000)),
    "b": (torch.bfloat16, (0xFF81, 0x7F80, 0x0001, 0x8000)),
    "i": (torch.int16, (0x7FFF, 0x8000, 0xFFFF, 0x0001)),
}


def _sixteen_bits(rank, world):
    """Rank ``rank``'s leaves: per dtype, ``world`` parts of its four patterns,
    part ``j`` rotated by ``rank + j`` (each part holds every pattern, and each
    replica's leaf is its own)."""
    out = {}
    for name, (dtype, patterns) in _PATTERNS.items():
        bits = torch.tensor(patterns, dtype=torch.int32).to(torch.int16)  # (wraps: 0x8000 is -32768)
        out[name] = torch.cat([bits.roll(-(rank + j)) for j in range(world)]).view(dtype)
    return out


def _sixteen_bits_alone(_):
    from xcoll._core import ops as _ops

    r, w = dist.get_rank(), dist.get_world_size()
    x = _sixteen_bits(r, w)
    with _ops.tuned(alone=16, widen=0):  # (each leaf its own buffer, as a leaf of 16 MiB would be)
        return {
            "gather": xcoll.gather(x),
            "broadcast": xcoll.broadcast(x, src=w - 1),
            "reduce_scatter": xcoll.reduce_scatter({"i": x["i"]}),  # (int16 extremes: it wraps)
        }


def test_sixteen_bit_leaves_that_travel_alone_arrive_bit_for_bit(gloo):
    # Gloo has no int16 collective: an int16 buffer (float16 and bfloat16 as
    # their bits) moves as its bytes and is reduced widened to int32.
    w = gloo.world_size
    every = [_sixteen_bits(r, w) for r in range(w)]
    out = gloo.run(_sixteen_bits_alone, [None] * w)
    for r, o in enumerate(out):
        part = slice(4 * r, 4 * (r + 1))
        expected = {
            "gather": {k: torch.cat([e[k] for e in every]) for k in every[0]},
            "broadcast": every[-1],
            "reduce_scatter": {"i": torch.stack([e["i"][part] for e in every]).sum(0, dtype=torch.int16)},
        }
        assert_trees(o, expected, same_bits, r)


# ---- sub-groups --------------------------------------------------------------------


def _in_subgroup(_):
    group = dist.new_group([0, 2])  # every rank must take part in creating it
    if xcoll.rank() not in (0, 2):
        return None
    x = {"v": torch.tensor([float(xcoll.rank())]), "n": xcoll.rank()}
    return {
        "rank": xcoll.rank(group),
        "world": xcoll.world_size(group),
        "gather": xcoll.gather(x, group=group),
        "sum": xcoll.reduce(x, group=group),
        "broadcast": xcoll.broadcast(x, src=1, group=group),  # group rank 1 is global rank 2
    }


def test_sub_group():
    out = shared_pool("gloo-4").run(_in_subgroup, [None] * 4)
    assert out[1] is None and out[3] is None
    for r, o in ((0, out[0]), (2, out[2])):
        assert (o["rank"], o["world"]) == (r // 2, 2)
        assert torch.equal(o["gather"]["v"], torch.tensor([0.0, 2.0])) and o["gather"]["n"] == [
            0,
            2,
        ]
        assert torch.equal(o["sum"]["v"], torch.tensor([2.0])) and o["sum"]["n"] == 2
        assert torch.equal(o["broadcast"]["v"], torch.tensor([2.0])) and o["broadcast"]["n"] == 2


def _one_call_on_two_group_sizes(_):
    """The same calls on the whole world (W=4), then on a pair of it, then
    on the world again: each one's results (the pair's members only)."""
    pair = dist.new_group([1, 3])  # every rank must take part in creating it
    r = dist.get_rank()
    x = {"v": torch.tensor([float(r), 1.0])}
    out = []
    for group in (None, pair, None):
        if group is None or r in (1, 3):
            out.append([
                xcoll.gather(x, group=group)["v"].tolist(),
                xcoll.reduce(x, group=group)["v"].tolist(),
                xcoll.reduce(x, "max", group=group)["v"].tolist(),
                xcoll.broadcast(x, src=1, group=group)["v"].tolist(),
            ])
    return out


def test_one_call_on_groups_of_two_sizes_is_guarded_for_each():
    # (a guard header kept for the call's signature without the group's
    # size would be the world's on the pair: a false mismatch)
    world = [[0, 1, 1, 1, 2, 1, 3, 1], [6, 4], [3, 1], [1, 1]]
    on_pair = [[1, 1, 3, 1], [4, 2], [3, 1], [3, 1]]
    got = shared_pool("gloo-4").run(_one_call_on_two_group_sizes, [None] * 4)
    for r, calls in enumerate(got):
        assert calls == ([world, on_pair, world] if r in (1, 3) else [world, world]), (r, calls)


def _outside_a_subgroup(_):
    group = dist.new_group([0, 1])  # every rank must take part in creating it
    r = dist.get_rank()
    x = {"v": torch.tensor([float(r)])}
    if r in (0, 1):  # the members: they communicate with each other only
        return xcoll.gather(x, group=group)["v"].tolist()
    calls = {
        "gather": lambda: xcoll.gather(x, group=group),
        "reduce of scalars": lambda: xcoll.reduce({"n": r}, group=group),
        "rank": lambda: xcoll.rank(group),
        "gather_object": lambda: xcoll.gather_object(r, group=group),
    }
    raised = {}
    for name, call in calls.items():
        try:
            raised[name] = ("returned", call())
        except Exception as e:  # noqa: BLE001 - reported to the test
            raised[name] = (type(e).__name__, str(e))
    return raised


_NOT_A_MEMBER = (
    "group={!r} is GroupMember.NON_GROUP_MEMBER, what dist.new_group returns to the processes "
    "it leaves out: this process (global rank {}) is not a member of that group, and only its "
    "members may call on it"
)


def test_a_rank_outside_a_subgroup_is_refused_before_communicating():
    pool = shared_pool("gloo-4")
    out = pool.run(_outside_a_subgroup, [None] * 4)
    assert out[0] == out[1] == [0.0, 1.0]
    for r in (2, 3):
        for name, (kind, message) in out[r].items():
            assert kind == "ValueError", (r, name, kind, message)
            assert message == _NOT_A_MEMBER.format(dist.GroupMember.NON_GROUP_MEMBER, r), message
    # nothing was sent on the world or on the group: the pool goes on
    assert pool.run(_world_sum, [None] * 4) == [4] * 4


def _world_sum(_):
    return xcoll.reduce({"n": 1})["n"]


def _on_an_nccl_group(_):
    r = dist.get_rank()
    torch.cuda.set_device(r)
    group = dist.new_group(backend="nccl")  # (the world's default group stays gloo's)
    try:
        return to_cpu(
            {
                # no tensor leaves: the scalars travel on the current CUDA device, as NCCL needs
                "scalars": xcoll.reduce({"n": r + 1, "x": 0.5}, group=group),
                "gather": xcoll.gather({"v": torch.full((1,), float(r), device="cuda")}, group=group),
            }
        )
    finally:
        dist.destroy_process_group(group)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nccl: needs two CUDA devices (one per rank)")
def test_an_nccl_group_carries_scalars_and_cuda_leaves():
    out = shared_pool("gloo-2").run(_on_an_nccl_group, [None] * 2)
    for o in out:
        assert o["scalars"] == {"n": 3, "x": 1.0}, o
        assert torch.equal(o["gather"]["v"], torch.tensor([0.0, 1.0])), o


# ---- the transport's own errors ------------------------------------------------------


def _transport_errors(_):
    import gc

    from xcoll._backends.base import EngineError
    from xcoll._backends.dist import DistTransport

    pg = dist.new_group([0, 1])
    # (gloo connects a new group's pairs as it is made, and one rank may return
    # first: destroyed below before the other had connected, the group's making
    # failed there with "Connection closed by peer". The barrier waits for both.)
    dist.barrier(group=pg)
    t = DistTransport(None, None, pg)  # as on the default group: the transport holds it weakly
    raised = {}
    try:  # a collective that gloo refuses as it starts (xcoll's own calls check src first)
        t.broadcast(torch.zeros(2), src=5)
    except EngineError as e:
        raised["start"] = (str(e), str(e.__cause__))
    # The default group destroyed while a call runs (another thread's
    # destroy_process_group): the group is gone when the collective starts.
    dist.destroy_process_group(pg)
    del pg
    gc.collect()
    try:
        t.all_gather(torch.zeros(2))
    except EngineError as e:
        raised["destroyed"] = str(e)
    return raised


def test_a_collective_that_cannot_start_or_whose_group_is_gone_raises_an_engine_error():
    # (an EngineError is what the guard diagnoses on every replica, and it
    # keeps the engine's own message)
    for raised in shared_pool("gloo-2").run(_transport_errors, [None] * 2):
        message, engines = raised["start"]  # (gloo's words: "...: invalid root rank: 5")
        assert message == engines and "root rank" in message, raised
        assert raised["destroyed"] == "the process group was destroyed (dist.destroy_process_group)"


# ---- the same results on XLA and gloo ----------------------------------------------


def _large_parts(_):
    """A reduce-scatter and an all-to-all of 8 KiB per replica: over the
    small calls' size, so each is the engine's own collective."""
    r = xcoll.rank()
    x = (torch.arange(2048.0) + 1000 * r).to(device())
    return to_cpu({"sum": xcoll.reduce_scatter(x), "parts": xcoll.all_to_all(x)})


@pytest.mark.parametrize("world", ["xla-cpu-2", "gloo-2"])
def test_large_reduce_scatters_and_all_to_alls_are_the_engines_own_and_exact(world):
    xs = [torch.arange(2048.0) + 1000 * r for r in range(2)]
    for r, got in enumerate(shared_pool(world).run(_large_parts, [None, None])):
        part = slice(1024 * r, 1024 * (r + 1))
        assert torch.equal(got["sum"], (xs[0] + xs[1])[part]), (world, r)
        assert torch.equal(got["parts"], torch.cat([xs[0][part], xs[1][part]])), (world, r)


def _all_ops(args):
    tree, op = args
    x = to_device(tree, device())
    return to_cpu(
        {
            "gather": xcoll.gather(x, stack=True),
            "reduce": xcoll.reduce(x, op),
            "broadcast": xcoll.broadcast(x, src=xcoll.world_size() - 1),
        }
    )


@PROPERTY
@given(data=st.data())
def test_same_results_on_xla_and_gloo(data):
    op = data.draw(st.sampled_from(["sum", "mean", "prod", "max", "min"]), "op")
    dtypes = {
        "sum": [d for d in S.DTYPES if d != torch.bool],
        "mean": [d for d in S.DTYPES if d.is_floating_point],
    }.get(op, S.DTYPES)
    skeleton = data.draw(
        st.dictionaries(st.text("ab", min_size=1, max_size=2), S._tensor_specs(dtypes), max_size=4),
        "skeleton",
    )
    trees = data.draw(S.rank_trees(skeleton, 2, exact=True), "trees")
    args = [(t, op) for t in trees]
    on_xla, on_gloo = (
        shared_pool("xla-cpu-2").run(_all_ops, args),
        shared_pool("gloo-2").run(_all_ops, args),
    )
    for a, b in zip(on_xla, on_gloo, strict=True):
        assert_trees(a["gather"], b["gather"], same_bits, "gather")
        assert_trees(a["broadcast"], b["broadcast"], same_bits, "broadcast")
        assert_trees(a["reduce"], b["reduce"], same_bits, f"reduce {op}")
