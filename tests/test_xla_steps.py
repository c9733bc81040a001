"""XLA steps as users write them, on thread-per-device replicas (XLA:CPU):
small calls back to back, and syncs with nothing pending while another
replica's collective is in flight."""

from __future__ import annotations

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
