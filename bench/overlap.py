"""An evaluation loop whose per-batch gather overlaps the next batch's
compute (``sync=False``), against the same loop blocking, on gloo.

    python -m bench.overlap [--replicas 2 4] [--batches 20] [--rounds 3] [--out bench]

Each replica runs W gloo processes (``xcoll.testing.GlooPool``). Per batch,
the "forward pass" is a fixed amount of compute, and the batch's results, a
tree of three leaves (predictions, logits, indices: ``ROWS`` rows, about
0.5 MiB), are gathered. The compute is, in turn:

* a float32 ``n x n`` matmul, ``n`` chosen on rank 0 so that one takes about
  as long as the batch's blocking gather (compute and communication about
  equal); it runs on the cores that gloo's threads also need;
* a sleep as long as that matmul: compute that holds no core, as a kernel
  running on an accelerator leaves the host's cores to the communication.

The loops, for each compute:

* ``xcoll.gather`` blocking: compute batch k, gather it;
* ``xcoll.gather(sync=False)``: compute batch k, ``xcoll.sync()`` (completes
  batch k-1's gather, in flight during this compute), gather batch k;
* ``dist.all_gather_into_tensor`` per leaf, blocking (what per-leaf code
  does, accelerate's ``gather`` among it).

Every loop's gathered results are checked against the blocking xcoll loop's.
Prints one markdown table: the median time of a whole loop (ms, rank 0) and
its ratio to the same compute's blocking xcoll loop; with ``--out DIR``, also
puts it into ``DIR/results.json`` and ``DIR/results.md`` (``python -m
bench`` runs it too).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROWS, CLASSES = 1024, 100


def _batch(k: int, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + k)
    logits = torch.randn(ROWS, CLASSES, generator=g)
    return {"pred": logits.argmax(-1), "logits": logits, "index": torch.arange(ROWS) + ROWS * k}


def _compute(a: torch.Tensor) -> torch.Tensor:
    return a @ a


def _blocking(batches, compute) -> list:
    import xcoll

    out = []
    for b in batches:
        compute()
        out.append(xcoll.gather(b))
    return out


def _overlapped(batches, compute) -> list:
    import xcoll

    out = []
    for b in batches:
        compute()
        xcoll.sync()  # (completes the previous batch's gather)
        out.append(xcoll.gather(b, sync=False))
    xcoll.sync()
    return out


def _per_leaf(batches, compute) -> list:
    import torch.distributed as dist

    w = dist.get_world_size()
    out = []
    for b in batches:
        compute()
        got = {}
        for key, t in b.items():
            o = t.new_empty(w * t.shape[0], *t.shape[1:])
            dist.all_gather_into_tensor(o, t)
            got[key] = o
        out.append(got)
    return out


BLOCKING = "xcoll.gather, blocking"
LOOPS: dict[str, Callable[[list, Callable[[], Any]], list]] = {
    BLOCKING: _blocking,
    "xcoll.gather(sync=False), completed after the next batch's compute": _overlapped,
    "dist.all_gather_into_tensor per leaf, blocking": _per_leaf,
}


#: Each batch's compute: the matmul, on the cores gloo also uses, and a sleep of
#: the matmul's time, which holds no core (as a kernel running on an
#: accelerator leaves the host's cores to the communication).
COMPUTES = {"matmul": "a matmul", "sleep": "a sleep as long"}


def _size(batches) -> tuple[int, float]:
    """The matmul size whose time is closest to one blocking gather's, and
    that time in seconds (measured on rank 0, shared with every rank)."""
    import xcoll

    xcoll.gather(batches[0])
    start = time.perf_counter()
    for b in batches[:5]:
        xcoll.gather(b)
    gather = (time.perf_counter() - start) / 5
    best, gap, best_took = 64, float("inf"), 0.0
    for n in (64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 576, 640, 768):
        a = torch.randn(n, n)
        _compute(a)
        start = time.perf_counter()
        for _ in range(3):
            _compute(a)
        took = (time.perf_counter() - start) / 3
        if abs(took - gather) < gap:
            best, gap, best_took = n, abs(took - gather), took
    n, took = xcoll.broadcast((torch.tensor(best), torch.tensor(best_took, dtype=torch.float64)), src=0)
    return int(n), float(took)


def measure(args: tuple[int, int]) -> dict[str, Any]:
    import xcoll

    n_batches, rounds = args
    torch.set_num_threads(1)  # (W processes share the machine's cores)
    batches = [_batch(k, xcoll.rank()) for k in range(n_batches)]
    n, took = _size(batches)
    a = torch.randn(n, n)
    computes = {"matmul": functools.partial(_compute, a), "sleep": functools.partial(time.sleep, took)}
    want = _blocking(batches, computes["matmul"])
    times: dict[str, list[float]] = {f"{c}: {name}": [] for c in computes for name in LOOPS}
    for _ in range(rounds):
        for c, compute in computes.items():
            for name, loop in LOOPS.items():
                xcoll.barrier()
                start = time.perf_counter()
                got = loop(batches, compute)
                times[f"{c}: {name}"].append(time.perf_counter() - start)
                for g, w in zip(got, want, strict=True):
                    assert all(torch.equal(g[k], w[k]) for k in w), name
    return {"n": n, "compute_ms": 1e3 * took, **{name: 1e3 * statistics.median(t) for name, t in times.items()}}


def table(overlap: dict[str, Any]) -> str:
    """The markdown table of :func:`run`'s result: per compute and loop, the
    median ms of a whole loop and its ratio to that compute's blocking xcoll loop."""
    reports = {int(w): r for w, r in overlap["worlds"].items()}
    worlds = sorted(reports)
    lines = [
        f"| loop ({overlap['batches']} batches) | "
        + " | ".join(f"W={w} (n={reports[w]['n']}, {reports[w]['compute_ms']:.1f} ms)" for w in worlds)
        + " |",
        "|---|" + "---:|" * len(worlds),
    ]
    for compute in COMPUTES:
        for name in LOOPS:
            cells = []
            for w in worlds:
                ms, base = reports[w][f"{compute}: {name}"], reports[w][f"{compute}: {BLOCKING}"]
                cells.append(f"{ms:.1f} ({ms / base:.2f}x)")
            lines.append(f"| {COMPUTES[compute]}: {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(worlds: list[int], batches: int, rounds: int) -> dict[str, Any]:
    """Each loop timed on gloo pools of ``worlds`` processes; the result, as
    ``results.json`` keeps it under ``"overlap"``."""
    from xcoll.testing import GlooPool

    reports = {}
    for w in worlds:
        with GlooPool(w, timeout=600) as pool:
            reports[str(w)] = pool.run(measure, [(batches, rounds)] * w)[0]
    command = f"python -m bench.overlap --replicas {' '.join(map(str, worlds))} --batches {batches} --rounds {rounds}"
    return {"command": command, "date": time.strftime("%Y-%m-%d"), "batches": batches, "worlds": reports}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, help="also put the table into DIR/results.json and DIR/results.md (default: print it only)")
    a = p.parse_args(argv)
    overlap = run(a.replicas, a.batches, a.rounds)
    print(table(overlap))
    if a.out is not None:
        from bench import report

        report.put(a.out, "overlap", overlap)


if __name__ == "__main__":
    main()
