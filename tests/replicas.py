"""Helpers that run inside a replica (or inline, for a world of one)."""

from __future__ import annotations

import os

import optree
import pytest
import torch

from xcoll import _backends
from xcoll.testing import GlooPool, ReplicaPool, XlaPool


class InlinePool(ReplicaPool):
    """A world of one, run in the calling process with no collectives engine."""

    world_size = 1
    device_type = "cpu"

    def run(self, fn, per_rank_args=None, *, timeout=None, return_exceptions=False):
        from xcoll.testing import ReplicaError, _failure

        try:
            return [fn() if per_rank_args is None else fn(per_rank_args[0])]
        except Exception as e:
            if return_exceptions:
                return [_failure(0, e)]
            raise ReplicaError({0: _failure(0, e)}) from e

    def close(self):
        pass


_pools: dict[str, ReplicaPool] = {}


def shared_pool(name: str) -> ReplicaPool:
    """The session's pool of that name ("local-1", "xla-cpu-W", "gloo-W",
    "xla-tpu"), started on first use and reused by every test."""
    if name not in _pools:
        _pools[name] = _make(name)
    return _pools[name]


def close_pools() -> None:
    for p in _pools.values():
        p.close()
    _pools.clear()


def _make(name: str) -> ReplicaPool:
    if name == "local-1":
        return InlinePool()
    if name == "xla-tpu":
        if os.environ.get("PJRT_DEVICE") != "TPU":
            pytest.skip("tpu: no TPU here (set PJRT_DEVICE=TPU on a TPU host to run)")
        return XlaPool(int(os.environ.get("XCOLL_TPU_REPLICAS", "4")), device="TPU")
    kind, w = name.rsplit("-", 1)
    return (XlaPool if kind == "xla-cpu" else GlooPool)(int(w), timeout=240)


def device() -> torch.device:
    if _backends._xla_runtime_running():
        import torch_xla

        return torch_xla.device()
    return torch.device("cpu")


def to_device(tree, dev):
    """Uploads CPU leaves; a 2-d leaf that arrives transposed (non-contiguous) is
    uploaded contiguous and transposed on the device, so the replica holds a view.

    0-d tensors are uploaded as 1-d and reshaped on the device: torch_xla shares
    one device buffer between 0-d uploads of equal value, so replicas whose 0-d
    leaves coincide differently would trace different graphs (docs/design.md).
    """

    def up(x):
        if not isinstance(x, torch.Tensor) or dev.type == "cpu":
            return x.clone() if isinstance(x, torch.Tensor) else x
        if x.dim() == 0:
            return x.reshape(1).to(dev).reshape(())
        if x.dim() == 2 and not x.is_contiguous() and x.t().is_contiguous():
            return x.t().to(dev).t()
        return x.to(dev)

    return optree.tree_map(up, tree, none_is_leaf=False)


def to_cpu(tree):
    return optree.tree_map(
        lambda x: x.to("cpu", copy=True) if isinstance(x, torch.Tensor) else x,
        tree,
        none_is_leaf=False,
    )


def devices(tree):
    return [x.device.type for x in optree.tree_leaves(tree) if isinstance(x, torch.Tensor)]
