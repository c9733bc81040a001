"""xcoll against the tools people use today, side by side in one run.

    python -m bench [--quick] [--replicas 4] [--leaves 1 8 64 256 1024] [--out bench]

On W XLA:CPU replicas (threads of one process), on one (gathers only) and on W
gloo processes, for trees
of ``--leaves`` leaves of mixed dtypes and shapes (:mod:`bench.trees`), it
times every method of :mod:`bench.xla` and :mod:`bench.gloo` (median seconds per
call on rank 0, after warm-up; a small call's methods in turn, call by call) and counts per call and per replica: graph
executions and compilations, collective ops traced, and device-to-host
transfers (torch_xla's metrics), or process-group collectives (the torch
profiler's ``gloo:`` events); then the peak memory of one call on a leaf of 1
GiB (:mod:`bench.memory`; a gather of 64 MiB with ``--quick``); then an
evaluation loop whose gathers are in flight against the blocking one
(:mod:`bench.overlap`, gloo W=2 and W); then ``metric.compute()``'s sync,
torchmetrics' own against xcoll's (:mod:`bench.metrics_sync`). It writes ``results.json``, ``results.md`` (the
tables, with each peer's time over xcoll's) and ``results.png`` (time per call
against leaves, log-log) to ``--out``.

``--quick`` (1 and 8 leaves, fewer repeats, a gather's memory alone) checks that everything runs, in
well under 2 minutes on a 2-core machine (about 70 s); its numbers are not the
ones to quote, so it writes to a temporary directory unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from xcoll.testing import GlooPool, PoolCrashed, XlaPool


def _time(call, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return times


def _xla_cell(args: tuple[str, str, int, int]) -> tuple[list[float], dict]:
    from bench import xla

    op, method, n, repeats = args
    return _time(xla.METHODS[op][method](xla.tree_for(n, op)), repeats), {}


def _alternating(args: tuple[str, str, int, int]) -> list[list[float]]:
    """Every method of a small call's cell (backend "xla" or "gloo", op,
    leaves, repeats), timed call by call in turn, so that each sees the same
    conditions: on 2 cores a gloo call's time drifts by 2x over seconds, more
    than the ratios these cells are judged by."""
    from bench import gloo, xla

    backend, op, n, repeats = args
    tree = xla.tree_for(n, op) if backend == "xla" else gloo.tree_for(n, False, op)
    calls = [make(tree) for make in _methods(backend)[op].values()]
    for call in calls:
        _time(call, 3)
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for call, t in zip(calls, times, strict=True):
            t.extend(_time(call, 1))
    return times


def _methods(backend: str) -> dict:
    """``bench.xla.METHODS`` or ``bench.gloo.METHODS`` ("xla" or "gloo")."""
    from bench import gloo, xla

    return (xla if backend == "xla" else gloo).METHODS


def _gloo_cell(args: tuple[str, str, int, int]) -> tuple[list[float], dict]:
    from bench import gloo

    op, method, n, repeats = args
    call = gloo.METHODS[op][method](gloo.tree_for(n, op.startswith("uneven"), op))
    return _time(call, repeats), {"collectives": gloo.collectives(call)}


@dataclass
class Runner:
    """Measures cells of trees of ``leaves`` leaves: warm-up, then as many timed
    calls as fit in ``budget`` seconds (at least 3, at most ``most``)."""

    leaves: list[int]
    budget: float
    most: int
    #: Worker crashes met (and retried), reported in results.md.
    crashes: list[str] = field(default_factory=list)

    def measure(self, pool, fn, args: tuple, counters=None):
        """``(warm-up result, repeats, timed result, counters before, after)``. A
        worker that dies (seen once in several runs: a segfault inside XLA:CPU)
        is replaced by the pool, and the cell is measured again from its
        warm-up, once."""
        w = pool.world_size
        for attempt in (1, 2):
            try:
                warm = pool.run(fn, [(*args, 2)] * w)[0]
                second = warm[0][1]
                repeats = max(3, min(self.most, int(self.budget / max(second, 1e-6))))
                c0 = counters and pool.run(counters)[0]
                result = pool.run(fn, [(*args, repeats)] * w)[0]
                c1 = counters and pool.run(counters)[0]
                return warm, repeats, result, c0, c1
            except PoolCrashed as e:
                self.crashes.append(f"{args}: {str(e).splitlines()[0]}")
                if attempt == 2:
                    raise


def _cells(runner: Runner, pool, backend: str, methods: dict, cell, log, counters=None):
    """Every (op, leaves, method) cell of ``methods`` on ``pool``. ``cell`` returns
    the times and any counts it takes itself; ``counters`` (process-wide, read
    before and after) give per-call counts per replica."""
    from bench.trees import SMALL

    out = []
    for op, by_name in methods.items():
        for n in [SMALL[op]] if op in SMALL else runner.leaves:
            # (a small call's medians: its methods timed in turn)
            in_turn = _alternate(runner, pool, backend, op, n) if op in SMALL else {}
            for method in by_name:
                (warm, _), repeats, (times, counts), c0, c1 = runner.measure(
                    pool, cell, (op, method, n), counters
                )
                if counters:
                    counts = {k: (c1[k] - c0[k]) / (pool.world_size * repeats) for k in c0}
                out.append(
                    {
                        "backend": backend,
                        "op": op,
                        "method": method,
                        "leaves": n,
                        "median_ms": 1e3 * statistics.median(in_turn.get(method, times)),
                        "first_ms": 1e3 * warm[0],
                        "repeats": repeats,
                        **counts,
                    }
                )
                log(out[-1])
    return out


def _alternate(runner: Runner, pool, backend: str, op: str, n: int) -> dict[str, list[float]]:
    """A small call's times per method, measured in turn (:func:`_alternating`):
    the cells' medians. The first call and the counts come from each method's
    own run, as for the other cells."""
    key = "xla" if backend.startswith("XLA") else "gloo"
    times = pool.run(_alternating, [(key, op, n, runner.most * 10)] * pool.world_size)[0]
    return dict(zip(_methods(key)[op], times, strict=True))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 and 8 leaves, fewer repeats, a gather's memory alone")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--leaves", type=int, nargs="+")
    p.add_argument("--out", type=Path, help="default: bench/ (--quick: a temporary directory)")
    a = p.parse_args(argv)
    leaves = a.leaves or ([1, 8] if a.quick else [1, 8, 64, 256, 1024])
    if a.out is None:
        a.out = Path(tempfile.mkdtemp(prefix="xcoll-bench-")) if a.quick else Path(__file__).parent
    runner = Runner(leaves, 0.5, 5) if a.quick else Runner(leaves, 3.0, 30)

    def log(cell: dict) -> None:
        print(
            f"{cell['backend']:>12} {cell['op']:>13} {cell['leaves']:>5} "
            f"{cell['median_ms']:10.2f} ms  {cell['method']}",
            flush=True,
        )

    started = time.time()
    from bench import gloo, xla

    w = a.replicas
    with XlaPool(w, timeout=1800) as pool:
        cells = _cells(runner, pool, f"XLA:CPU W={w}", xla.METHODS, _xla_cell, log, xla.counters)
    with XlaPool(1, timeout=1800) as pool:  # one replica: no other thread wants the GIL
        cells += _cells(runner, pool, "XLA:CPU W=1", xla.ALONE, _xla_cell, log, xla.counters)
    with GlooPool(w, timeout=1800) as pool:
        cells += _cells(runner, pool, f"gloo W={w}", gloo.METHODS, _gloo_cell, log)
    from bench import memory

    # (--quick: a gather's alone; each cell starts two fresh processes per method)
    peaks = memory.measure(64, 2, ("gather",)) if a.quick else memory.measure(1024, 2)
    from bench import overlap

    # (--quick: one small world, a few batches)
    in_flight = overlap.run([2], 4, 1) if a.quick else overlap.run(sorted({2, w}), 20, 5)
    from bench import metrics_sync

    synced = metrics_sync.run([2], 2) if a.quick else metrics_sync.run(sorted({2, w}), 30)
    import torch

    results = {
        "command": " ".join(["python -m bench", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {_cpus()} CPU cores, Python {platform.python_version()}, torch {torch.__version__}",
        "seconds": round(time.time() - started),
        "crashes": runner.crashes,
        "cells": cells,
        "memory": peaks,
        "overlap": in_flight,
        "metrics_sync": synced,
    }
    from bench import report

    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (a.out / "results.md").write_text(report.markdown(results))
    report.plot(results, a.out / "results.png")
    print(f"wrote {a.out / 'results.md'} and {a.out / 'results.png'} in {results['seconds']} s")
    return results


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
