"""Uneven gathers: leaves whose size along dim differs between replicas."""

from __future__ import annotations

import random

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

import xcoll
from tests.helpers import PROPERTY, assert_trees, same_bits
from tests.replicas import counters, device, shared_pool, to_cpu, to_device

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool]


def shard(rank: int, n: int, seed: int) -> dict:
    """Rank ``rank``'s ``n`` samples: predictions, labels and a flag per sample."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return {
        "pred": torch.randn(n, 3, generator=g),
        "label": torch.randint(0, 5, (n,), generator=g),
        "extra": [
            torch.randn(2, n, generator=g).to(torch.bfloat16),
            torch.rand(n, generator=g) > 0.5,
        ],
        # every float16 bit pattern, NaN payloads included (the download keeps them)
        "half": torch.randint(-(2**15), 2**15, (n,), generator=g, dtype=torch.int16).view(
            torch.float16
        ),
        "rank": rank,
    }


def expected(sizes: list[int], seed: int, dim: int) -> dict:
    shards = [shard(r, n, seed) for r, n in enumerate(sizes)]
    return {
        "pred": torch.cat([s["pred"] for s in shards]),
        "label": torch.cat([s["label"] for s in shards]),
        "extra": [
            torch.cat([s["extra"][0] for s in shards], 1),
            torch.cat([s["extra"][1] for s in shards]),
        ],
        "half": torch.cat([s["half"] for s in shards]),
        "rank": list(range(len(sizes))),
    }


def _uneven(args):
    sizes, seed, kwargs = args
    x = to_device(shard(xcoll.rank(), sizes[xcoll.rank()], seed), device())
    # "extra"[0] grows along its last dim: gather it with dim=-1 in a second call
    first = xcoll.gather(
        {k: v for k, v in x.items() if k != "extra"} | {"flag": x["extra"][1]},
        uneven=True,
        **kwargs,
    )
    second = xcoll.gather(x["extra"][0], uneven=True, dim=-1, **kwargs)
    out = {
        "pred": first["pred"],
        "label": first["label"],
        "extra": [second, first["flag"]],
        "half": first["half"],
        "rank": first["rank"],
    }
    return to_cpu(out), sorted({t.device.type for t in (first["pred"], second)})


@PROPERTY
@given(data=st.data())
def test_uneven_gather_is_every_replicas_rows_in_rank_order(pool, data):
    w = pool.world_size
    sizes = data.draw(st.lists(st.integers(0, 9), min_size=w, max_size=w), "sizes")
    kwargs = {"to_cpu": data.draw(st.booleans(), "to_cpu")}
    if data.draw(st.booleans(), "max_size"):
        kwargs["max_size"] = max(sizes) + data.draw(st.integers(0, 3), "slack")
    seed = data.draw(st.integers(0, 100), "seed")
    results = pool.run(_uneven, [(sizes, seed, kwargs)] * w)
    for out, devices in results:
        assert_trees(out, expected(sizes, seed, 0), same_bits)
        assert devices == ["cpu" if kwargs["to_cpu"] else pool.device_type]


def _mismatch(_):
    rank = xcoll.rank()
    cols = 3 + rank % 2  # odd ranks have 4 columns
    # (before it, a leaf whose ranks differ along its dim alone, as they may)
    tree = {"a": torch.zeros(1 + rank, 2), "m": torch.zeros(3, cols)}
    return xcoll.gather({k: v.to(device()) for k, v in tree.items()}, uneven=True)


def test_other_dims_must_match_and_every_replica_says_so(pool):
    if pool.world_size == 1:
        pytest.skip("one replica cannot disagree with itself")
    failures = pool.run(_mismatch, [None] * pool.world_size, return_exceptions=True)
    # the guard, in the shape exchange, finds that the descriptions differ
    assert all(f.type_name == "xcoll.CollectiveMismatchError" for f in failures), failures
    assert all(
        "tree['m']" in f.message and "(*, 3)" in f.message and "(*, 4)" in f.message
        for f in failures
    )
    everyone = [v for r in range(pool.world_size) for v in range(r)]
    assert pool.run(_sizes_ok, [None] * pool.world_size) == [everyone] * pool.world_size


def _mismatch_unguarded(_):
    with xcoll.consistency_checks("never"):
        return _mismatch(None)


def test_other_dims_must_match_without_the_guard_too(pool):
    if pool.world_size == 1:
        pytest.skip("one replica cannot disagree with itself")
    failures = pool.run(_mismatch_unguarded, [None] * pool.world_size, return_exceptions=True)
    # the shape exchange's own check: every replica has every shape
    for f in failures:
        assert f.type_name == "builtins.ValueError", f
        assert (
            "tree['m']: an uneven gather along dim 0 needs the same other dims on every "
            "replica; rank 0 has shape (3, 3), rank 1 has (3, 4)" in f.message
        ), f
    everyone = [v for r in range(pool.world_size) for v in range(r)]
    assert pool.run(_sizes_ok, [None] * pool.world_size) == [everyone] * pool.world_size


def _along(dim: int):
    rank = xcoll.rank()
    x = torch.arange(2.0 * (1 + rank)).reshape(1 + rank, 2) + 10 * rank  # rank r: 1 + r rows
    return xcoll.gather({"x": x.to(device())}, uneven=True, dim=dim, to_cpu=True)


@pytest.mark.parametrize("world", ["gloo-2", "xla-cpu-2"])
def test_an_uneven_gathers_dim_is_in_range_as_torch_says(world):
    # -ndim is the first dim, as in torch; ndim is out of range (taken modulo
    # ndim it would gather along dim 0, quietly)
    pool = shared_pool(world)
    got = pool.run(_along, [-2, -2])
    rows = [torch.arange(2.0 * (1 + r)).reshape(1 + r, 2) + 10 * r for r in range(2)]
    assert all(torch.equal(g["x"], torch.cat(rows)) for g in got), got
    failures = pool.run(_along, [2, 2], return_exceptions=True)
    want = (
        "tree['x']: dim=2 is out of range for a leaf of shape (1, 2) (uneven gathers need a "
        "dim to grow)"
    )
    assert [getattr(f, "type_name", f) for f in failures] == ["builtins.ValueError"] * 2
    assert want in failures[0].message, failures[0]
    assert want.replace("(1, 2)", "(2, 2)") in failures[1].message, failures[1]


def _one_over_max_size(_):
    n = 5 if xcoll.rank() == 0 else 2  # only rank 0 exceeds
    return xcoll.gather({"x": torch.ones(n, 3).to(device())}, max_size=4, to_cpu=True)


def test_a_shard_over_max_size_is_an_error_on_every_replica(pool):
    failures = pool.run(_one_over_max_size, [None] * pool.world_size, return_exceptions=True)
    for f in failures:  # every replica, not just rank 0, instead of the others hanging
        assert f.type_name == "builtins.ValueError", f
        assert "tree['x']: rank 0 has size 5 along dim 0, more than max_size=4" in f.message
    everyone = [v for r in range(pool.world_size) for v in range(r)]
    assert pool.run(_sizes_ok, [None] * pool.world_size) == [everyone] * pool.world_size


def _sizes_ok(_):
    return xcoll.gather(torch.arange(xcoll.rank()).to(device()), uneven=True, to_cpu=True).tolist()


def test_refused_arguments():
    refused = "uneven gathers concatenate and run now: stack=True and sync=False do not apply"
    for kwargs in ({"stack": True}, {"sync": False}):
        with pytest.raises(ValueError) as e:
            xcoll.gather(torch.ones(2), uneven=True, **kwargs)
        assert str(e.value) == refused, kwargs
    with pytest.raises(ValueError, match="max_size"):
        xcoll.gather(torch.ones(2), max_size=-1)
    with pytest.raises(
        ValueError, match=r"tree\['x'\]: rank 0 has size 2 along dim 0, more than max_size=1"
    ):
        xcoll.gather({"x": torch.ones(2)}, max_size=1)
    with pytest.raises(ValueError, match=r"tree\['s'\]"):
        xcoll.gather({"s": torch.tensor(1.0)}, uneven=True)
    with xcoll.consistency_checks("always"):  # the check describes it with the same error
        with pytest.raises(ValueError, match=r"tree\['s'\].*uneven gathers need a dim"):
            xcoll.gather({"s": torch.tensor(1.0)}, uneven=True)


# ---- compile and execution counts on XLA ---------------------------------------------

SIZE_BUCKETS = 8  # sizes in [0, 64] pad to 0, 1, 2, 4, 8, 16, 32 or 64


def _calls(args):
    sizes_per_call, max_size = args
    rank = xcoll.rank()
    for call, sizes in enumerate(sizes_per_call):
        x = to_device(shard(rank, sizes[rank], call), device())
        batch = {"pred": x["pred"], "label": x["label"], "flag": x["extra"][1]}
        out = xcoll.gather(batch, uneven=True, max_size=max_size, to_cpu=True)
        assert out["pred"].shape[0] == sum(sizes)


def test_compiles_stay_within_the_size_buckets(xla4):
    w = xla4.world_size
    rng = random.Random(0)
    calls = [[rng.randint(0, 64) for _ in range(w)] for _ in range(50)]
    # (a pool's first call on its group also runs the consistency check: one
    # execution more, whichever test comes first)
    xla4.run(_calls, [([[0] * w], None)] * w)
    before = xla4.run(counters)[0]
    xla4.run(_calls, [(calls, None)] * w)
    after = xla4.run(counters)[0]
    # one graph for the shape exchange, at most one per size bucket for the data
    assert after["compiles"] - before["compiles"] <= 1 + SIZE_BUCKETS
    assert after["executions"] - before["executions"] <= 2 * 50 * w


def test_max_size_is_one_execution_per_replica(xla4):
    w = xla4.world_size
    rng = random.Random(1)
    calls = [[rng.randint(0, 16) for _ in range(w)] for _ in range(10)]
    xla4.run(_calls, [(calls[:1], 16)] * w)  # compile
    before = xla4.run(counters)[0]
    xla4.run(_calls, [(calls, 16)] * w)
    after = xla4.run(counters)[0]
    assert after["executions"] - before["executions"] == 10 * w
    assert after["compiles"] - before["compiles"] == 0


# ---- leaves with a dim of size 0, and later calls that differ (issue 21) ------------

#: The worlds where replicas can disagree, on both engines.
WORLDS = ["gloo-2", "gloo-4", "xla-cpu-2", "xla-cpu-4"]
#: Each rank's size along the growing dim: one replica at max_size (4, which
#: is also the XLA size bucket of 4) pads nothing while the others pad.
EMPTY_SIZES = [2, 4, 0, 1]


def _empty_shard(rank: int, n: int) -> tuple[dict, dict]:
    """Rank ``rank``'s leaves with a dim of size 0 next to ordinary ones:
    growing along dim 0, and along dim -1."""
    x = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3) + 100 * rank
    rows = {
        "z": torch.zeros(n, 0),
        "w": torch.zeros(n, 2, 0, dtype=torch.int64),
        "x": x,
        "flag": x[:, 0] > 100,
    }
    cols = {"z": torch.zeros(0, n, dtype=torch.bfloat16), "x": x.t().contiguous()}
    return rows, cols


def _gather_empty(_):
    rank = xcoll.rank()
    rows, cols = _empty_shard(rank, EMPTY_SIZES[rank])
    out = []
    for kwargs in ({"uneven": True}, {"max_size": 4}):
        out_rows = xcoll.gather(to_device(rows, device()), **kwargs)
        out_cols = xcoll.gather(to_device(cols, device()), dim=-1, to_cpu=True, **kwargs)
        out.append((to_cpu(out_rows), out_cols, sorted({t.device.type for t in out_rows.values()})))
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_leaves_with_a_dim_of_size_0(world):
    """With uneven=True and with max_size. Before: the replicas that pad (on
    XLA, or with max_size) raised torch's "negative output size" (no leaf
    path) and the one at the padded size entered the gather alone (XLA
    aborted; gloo waited for its timeout). (gloo without max_size gathers
    exact bytes, unpadded: it worked.)"""
    pool = shared_pool(world)
    w = pool.world_size
    shards = [_empty_shard(r, EMPTY_SIZES[r]) for r in range(w)]
    rows = {k: torch.cat([s[0][k] for s in shards]) for k in shards[0][0]}
    cols = {k: torch.cat([s[1][k] for s in shards], -1) for k in shards[0][1]}
    assert rows["z"].shape == (sum(EMPTY_SIZES[:w]), 0)
    assert cols["z"].shape == (0, sum(EMPTY_SIZES[:w]))
    for per_call in pool.run(_gather_empty, [None] * w):
        for out_rows, out_cols, on in per_call:
            assert_trees(out_rows, rows, same_bits)
            assert_trees(out_cols, cols, same_bits)
            assert on == [pool.device_type]


def _is_mismatch(f) -> bool:
    return f.type_name.endswith(".CollectiveMismatchError")


#: A call with max_size that odd ranks make differently, after a first call
#: that every replica makes alike: what differs, the leaf and its max_size.
LATER = {
    "other dim": lambda odd: (torch.zeros(2, 4 if odd else 3), 4),
    "max_size": lambda odd: (torch.zeros(2, 3), 3 if odd else 4),
    "dtype width": lambda odd: (torch.zeros(2, 3, dtype=torch.float64 if odd else None), 4),
}


def _later(case):
    first = xcoll.gather({"m": torch.zeros(2, 3).to(device())}, max_size=4, to_cpu=True)
    assert first["m"].shape == (2 * xcoll.world_size(), 3)
    leaf, max_size = LATER[case](xcoll.rank() % 2 == 1)
    return xcoll.gather({"m": leaf.to(device())}, max_size=max_size, to_cpu=True)


def _goes_on(cols):
    """The values of a call with max_size whose other dims are new to the
    group (where it comes after the calls above: more bytes than any of them,
    so that its room grows on every replica)."""
    rank = xcoll.rank()
    x = torch.arange(rank * cols, dtype=torch.float32).reshape(rank, cols) + 100 * rank
    return xcoll.gather({"m": x.to(device())}, max_size=4, to_cpu=True)["m"]


def _goes_on_expected(w: int, cols: int) -> torch.Tensor:
    return torch.cat(
        [torch.arange(r * cols, dtype=torch.float32).reshape(r, cols) + 100 * r for r in range(w)]
    )


@pytest.mark.parametrize("case", list(LATER))
@pytest.mark.parametrize("world", WORLDS)
def test_a_later_call_with_max_size_that_differs_raises_on_every_replica(world, case):
    """Before: the gather that carries the guard had a size of each replica's
    own (its padded data), so gloo killed the replica that received the larger
    buffer and XLA aborted on the replicas' different programs; the guard was
    never read. Now every replica raises and the pool goes on."""
    pool = shared_pool(world)
    w = pool.world_size
    failures = pool.run(_later, [case] * w, return_exceptions=True)
    assert all(_is_mismatch(f) for f in failures), failures
    expected = {
        "other dim": ("tree['m']", "(*, 3)", "(*, 4)"),
        "max_size": ("max_size=4", "max_size=3"),
        "dtype width": ("tree['m']", "float32", "float64"),
    }[case]
    for f in failures:
        assert all(e in f.message for e in expected), f
    # the same group goes on: a call with max_size that needs more room (on
    # every replica alike), and one without max_size
    cols = 7 + WORLDS.index(world) + 4 * list(LATER).index(case)
    for got in pool.run(_goes_on, [cols] * w):
        assert same_bits(got, _goes_on_expected(w, cols))
    everyone = [v for r in range(w) for v in range(r)]
    assert pool.run(_sizes_ok, [None] * w) == [everyone] * w


def _later_unguarded(case):
    with xcoll.consistency_checks("never"):
        return _later(case)


@pytest.mark.parametrize("case", list(LATER))
@pytest.mark.parametrize("world", WORLDS)
def test_a_later_call_with_max_size_that_differs_raises_without_the_guard_too(world, case):
    """With XCOLL_CHECK=never, the shapes and the bytes that travel with the
    data are compared (before: gloo killed a replica, XLA aborted)."""
    pool = shared_pool(world)
    w = pool.world_size
    failures = pool.run(_later_unguarded, [case] * w, return_exceptions=True)
    expected = (
        "tree['m']: an uneven gather along dim 0 needs the same other dims on every "
        "replica; rank 0 has shape (2, 3), rank 1 has (2, 4)"
        if case == "other dim"
        # (3 float32 columns at max_size 3: 36 bytes, padded to 8)
        else "the replicas' leaves have the same shapes but need different bytes at their "
        f"max_size (rank 0: 48, rank 1: {40 if case == 'max_size' else 96}): their dtypes "
        "or their max_size differ"
    )
    for f in failures:
        assert f.type_name == "builtins.ValueError", f
        assert expected in f.message, f
    for got in pool.run(_goes_on, [5] * w):
        assert same_bits(got, _goes_on_expected(w, 5))


def _room_shard(rank: int, cols: int) -> dict:
    """A tree of its own room key (3 tensor leaves, 2 scalars, max_size 1000)."""
    n = rank % 3
    x = torch.arange(n * cols, dtype=torch.float32).reshape(n, cols) + 100 * rank
    return {"a": x, "b": x[:, 0].long(), "c": torch.stack([x > 101, x < 103], -1), "s": 1.5, "t": rank}


def _room_call(cols):
    tree = to_device(_room_shard(xcoll.rank(), cols), device())
    return xcoll.gather(tree, max_size=1000, to_cpu=True)


def _room_expected(w: int, cols: int) -> dict:
    shards = [_room_shard(r, cols) for r in range(w)]
    out = {k: torch.cat([s[k] for s in shards]) for k in "abc"}
    return out | {"s": [1.5] * w, "t": list(range(w))}


def test_max_size_runs_again_only_when_a_call_needs_more_room(xla4):
    """A call with max_size is one execution, once its key's room (the bytes
    its data travels in, the same on every replica) holds it: the first call
    of a key, and a call that needs more than any before it, run again."""
    w = xla4.world_size
    xla4.run(_sizes_ok, [None] * w)  # (a pool's first call is also checked in full)
    for cols, runs in [(2, 2), (2, 1), (5, 2), (2, 1), (5, 1)]:
        before = xla4.run(counters)[0]
        results = xla4.run(_room_call, [cols] * w)
        after = xla4.run(counters)[0]
        assert after["executions"] - before["executions"] == runs * w, cols
        for got in results:
            assert_trees(got, _room_expected(w, cols), same_bits)


def _no_tensor_leaves(max_size):
    out = []
    for _ in range(12):
        out.append(xcoll.gather({"n": xcoll.rank()}, uneven=True, max_size=max_size)["n"])
    return out


@pytest.mark.parametrize("max_size", [None, 3])
def test_calls_without_tensor_leaves_in_a_row(max_size):
    # A fetch of no tensors waited for every device of the process on XLA:
    # a replica then waited for another's execution, which waited for it
    # (XLA aborted about one run of 4 such calls in 3 at W=2)
    pool = shared_pool("xla-cpu-2")
    assert pool.run(_no_tensor_leaves, [max_size] * 2) == [[[0, 1]] * 12] * 2


def _uneven_each_way(_):
    x = torch.arange(xcoll.rank() + 1.0).to(device())
    return [to_cpu(xcoll.gather(x, uneven=True, **kw)).tolist() for kw in ({}, {"max_size": 4})]


def test_an_uneven_gather_crosses_an_xla_setting_that_narrows_int64():
    """torch_xla's XLA_USE_32BIT_LONG keeps int64 as int32 on the device:
    the replicas' shapes travel as their bytes (the call raised TypeError
    naming a tree['shapes'] that the caller never passed)."""
    pytest.importorskip("torch_xla")
    from xcoll.testing import XlaPool

    with XlaPool(2, env={"XLA_USE_32BIT_LONG": "1"}) as pool:
        results = pool.run(_uneven_each_way, [None, None])
    assert results == [[[0.0, 0.0, 1.0]] * 2] * 2


def _rooms_of_two_groups(_):
    """Groups {0, 1} and {1, 2} of one size: rank 1 first gathers a large
    shard with max_size on the first, then ranks 1 and 2 a small one on the
    second. Each replica's gathered rows (None where it is not a member)."""
    import torch.distributed as dist

    rank = xcoll.rank()
    first, second = dist.new_group([0, 1]), dist.new_group([1, 2])  # (every rank makes both)
    out = [None, None]
    if rank in (0, 1):
        big = torch.full((3000, 4), float(rank))
        out[0] = xcoll.gather({"x": big[: 2999 + rank]}, max_size=3000, group=first)["x"].shape[0]
    if rank in (1, 2):
        small = torch.full((rank, 4), float(rank))
        out[1] = xcoll.gather({"x": small}, max_size=3000, group=second)["x"][:, 0].tolist()
    return out


def test_max_size_rooms_of_two_process_groups_of_one_size_are_their_own():
    # (a room shared by the two groups: rank 1 sends the first group's room
    # on the second, rank 2 its own, and the collective's sizes differ)
    got = shared_pool("gloo-4").run(_rooms_of_two_groups, [None] * 4, timeout=120)
    assert got == [[5999, None], [5999, [1.0, 2.0, 2.0]], [None, [1.0, 2.0, 2.0]], [None, None]]
