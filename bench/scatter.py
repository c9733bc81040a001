"""A tree's reduce-scatter and all-to-all, against the per-leaf engine calls,
on gloo and on XLA:CPU, in one run.

    python -m bench.scatter [--replicas 2] [--leaves 1 8 64] [--rounds 30]

Every leaf is a float32 ``(W*8, 32)`` tensor, different on every replica; each
call returns this replica's ``(8, 32)`` part of every leaf (a reduce-scatter,
sum) or the parts every replica addressed to it (an all-to-all). The methods,
per engine:

* gloo (W processes, ``xcoll.testing.GlooPool``): ``xcoll.reduce_scatter`` and
  ``xcoll.all_to_all``, against ``dist.reduce_scatter_tensor`` and
  ``dist.all_to_all_single`` per leaf; collectives counted by the torch
  profiler (its ``gloo:`` events);
* XLA:CPU (W replica threads, ``xcoll.testing.XlaPool``): the same xcoll calls
  with ``to_cpu=True``, against ``xm.reduce_scatter`` and ``xm.all_to_all`` per
  leaf, then one sync and one batched fetch (as :mod:`bench.xla`'s per-leaf
  peers do); collectives counted by torch_xla's counters (ops traced, per
  replica).

Every method's results are checked against xcoll's (the sums within float32
rounding: the engines add in their own order). Prints one markdown table per
engine: median ms per call on rank 0, and the collectives of one call in
parentheses. XLA:CPU's replica threads share one interpreter lock, so its
small-call times measure the test bed more than the engine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

ROWS, DIM = 8, 32

Call = Callable[[], Any]


def _leaves(n: int, world: int, rank: int, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(world * ROWS, DIM, generator=g).to(device) for _ in range(n)]


# ---- gloo ----------------------------------------------------------------------


def _dist_reduce_scatter(leaves: list[torch.Tensor]) -> Call:
    import torch.distributed as dist

    def call():
        outs = [t.new_empty(ROWS, DIM) for t in leaves]
        for out, t in zip(outs, leaves, strict=True):
            dist.reduce_scatter_tensor(out, t)
        return outs

    return call


def _dist_all_to_all(leaves: list[torch.Tensor]) -> Call:
    import torch.distributed as dist

    def call():
        outs = [torch.empty_like(t) for t in leaves]
        for out, t in zip(outs, leaves, strict=True):
            dist.all_to_all_single(out, t)
        return outs

    return call


# ---- XLA:CPU -------------------------------------------------------------------


def _xm_reduce_scatter(leaves: list[torch.Tensor]) -> Call:
    import torch_xla.core.xla_model as xm

    import xcoll

    from .xla import _fetch, _sync

    world = xcoll.world_size()

    def call():
        outs = [
            xm.reduce_scatter(xm.REDUCE_SUM, t, 1.0, 0, world, pin_layout=False) for t in leaves
        ]
        _sync()
        return _fetch(outs)

    return call


def _xm_all_to_all(leaves: list[torch.Tensor]) -> Call:
    import torch_xla.core.xla_model as xm

    import xcoll

    from .xla import _fetch, _sync

    world = xcoll.world_size()

    def call():
        outs = [xm.all_to_all(t, 0, 0, world, pin_layout=False) for t in leaves]
        _sync()
        return _fetch(outs)

    return call


def _methods(xla: bool) -> dict[str, Callable[[list[torch.Tensor]], Call]]:
    import xcoll

    cpu = {"to_cpu": True} if xla else {}
    peers = (
        ("xm.reduce_scatter", _xm_reduce_scatter, "xm.all_to_all", _xm_all_to_all)
        if xla
        else (
            "dist.reduce_scatter_tensor",
            _dist_reduce_scatter,
            "dist.all_to_all_single",
            _dist_all_to_all,
        )
    )
    return {
        "xcoll.reduce_scatter": lambda leaves: lambda: xcoll.reduce_scatter(leaves, **cpu),
        f"{peers[0]} per leaf": peers[1],
        "xcoll.all_to_all": lambda leaves: lambda: xcoll.all_to_all(leaves, **cpu),
        f"{peers[2]} per leaf": peers[3],
    }


def _device() -> torch.device:
    from xcoll._backends import xla_runtime_running

    if not xla_runtime_running():
        return torch.device("cpu")
    import torch_xla

    return torch_xla.device()


def _check(name: str, got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for a, b in zip(got, want, strict=True):
        a, b = a.cpu(), b.cpu()
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5), (name, a.shape, b.shape)


def _calls(n: int) -> dict[str, Call]:
    import xcoll

    device = _device()
    leaves = _leaves(n, xcoll.world_size(), xcoll.rank(), device)
    methods = _methods(device.type != "cpu")
    return {name: prepare(leaves) for name, prepare in methods.items()}


def measure(args: tuple[list[int], int]) -> dict:
    """On every replica: per leaf count and method, the median time (ms) of a
    call (and on gloo its collectives, counted in this process); rank 0's
    report is the table's."""
    import xcoll

    counts, rounds = args
    report: dict = {}
    for n in counts:
        calls = _calls(n)
        results = {name: call() for name, call in calls.items()}  # (the first calls compile)
        for name, result in results.items():
            ours = "xcoll.all_to_all" if "all_to_all" in name else "xcoll.reduce_scatter"
            _check(name, result, results[ours])
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(rounds):
            for name, call in calls.items():
                xcoll.barrier()
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
        for name, call in calls.items():
            report[n, name] = 1e3 * statistics.median(times[name])
            if _device().type == "cpu":
                from .gloo import collectives

                report[n, name, "collectives"] = collectives(call)
    return report


def once(args: tuple[int, str]) -> None:
    """One call of a method (on XLA:CPU, between two reads of the process's
    counters, which count every replica thread's collectives)."""
    n, name = args
    _calls(n)[name]()


def xla_collectives(pool, counts: list[int], report: dict) -> None:
    """Each XLA call's collective ops traced, per replica: the counters read
    before and after one call of every replica, with no other call between."""
    from .xla import counters

    for n in counts:
        for name in _methods(xla=True):
            before = pool.run(counters)[0]["collectives"]
            pool.run(once, [(n, name)] * pool.world_size)
            after = pool.run(counters)[0]["collectives"]
            report[n, name, "collectives"] = (after - before) // pool.world_size


def table(engine: str, report: dict, counts: list[int], world: int) -> str:
    names = list(dict.fromkeys(key[1] for key in report))
    lines = [
        f"{engine}, W={world}: N float32 ({world}*{ROWS}, {DIM}) leaves "
        "(median ms per call; collectives per call)",
        "",
        "| method | " + " | ".join(f"N={n}" for n in counts) + " |",
        "|---|" + "---|" * len(counts),
    ]
    for name in names:
        cells = [f"{report[n, name]:.2f} ({report[n, name, 'collectives']})" for n in counts]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--leaves", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--rounds", type=int, default=30)
    a = p.parse_args(argv)
    from xcoll.testing import GlooPool, XlaPool

    for engine, make in (("gloo", GlooPool), ("XLA:CPU", XlaPool)):
        with make(a.replicas, timeout=600) as pool:
            report = pool.run(measure, [(a.leaves, a.rounds)] * a.replicas)[0]
            if engine == "XLA:CPU":
                xla_collectives(pool, a.leaves, report)
        print(table(engine, report, a.leaves, a.replicas), "\n", flush=True)


if __name__ == "__main__":
    main()
