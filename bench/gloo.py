"""The gloo side of the benchmark: xcoll and accelerate's / torchmetrics' own
functions, called verbatim, on W torch.distributed processes.

Each method is ``prepare(tree) -> call`` as in :mod:`bench.xla`.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import optree
import torch

from . import xcoll_calls as ours
from .xcoll_calls import Call


def _accelerate():
    os.environ["USE_TORCH_XLA"] = "0"  # accelerate would otherwise import torch_xla
    import accelerate.utils
    from accelerate import PartialState

    PartialState(cpu=True)  # joins the process group that is already initialised
    return accelerate.utils


def accelerate_gather(tree: dict) -> Call:
    gather = _accelerate().gather
    return lambda: gather(tree)


def accelerate_reduce(tree: dict) -> Call:
    reduce = _accelerate().reduce
    return lambda: reduce(tree, "sum")


def accelerate_broadcast(tree: dict) -> Call:
    broadcast = _accelerate().broadcast  # in place: the tree becomes rank 0's
    return lambda: broadcast(tree, 0)


def torchmetrics_uneven(tree: dict) -> Call:
    from torchmetrics.utilities.distributed import gather_all_tensors

    return lambda: optree.tree_map(lambda t: torch.cat(gather_all_tensors(t)), tree)


def ideal_gather(tree: dict) -> Call:
    import torch.distributed as dist

    from .trees import nbytes

    buf = torch.zeros(nbytes(tree), dtype=torch.uint8)
    out = torch.empty(dist.get_world_size() * buf.numel(), dtype=torch.uint8)
    return lambda: dist.all_gather_into_tensor(out, buf)


def plain_gather(tree: dict) -> Call:
    import torch.distributed as dist

    leaves = optree.tree_leaves(tree)
    w = dist.get_world_size()
    outs = [torch.empty(w * t.numel(), dtype=t.dtype) for t in leaves]

    def call():
        for out, t in zip(outs, leaves, strict=True):
            dist.all_gather_into_tensor(out, t.reshape(-1))
        return outs

    return call


def plain_reduce(tree: dict) -> Call:
    import torch.distributed as dist

    leaves = optree.tree_leaves(tree)  # reduced in place, as a plain call does

    def call():
        for t in leaves:
            dist.all_reduce(t)
        return leaves

    return call


#: op -> method name -> prepare; xcoll's method first.
METHODS: dict[str, dict[str, Callable[[dict], Call]]] = {
    "gather": {
        "xcoll.gather": ours.gather,
        "accelerate.utils.gather": accelerate_gather,
        "ideal: one all_gather_into_tensor of a pre-packed buffer": ideal_gather,
    },
    "reduce": {
        "xcoll.reduce": ours.reduce,
        "accelerate.utils.reduce": accelerate_reduce,
    },
    "broadcast": {
        "xcoll.broadcast": ours.broadcast,
        "accelerate.utils.broadcast": accelerate_broadcast,
    },
    "uneven gather": {
        "xcoll.gather(uneven=True)": ours.gather_uneven,
        "torchmetrics gather_all_tensors per leaf + torch.cat": torchmetrics_uneven,
    },
    # small calls (bench.trees.SMALL), against the plain engine call
    "small gather": {
        "xcoll.gather": ours.gather,
        "plain: dist.all_gather_into_tensor per leaf": plain_gather,
    },
    "small reduce": {
        "xcoll.reduce": ours.reduce,
        "plain: dist.all_reduce per leaf": plain_reduce,
    },
    "metrics reduce": {
        "xcoll.reduce": ours.reduce,
        "plain: dist.all_reduce per leaf": plain_reduce,
    },
}


def collectives(call: Call) -> int:
    """The process-group collectives one ``call()`` issues, counted by the torch
    profiler (its ``gloo:`` events; barriers included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    return sum(
        e.count for e in prof.key_averages() if e.key.startswith("gloo:")
    )


def tree_for(n: int, uneven: bool, op: str = "") -> dict:
    import torch.distributed as dist

    from .trees import SMALL, make, small

    return small(op, dist.get_rank()) if op in SMALL else make(n, dist.get_rank(), uneven=uneven)
