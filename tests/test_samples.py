"""Each evaluated sample exactly once, in dataset order, from gathered indices."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given
from torch.utils.data import DistributedSampler

import xcoll
from tests.helpers import PROPERTY
from tests.replicas import device


def value(index: torch.Tensor) -> torch.Tensor:
    return index.double() * 3 + 1


def _evaluate(args):
    """An eval loop over this replica's shard; returns the dataset-order values."""
    length, batch, mode, seed = args
    rank, world = xcoll.rank(), xcoll.world_size()
    if mode == "distributed-sampler":  # pads with repeated samples: equal shards
        mine = list(DistributedSampler(range(length), world, rank, shuffle=True, seed=seed))
    else:  # strided shards without padding: sizes differ by one
        mine = list(range(rank, length, world))
    # every replica must make the same number of calls: all loop over the longest shard
    steps = math.ceil(math.ceil(length / world) / batch)
    seen = []
    for step in range(steps):
        idx = torch.tensor(mine[step * batch : (step + 1) * batch], dtype=torch.int64)
        out = xcoll.gather(
            {"value": value(idx).to(device()), "index": idx.to(device())},
            max_size=batch,
            to_cpu=True,
        )
        seen.append(out)
    values = torch.cat([s["value"] for s in seen])
    index = torch.cat([s["index"] for s in seen])
    return xcoll.by_index({"value": values}, index, length=length)["value"]


@PROPERTY
@given(
    length=st.integers(1, 40),
    batch=st.integers(1, 6),
    mode=st.sampled_from(["distributed-sampler", "strided"]),
    seed=st.integers(0, 3),
)
def test_each_sample_once_in_dataset_order(pool, length, batch, mode, seed):
    results = pool.run(_evaluate, [(length, batch, mode, seed)] * pool.world_size)
    expected = value(torch.arange(length))
    assert all(torch.equal(r, expected) for r in results)


def test_by_index_refuses_bad_input():
    with pytest.raises(ValueError, match=r"missing \[1\]"):
        xcoll.by_index({"x": torch.ones(2)}, torch.tensor([0, 2]), length=3)
    with pytest.raises(ValueError, match=r"tree\['x'\]"):
        xcoll.by_index({"x": torch.ones(3)}, torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="1-d integer"):
        xcoll.by_index({"x": torch.ones(2)}, torch.tensor([0.0, 1.0]))


def test_by_index_keeps_the_first_duplicate_and_other_dims():
    tree = {"m": torch.tensor([[1, 2, 3], [4, 5, 6]]), "n": 7}
    out = xcoll.by_index(tree, torch.tensor([2, 0, 2]), dim=1)
    assert torch.equal(out["m"], torch.tensor([[2, 1], [5, 4]])) and out["n"] == 7
