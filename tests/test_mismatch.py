"""Replicas that make different calls: a clear error on every replica, naming
the first difference, and the pool works again afterwards."""

from __future__ import annotations

import pytest
import torch

import xcoll
from tests.replicas import device
from tests.test_dist import _shared

MISMATCH = "xcoll._check.CollectiveMismatchError"


def case(name: str, rank: int, last: bool, dev):
    t = torch.ones(2, 3).to(dev)
    if name == "dict keys":
        return "gather", {"a": t, ("c" if last else "b"): t}, {}
    if name == "extra list element":
        return "gather", [t] * (2 if last else 1), {}
    if name == "tuple vs list":
        return "gather", (t, t) if last else [t, t], {}
    if name == "shape":
        return "gather", {"x": torch.ones(2, 4 if last else 3).to(dev)}, {}
    if name == "ndim":
        return "gather", {"x": torch.ones(6).to(dev) if last else t}, {}
    if name == "dtype":
        return "reduce", {"x": t.int() if last else t}, {}
    if name == "src":
        return "broadcast", {"x": t}, {"src": 1 if last else 0}
    if name == "op":
        return "reduce", {"x": t}, {"op": "max" if last else "sum"}
    if name == "empty on one replica":
        return "gather", {"x": torch.ones(0 if last else 2, 3).to(dev)}, {}
    if name == "non-tensor leaf":
        return "gather", {"x": t, "y": "oops" if last else t}, {}
    if name == "mixed devices":
        return "gather", {"x": t, "y": torch.ones(1, device="meta") if last else t}, {}
    raise AssertionError(name)


# case -> (what the differing replica raises, what the others raise, text in every message)
EXPECTED = {
    "dict keys": (MISMATCH, MISMATCH, "tree["),
    "extra list element": (MISMATCH, MISMATCH, "tree[1]"),
    "tuple vs list": (MISMATCH, MISMATCH, "PyTreeSpec"),
    "shape": (MISMATCH, MISMATCH, "tree['x']"),
    "ndim": (MISMATCH, MISMATCH, "tree['x']"),
    "dtype": (MISMATCH, MISMATCH, "tree['x']"),
    "src": (MISMATCH, MISMATCH, "src="),
    "op": (MISMATCH, MISMATCH, "op="),
    "empty on one replica": (MISMATCH, MISMATCH, "shape (0, 3)"),
    "non-tensor leaf": ("builtins.TypeError", MISMATCH, "tree['y']"),
    "mixed devices": ("builtins.TypeError", MISMATCH, "tree['y']"),
}


def _call(name):
    rank, world = xcoll.rank(), xcoll.world_size()
    fn, tree, kwargs = case(name, rank, rank == world - 1, device())
    with xcoll.consistency_checks("always"):
        getattr(xcoll, fn)(tree, **kwargs)
    return "no error"


def _ok(_):
    with xcoll.consistency_checks("always"):
        return xcoll.gather(xcoll.rank())


WORLDS = ["xla-cpu-2", "xla-cpu-4", "gloo-2", "gloo-4"]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", list(EXPECTED))
def test_every_replica_raises_and_the_pool_goes_on(world, name):
    pool = _shared(world)
    w = pool.world_size
    failures = pool.run(_call, [name] * w, return_exceptions=True)
    odd, others, text = EXPECTED[name]
    assert [f.type_name for f in failures] == [others] * (w - 1) + [odd], failures
    for r, f in enumerate(failures):
        assert text in f.message, (r, f.message)
        if f.type_name == MISMATCH:  # names this replica and the first disagreeing one
            assert f"rank {r}" in f.message and ("rank" in f.message.replace(f"rank {r}", "", 1))
    assert pool.run(_ok, [None] * w) == [list(range(w))] * w


def _uneven_empty(_):
    rank, world = xcoll.rank(), xcoll.world_size()
    x = torch.ones(0 if rank == world - 1 else 2, 3).to(device())
    with xcoll.consistency_checks("always"):
        return xcoll.gather({"x": x}, uneven=True, to_cpu=True)["x"].shape[0]


@pytest.mark.parametrize("world", WORLDS)
def test_an_empty_shard_is_valid_for_uneven_gathers(world):
    pool = _shared(world)
    assert pool.run(_uneven_empty, [None] * pool.world_size) == [2 * (pool.world_size - 1)] * pool.world_size


def test_modes():
    with pytest.raises(ValueError, match="mode must be one of"):
        with xcoll.consistency_checks("sometimes"):
            pass
