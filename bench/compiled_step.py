"""A compiled training step: xcoll against per-leaf functional collectives,
eager and under ``torch.compile``, on gloo.

    python -m bench.compiled_step [--replicas 2 4] [--rounds 20] [--out bench]

The step (each of W gloo processes, ``xcoll.testing.GlooPool``): embeddings
``x @ w`` of a batch of 64, every replica's through a differentiable gather,
a contrastive loss against them, a metrics dict of 3 entries (loss, correct,
seen) summed over the replicas, then ``backward()``. Its collectives, by:

* ``xcoll``: ``xcoll.gather(grad=True)`` and one ``xcoll.reduce`` of the
  dict;
* ``per-leaf functional``: PyTorch's functional collectives, one per tensor
  (``all_gather_tensor_autograd``, ``all_reduce`` per metric), as projects
  write compiled steps today;

each run eagerly and compiled (``torch.compile(fullgraph=True)``, inductor).
Prints one markdown table: the median ms of one step (rank 0), its graph
breaks (``torch._dynamo.explain``), and the collectives it issues (the
profiler's ``gloo:`` events); with ``--out DIR``, also puts it into
``DIR/results.json`` and ``DIR/results.md``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

WAYS = ("xcoll", "per-leaf functional")
MODES = ("eager", "compiled")


def _xcoll_step(w: torch.Tensor, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, Any]:
    import xcoll

    emb = x @ w
    every = xcoll.gather(emb, grad=True)
    logits = emb @ every.T
    loss = torch.nn.functional.cross_entropy(logits, labels)
    correct = (logits.argmax(1) == labels).sum().float()
    metrics = xcoll.reduce({"loss": loss.detach(), "correct": correct, "seen": torch.tensor(64.0)})
    return loss, metrics


def _functional_step(w: torch.Tensor, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, Any]:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    group = dist.group.WORLD
    emb = x @ w
    every = fc.all_gather_tensor_autograd(emb, 0, group)
    logits = emb @ every.T
    loss = torch.nn.functional.cross_entropy(logits, labels)
    correct = (logits.argmax(1) == labels).sum().float()
    local = {"loss": loss.detach(), "correct": correct, "seen": torch.tensor(64.0)}
    metrics = {k: fc.wait_tensor(fc.all_reduce(v, "sum", group)) for k, v in local.items()}
    return loss, metrics


STEPS = {"xcoll": _xcoll_step, "per-leaf functional": _functional_step}


def measure(rounds: int) -> dict[str, Any]:
    import warnings

    import torch._dynamo as dynamo
    from torch.profiler import ProfilerActivity, profile

    import xcoll

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)  # (W processes share the machine's cores)
    rank = xcoll.rank()
    g = torch.Generator().manual_seed(rank)
    x, w0 = torch.randn(64, 16, generator=g), torch.randn(16, 8, generator=torch.Generator().manual_seed(7))
    labels = torch.arange(64) + 64 * rank
    out: dict[str, Any] = {}
    want = None
    for way, step in STEPS.items():
        dynamo.reset()
        breaks = dynamo.explain(step)(w0.clone().requires_grad_(), x, labels).graph_break_count
        for mode in MODES:
            f = step if mode == "eager" else torch.compile(step, backend="inductor", fullgraph=True)
            got = _once(f, w0, x, labels)  # (compiles)
            want = got if want is None else want
            assert torch.allclose(got, want, rtol=1e-5), (way, mode, got, want)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                _once(f, w0, x, labels)
            collectives = sum(e.count for e in prof.key_averages() if e.key.startswith("gloo:"))
            times = []
            for _ in range(rounds):
                xcoll.barrier()
                start = time.perf_counter()
                _once(f, w0, x, labels)
                times.append(time.perf_counter() - start)
            out[f"{way}: {mode}"] = {
                "ms": 1e3 * statistics.median(times),
                "breaks": breaks if mode == "compiled" else None,
                "collectives": collectives,
            }
    return out


def _once(step: Any, w0: torch.Tensor, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One step, forward and backward; its summed loss."""
    w = w0.clone().requires_grad_()
    loss, metrics = step(w, x, labels)
    loss.backward()
    out: torch.Tensor = metrics["loss"]
    return out


def table(report: dict[str, Any]) -> str:
    """The markdown table of :func:`run`'s result."""
    worlds = sorted(report["worlds"], key=int)
    lines = [
        "| way: mode | graph breaks | " + " | ".join(f"W={w}: ms | W={w}: collectives" for w in worlds) + " |",
        "|---|---:|" + "---:|---:|" * len(worlds),
    ]
    for way in WAYS:
        for mode in MODES:
            cells = [report["worlds"][w][f"{way}: {mode}"] for w in worlds]
            breaks = cells[0]["breaks"]
            lines.append(
                f"| {way}: {mode} | {'-' if breaks is None else breaks} | "
                + " | ".join(f"{c['ms']:.2f} | {c['collectives']}" for c in cells)
                + " |"
            )
    return "\n".join(lines)


def run(worlds: list[int], rounds: int) -> dict[str, Any]:
    """Each way timed on gloo pools of ``worlds`` processes; the result, as
    ``results.json`` keeps it under ``"compiled_step"``."""
    from xcoll.testing import GlooPool

    reports = {}
    for w in worlds:
        with GlooPool(w, timeout=900) as pool:
            reports[str(w)] = pool.run(measure, [rounds] * w, timeout=900)[0]
    command = f"python -m bench.compiled_step --replicas {' '.join(map(str, worlds))} --rounds {rounds}"
    return {"command": command, "date": time.strftime("%Y-%m-%d"), "worlds": reports}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--out", type=Path, help="also put the table into DIR/results.json and DIR/results.md (default: print it only)")
    a = p.parse_args(argv)
    report = run(a.replicas, a.rounds)
    print(table(report))
    if a.out is not None:
        from bench import report as results

        results.put(a.out, "compiled_step", report)


if __name__ == "__main__":
    main()
