"""The backward of a differentiable gather, against its peers, on gloo.

    python -m bench.grad [--replicas 2] [--leaves 1 8 64] [--rounds 50]

Runs W gloo processes (``xcoll.testing.GlooPool``). For each number of leaves
(each a float32 ``(8, 32)`` embedding) every method gathers the tree with
gradients, and the loss ``sum((o * w).sum())`` is differentiated; each method's
backward is timed in turn, round after round (the forward is not timed), and
its collectives counted by the torch profiler. The methods:

* ``xcoll.gather(grad=True)``: one reduce-scatter for the whole tree (each
  replica receives its own rows' sums; an all-reduce of the whole
  ``(W*B, ...)`` gradient, of which each replica keeps its rows, moves twice
  the bytes);
* ``torch.distributed.nn.functional.all_gather`` per leaf (its backward, on
  gloo: an all-to-all per leaf, then a sum);
* Lightning's ``_AllGather`` algorithm, reproduced (per leaf: an all-gather,
  and in the backward an all-reduce of the whole gradient, then this rank's
  slice).

Every method's input gradients are checked against xcoll's first. Prints one
markdown table (medians, in ms, on rank 0).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

ROWS, DIM = 8, 32


def _lightning(t: torch.Tensor) -> torch.Tensor:
    return _LightningAllGather.apply(t)


class _LightningAllGather(torch.autograd.Function):
    """Lightning's ``_AllGather`` (pytorch_lightning/utilities/distributed.py),
    reproduced: all-gather forward; all-reduce of the whole gradient and this
    rank's slice backward."""

    @staticmethod
    def forward(ctx, t):
        import torch.distributed as dist

        out = torch.empty((dist.get_world_size() * t.shape[0], *t.shape[1:]), dtype=t.dtype)
        dist.all_gather_into_tensor(out, t.contiguous())
        return out.view(dist.get_world_size(), *t.shape)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad[dist.get_rank()]


def _torch_nn(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed.nn.functional as dnn

    return torch.cat(dnn.all_gather(t))


def _per_leaf(gather: Callable) -> Callable:
    return lambda leaves: [gather(t).reshape(-1, DIM) for t in leaves]


def _xcoll(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    import xcoll

    return xcoll.gather(leaves, grad=True)


METHODS = {
    "xcoll.gather(grad=True)": _xcoll,
    "torch.distributed.nn.functional.all_gather per leaf": _per_leaf(_torch_nn),
    "Lightning's _AllGather per leaf (reproduced)": _per_leaf(_lightning),
}


def _inputs(n: int, rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    leaves = [torch.randn(ROWS, DIM, generator=g).requires_grad_() for _ in range(n)]
    w = torch.Generator().manual_seed(1000)
    return leaves, [torch.randn(ROWS, DIM, generator=w) for _ in range(n)]


def _backward(method: Callable, leaves, weights) -> Callable[[], None]:
    """The method's forward, made now; returns its backward."""
    for t in leaves:
        t.grad = None
    out = method(leaves)
    world = out[0].shape[0] // ROWS
    loss = sum((o * w.repeat(world, 1)).sum() for o, w in zip(out, weights, strict=True))
    return loss.backward


def measure(args: tuple[list[int], int]) -> dict:
    """On every rank: per leaf count and method, the backward's median time
    (ms) and its collectives; rank 0's report is the table's."""
    import torch.distributed as dist

    from bench.gloo import collectives

    counts, rounds = args
    rank = dist.get_rank()
    report: dict = {}
    for n in counts:
        leaves, weights = _inputs(n, rank)
        grads = {}
        for name, method in METHODS.items():
            backward = _backward(method, leaves, weights)
            report[n, name, "collectives"] = collectives(backward)
            grads[name] = [t.grad.clone() for t in leaves]
            first = grads[next(iter(METHODS))]
            for a, b in zip(grads[name], first, strict=True):
                assert torch.allclose(a, b, atol=1e-5), (name, (a - b).abs().max())
        times: dict[str, list[float]] = {name: [] for name in METHODS}
        for _ in range(rounds):
            for name, method in METHODS.items():
                backward = _backward(method, leaves, weights)
                dist.barrier()
                start = time.perf_counter()
                backward()
                times[name].append(time.perf_counter() - start)
        for name in METHODS:
            report[n, name, "ms"] = 1e3 * statistics.median(times[name])
    return report


def table(report: dict, counts: list[int], world: int) -> str:
    lines = [
        f"Backward of a gather of N float32 ({ROWS}, {DIM}) leaves, gloo, W={world} "
        "(median ms; collectives in the backward)",
        "",
        "| method | " + " | ".join(f"N={n}" for n in counts) + " |",
        "|---|" + "---|" * len(counts),
    ]
    for name in METHODS:
        cells = [f"{report[n, name, 'ms']:.2f} ({report[n, name, 'collectives']})" for n in counts]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--leaves", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--rounds", type=int, default=50)
    a = p.parse_args(argv)
    from xcoll.testing import GlooPool

    with GlooPool(a.replicas, timeout=600) as pool:
        reports = pool.run(measure, [(a.leaves, a.rounds)] * a.replicas)
    print(table(reports[0], a.leaves, a.replicas))


if __name__ == "__main__":
    main()
