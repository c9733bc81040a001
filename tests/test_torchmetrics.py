"""torchmetrics metrics and collections computed over replicas through xcoll
equal the same metrics computed in one process over the whole dataset."""

from __future__ import annotations

import functools
import math
import threading

import torch
from torchmetrics import CatMetric, MeanMetric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy

import xcoll
from tests.replicas import device
from xcoll.integrations.torchmetrics import compute

N, CLASSES, BATCH = 45, 5, 4  # 45 samples: not a multiple of W or of the batch


def dataset():
    g = torch.Generator().manual_seed(7)
    return torch.randn(N, CLASSES, generator=g), torch.randint(0, CLASSES, (N,), generator=g)


def metrics() -> MetricCollection:
    return MetricCollection(
        {
            "acc": MulticlassAccuracy(CLASSES, average="micro"),
            "loss": MeanMetric(),
            "seen": CatMetric(),
        }
    )


def update(m: MetricCollection, logits, labels, index):
    m["acc"].update(logits, labels)
    m["loss"].update(torch.nn.functional.cross_entropy(logits, labels, reduction="none"))
    m["seen"].update(index.double())


_counts = threading.local()  # replica threads share the module: count per thread
_install = threading.Lock()


def _count_gathers():
    """Wraps xcoll.gather, once per process, to count the calls of each thread."""
    with _install:
        if not getattr(xcoll.gather, "counting", False):
            real = xcoll.gather

            @functools.wraps(real)
            def counting(*args, **kwargs):
                _counts.calls = getattr(_counts, "calls", 0) + 1
                return real(*args, **kwargs)

            counting.counting = True
            xcoll.gather = counting


def _replica(_):
    dev = device()
    rank, world = xcoll.rank(), xcoll.world_size()
    logits, labels = dataset()
    mine = torch.arange(rank, N, world)  # uneven shards, one may end a batch early
    m = metrics().to(dev)
    for step in range(math.ceil(math.ceil(N / world) / BATCH)):
        idx = mine[step * BATCH : (step + 1) * BATCH]
        if len(idx):
            update(m, logits[idx].to(dev), labels[idx].to(dev), idx.to(dev))
    _count_gathers()
    _counts.calls = 0
    values = compute(m)
    alone = compute(m["loss"])  # a single Metric works too
    local_after = torch.cat(m["seen"].value)  # CatMetric's list state, back to the local one
    return {
        "values": {k: v.cpu() for k, v in values.items()},
        "loss alone": alone.cpu(),
        "calls": _counts.calls,
        "local seen after": local_after.cpu(),
        "mine": mine.double(),
    }


def test_metrics_over_replicas_equal_one_process(pool):
    logits, labels = dataset()
    ref = metrics()
    update(ref, logits, labels, torch.arange(N))
    expected = ref.compute()
    for r, out in enumerate(pool.run(_replica, [None] * pool.world_size)):
        got = out["values"]
        assert (
            out["calls"] == 2
        )  # one xcoll call per compute(): the collection, then the single metric
        assert torch.equal(got["acc"], expected["acc"])
        assert torch.allclose(got["loss"], expected["loss"], rtol=1e-6)
        assert torch.allclose(out["loss alone"], expected["loss"], rtol=1e-6)
        assert torch.equal(got["seen"].sort().values, torch.arange(N, dtype=torch.float64))
        # the local states are back, to keep accumulating
        assert torch.equal(out["local seen after"], out["mine"]), r


def test_needs_nothing_but_torchmetrics_in_one_process():
    m = MeanMetric()
    m.update(torch.tensor([1.0, 2.0, 6.0]))
    assert compute(m) == 3.0
    m.update(torch.tensor([7.0]))  # states were restored: accumulation goes on
    assert compute(m) == 4.0  # (a reset would give 7.0)


def test_plain_compute_is_unchanged_afterwards():
    m = MeanMetric()
    m.update(torch.tensor([2.0]))
    assert compute(m) == 2.0
    m.update(torch.tensor([4.0]))
    assert m.compute() == 3.0 and m._to_sync and not m._is_synced
