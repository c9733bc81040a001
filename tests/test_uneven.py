"""Uneven gathers: leaves whose size along dim differs between replicas."""

from __future__ import annotations

import random

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

import xcoll
from tests.helpers import PROPERTY, assert_trees, same_bits
from tests.replicas import counters, device, to_cpu, to_device

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
    cols = 3 + xcoll.rank() % 2  # odd ranks have 4 columns
    return xcoll.gather({"m": torch.zeros(2, cols).to(device())}, uneven=True)


def test_other_dims_must_match_and_every_replica_says_so(pool):
    if pool.world_size == 1:
        pytest.skip("one replica cannot disagree with itself")
    failures = pool.run(_mismatch, [None] * pool.world_size, return_exceptions=True)
    # the guard, in the shape exchange, finds that the descriptions differ
    assert all(f.type_name == "xcoll._check.CollectiveMismatchError" for f in failures), failures
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
            "replica; rank 0 has shape (2, 3), rank 1 has (2, 4)" in f.message
        ), f
    everyone = [v for r in range(pool.world_size) for v in range(r)]
    assert pool.run(_sizes_ok, [None] * pool.world_size) == [everyone] * pool.world_size


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
    with pytest.raises(ValueError, match="stack"):
        xcoll.gather(torch.ones(2), uneven=True, stack=True)
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
