"""An evaluation loop whose per-batch gather overlaps the next batch's
compute (``sync=False``), against the same loop blocking, on gloo.

    python -m bench.overlap [--replicas 2 4] [--batches 20] [--rounds 3]

Each replica runs W gloo processes (``xcoll.testing.GlooPool``). Per batch,
the "forward pass" is a fixed amount of compute (float32 ``n x n`` matmuls,
``n`` chosen on rank 0 so that one takes about as long as the batch's
gather: compute and communication about equal), and the batch's results, a
tree of three leaves (predictions, logits, indices: ``ROWS`` rows, about
0.5 MiB), are gathered. The loops:

* ``xcoll.gather`` blocking: compute batch k, gather it;
* ``xcoll.gather(sync=False)``: compute batch k, ``xcoll.sync()`` (completes
  batch k-1's gather, in flight during this compute), gather batch k;
* ``dist.all_gather_into_tensor`` per leaf, blocking (what per-leaf code
  does, accelerate's ``gather`` among it).

Every loop's gathered results are checked against the blocking xcoll loop's.
Prints one markdown table: the median time of a whole loop (ms, rank 0) and
its ratio to the blocking xcoll loop. The processes share this machine's
cores, so compute and gloo's own threads compete for them: the overlap is
what is left after that.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

ROWS, CLASSES = 1024, 100


def _batch(k: int, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + k)
    logits = torch.randn(ROWS, CLASSES, generator=g)
    return {"pred": logits.argmax(-1), "logits": logits, "index": torch.arange(ROWS) + ROWS * k}


def _compute(a: torch.Tensor) -> torch.Tensor:
    return a @ a


def _blocking(batches, a) -> list:
    import xcoll

    out = []
    for b in batches:
        _compute(a)
        out.append(xcoll.gather(b))
    return out


def _overlapped(batches, a) -> list:
    import xcoll

    out = []
    for b in batches:
        _compute(a)
        xcoll.sync()  # (completes the previous batch's gather)
        out.append(xcoll.gather(b, sync=False))
    xcoll.sync()
    return out


def _per_leaf(batches, a) -> list:
    import torch.distributed as dist

    w = dist.get_world_size()
    out = []
    for b in batches:
        _compute(a)
        got = {}
        for key, t in b.items():
            o = t.new_empty(w * t.shape[0], *t.shape[1:])
            dist.all_gather_into_tensor(o, t)
            got[key] = o
        out.append(got)
    return out


LOOPS: dict[str, Callable[[list, torch.Tensor], list]] = {
    "xcoll.gather, blocking": _blocking,
    "xcoll.gather(sync=False), completed after the next batch's compute": _overlapped,
    "dist.all_gather_into_tensor per leaf, blocking": _per_leaf,
}


def _size(batches) -> int:
    """The matmul size whose time is closest to one blocking gather's
    (measured on rank 0, shared with every rank)."""
    import xcoll

    xcoll.gather(batches[0])
    start = time.perf_counter()
    for b in batches[:5]:
        xcoll.gather(b)
    gather = (time.perf_counter() - start) / 5
    best, gap = 64, float("inf")
    for n in (64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 576, 640, 768):
        a = torch.randn(n, n)
        _compute(a)
        start = time.perf_counter()
        for _ in range(3):
            _compute(a)
        took = (time.perf_counter() - start) / 3
        if abs(took - gather) < gap:
            best, gap = n, abs(took - gather)
    return int(xcoll.broadcast(torch.tensor(best), src=0))


def measure(args: tuple[int, int]) -> dict[str, Any]:
    import xcoll

    n_batches, rounds = args
    torch.set_num_threads(1)  # (W processes share the machine's cores)
    batches = [_batch(k, xcoll.rank()) for k in range(n_batches)]
    n = _size(batches)
    a = torch.randn(n, n)
    want = _blocking(batches, a)
    times: dict[str, list[float]] = {name: [] for name in LOOPS}
    for _ in range(rounds):
        for name, loop in LOOPS.items():
            xcoll.barrier()
            start = time.perf_counter()
            got = loop(batches, a)
            times[name].append(time.perf_counter() - start)
            for g, w in zip(got, want, strict=True):
                assert all(torch.equal(g[k], w[k]) for k in w), name
    return {"n": n, **{name: 1e3 * statistics.median(t) for name, t in times.items()}}


def table(reports: dict[int, dict[str, Any]], batches: int) -> str:
    worlds = sorted(reports)
    lines = [
        f"An evaluation loop of {batches} batches on gloo: per batch a matmul, then a gather of "
        f"{ROWS} rows (pred, logits of {CLASSES}, index); median ms per loop (x the blocking "
        "xcoll loop)",
        "",
        "| loop | " + " | ".join(f"W={w} (matmul n={reports[w]['n']})" for w in worlds) + " |",
        "|---|" + "---:|" * len(worlds),
    ]
    for name in LOOPS:
        cells = []
        for w in worlds:
            ms, base = reports[w][name], reports[w]["xcoll.gather, blocking"]
            cells.append(f"{ms:.1f} ({ms / base:.2f}x)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    from xcoll.testing import GlooPool

    reports = {}
    for w in a.replicas:
        with GlooPool(w, timeout=600) as pool:
            reports[w] = pool.run(measure, [(a.batches, a.rounds)] * w)[0]
    print(table(reports, a.batches))


if __name__ == "__main__":
    main()
