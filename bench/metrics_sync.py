"""``metric.compute()``'s sync: torchmetrics' own against xcoll's, on gloo.

    python -m bench.metrics_sync [--replicas 2 4] [--rounds 30] [--out bench]

Each replica runs W gloo processes (``xcoll.testing.GlooPool``) and holds two
metrics, updated alike on every rank except in length (rank r updates r + 1
times, so list states differ in length as they do at an epoch's end):

* ``10 states``: a ``Metric`` of 10 sum states of 4 float32 values each;
* ``collection``: a ``MetricCollection`` of ``MulticlassAccuracy`` (4 tensor
  states), ``BinaryAUROC`` (2 list states) and ``MeanMetric`` (2 states).

Each is computed, in turn, by:

* ``torchmetrics' own sync``: the metric as torchmetrics makes it (one
  ``all_gather`` per state, after one of its size);
* ``sync_with_xcoll``: ``xcoll.integrations.torchmetrics.sync_with_xcoll``'s
  ``metric.compute()`` (one uneven xcoll gather for all states);
* ``per-tensor dist_sync_fn``: ``dist_sync_fn=`` an xcoll gather of each
  state (what torchmetrics' API offers; one xcoll call per state), on the
  10-state metric only: a state gathered alone cannot say how many rows each
  rank sent, so list states of different lengths have no per-tensor way.

Every way's values are checked against torchmetrics' own, bit for bit.
Prints one markdown table: the median ms of one ``compute()`` (its cache
cleared) on rank 0, and the collectives it issues (the torch profiler's
``gloo:`` events); with ``--out DIR``, also puts it into ``DIR/results.json``
and ``DIR/results.md`` (``python -m bench`` runs it too).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

WAYS = ("torchmetrics' own sync", "sync_with_xcoll", "per-tensor dist_sync_fn")
METRICS = ("10 states", "collection")


def _gather_each(t: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """A per-tensor ``dist_sync_fn`` from xcoll (torchmetrics' signature)."""
    import xcoll

    return list(xcoll.gather(t, stack=True, group=group).unbind(0))


def _ten_states(**kwargs: Any):
    from torchmetrics import Metric

    class TenStates(Metric):
        def __init__(self) -> None:
            super().__init__(**kwargs)
            for i in range(10):
                self.add_state(f"s{i}", torch.zeros(4), dist_reduce_fx="sum")

        def update(self, x: torch.Tensor) -> None:
            for i in range(10):
                setattr(self, f"s{i}", getattr(self, f"s{i}") + x * i)

        def compute(self) -> torch.Tensor:
            return torch.stack([getattr(self, f"s{i}") for i in range(10)])

    return TenStates()


def _collection(**kwargs: Any):
    from torchmetrics import MeanMetric, MetricCollection
    from torchmetrics.classification import BinaryAUROC, MulticlassAccuracy

    return MetricCollection(
        {
            "acc": MulticlassAccuracy(5, average="micro", **kwargs),
            "auroc": BinaryAUROC(**kwargs),
            "mean": MeanMetric(**kwargs),
        }
    )


def _made(metric: str, way: str):
    from xcoll.integrations.torchmetrics import sync_with_xcoll

    make = _ten_states if metric == "10 states" else _collection
    if way == "sync_with_xcoll":
        return sync_with_xcoll(make())
    return make(dist_sync_fn=_gather_each) if way == "per-tensor dist_sync_fn" else make()


def _updated(m, metric: str, rank: int):
    for k in range(rank + 1):
        g = torch.Generator().manual_seed(100 * rank + k)
        if metric == "10 states":
            m.update(torch.randn(4, generator=g))
        else:
            logits, y = torch.randn(64, 5, generator=g), torch.randint(0, 5, (64,), generator=g)
            m["acc"].update(logits, y)
            m["auroc"].update(logits[:, 0].sigmoid(), y % 2)
            m["mean"].update(logits[:, 1])
    return m


def _uncached(m) -> None:
    for member in getattr(m, "values", lambda: [m])():
        member._computed = None


def measure(rounds: int) -> dict[str, Any]:
    import warnings

    from torch.profiler import ProfilerActivity, profile

    import xcoll

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)  # (W processes share the machine's cores)
    out: dict[str, Any] = {}
    for metric in METRICS:
        want = None
        for way in WAYS:
            if metric != "10 states" and way == "per-tensor dist_sync_fn":
                continue
            m = _updated(_made(metric, way), metric, xcoll.rank())
            got = m.compute()
            if want is None:
                want = got
            else:
                same = {k: torch.equal(got[k], want[k]) for k in want} if isinstance(want, dict) else torch.equal(got, want)
                assert same if isinstance(same, bool) else all(same.values()), (metric, way)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                _uncached(m)
                m.compute()
            collectives = sum(e.count for e in prof.key_averages() if e.key.startswith("gloo:"))
            times = []
            for _ in range(rounds):
                _uncached(m)
                xcoll.barrier()
                start = time.perf_counter()
                m.compute()
                times.append(time.perf_counter() - start)
            out[f"{metric}: {way}"] = {"ms": 1e3 * statistics.median(times), "collectives": collectives}
    return out


def table(report: dict[str, Any]) -> str:
    """The markdown table of :func:`run`'s result: per metric and way, the
    median ms of one compute() on rank 0 and its collectives."""
    worlds = sorted(report["worlds"], key=int)
    lines = [
        "| metric: way | " + " | ".join(f"W={w}: ms | W={w}: collectives" for w in worlds) + " |",
        "|---|" + "---:|---:|" * len(worlds),
    ]
    for metric in METRICS:
        for way in WAYS:
            cells = []
            for w in worlds:
                cell = report["worlds"][w].get(f"{metric}: {way}")
                cells.append(f"{cell['ms']:.2f} | {cell['collectives']}" if cell else "- | -")
            lines.append(f"| {metric}: {way} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(worlds: list[int], rounds: int) -> dict[str, Any]:
    """Each way timed on gloo pools of ``worlds`` processes; the result, as
    ``results.json`` keeps it under ``"metrics_sync"``."""
    from xcoll.testing import GlooPool

    reports = {}
    for w in worlds:
        with GlooPool(w, timeout=600) as pool:
            reports[str(w)] = pool.run(measure, [rounds] * w)[0]
    command = f"python -m bench.metrics_sync --replicas {' '.join(map(str, worlds))} --rounds {rounds}"
    return {"command": command, "date": time.strftime("%Y-%m-%d"), "worlds": reports}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--out", type=Path, help="also put the table into DIR/results.json and DIR/results.md (default: print it only)")
    a = p.parse_args(argv)
    report = run(a.replicas, a.rounds)
    print(table(report))
    if a.out is not None:
        from bench import report as results

        results.put(a.out, "metrics_sync", report)


if __name__ == "__main__":
    main()
