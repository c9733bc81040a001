"""torchmetrics metrics and collections computed over replicas through xcoll
equal the same metrics computed in one process over the whole dataset."""

from __future__ import annotations

import functools
import math
import threading

import pytest
import torch
from torchmetrics import CatMetric, MeanMetric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy

import xcoll
from tests.replicas import device, shared_pool
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
        # one xcoll call per compute() (the collection, then the single
        # metric), and one more where a metric has list states (their layouts,
        # which a rank that saw no data takes: CatMetric's)
        assert out["calls"] == 3
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


# ---- ranks that saw no data ---------------------------------------------------------


def _empty_rank_metrics():
    """Metrics whose list states are not float32 or not 1-D: an int64 target,
    2-D predictions and rows, a retrieval metric's indexes."""
    from torchmetrics.classification import BinaryAUROC, MulticlassAUROC
    from torchmetrics.retrieval import RetrievalMRR

    return {
        "binary auroc": BinaryAUROC(),
        "multiclass auroc": MulticlassAUROC(CLASSES, average="macro"),
        "rows": CatMetric(),
        "mrr": RetrievalMRR(),
    }


def _empty_rank_updates(name, m, idx, dev="cpu"):
    g = torch.Generator().manual_seed(11)
    preds, labels = torch.rand(N, generator=g)[idx], torch.randint(0, 2, (N,), generator=g)[idx]
    logits, classes = dataset()
    preds, labels, logits, classes = (t.to(dev) for t in (preds, labels, logits[idx], classes[idx]))
    if name == "binary auroc":
        m.update(preds, labels)
    elif name == "multiclass auroc":
        m.update(logits.softmax(-1), classes)
    elif name == "rows":
        m.update(logits.double())  # (2-D float64 rows)
    else:
        m.update(preds, labels.bool(), indexes=(idx // 5).to(dev))


def _with_empty_ranks(empty):
    """Each metric updated with this replica's shard, none where ``empty``
    holds its rank ("all": every rank): ``compute`` through xcoll, or the
    error's type."""
    rank, world = xcoll.rank(), xcoll.world_size()
    out = {}
    for name, m in _empty_rank_metrics().items():
        m = m.to(device())
        if empty != "all" and rank not in empty:
            # (the shards of the ranks that have data cover the whole dataset)
            have = [r for r in range(world) if r not in empty]
            idx = torch.arange(have.index(rank), N, len(have))
            _empty_rank_updates(name, m, idx, device())
        try:
            got = compute(m)
            out[name] = got.cpu() if isinstance(got, torch.Tensor) else got
        except Exception as e:
            out[name] = type(e).__name__
    return out


def _single_process(empty_everywhere: bool) -> dict:
    out = {}
    for name, m in _empty_rank_metrics().items():
        if not empty_everywhere:
            _empty_rank_updates(name, m, torch.arange(N))
        try:
            out[name] = m.compute()
        except Exception as e:
            out[name] = type(e).__name__
    return out


def _same(got, want) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(
            got.double().sort(0).values if got.dim() else got.double(),
            want.double().sort(0).values if want.dim() else want.double(),
            rtol=1e-6,
        )
    return got == want


@pytest.mark.parametrize("world", ["gloo-2", "gloo-4", "xla-cpu-2"])
def test_a_rank_that_saw_no_data_takes_the_others_layout(world):
    import warnings

    warnings.simplefilter("ignore")  # (torchmetrics warns of compute before update)
    pool = shared_pool(world)
    w = pool.world_size
    want = _single_process(False)
    for empty in ([w - 1], [0]):
        for r, got in enumerate(pool.run(_with_empty_ranks, [empty] * w)):
            for name, value in got.items():
                assert _same(value, want[name]), (empty, r, name, value, want[name])
    # every rank empty: what one process that saw no data computes
    none = _single_process(True)
    for r, got in enumerate(pool.run(_with_empty_ranks, ["all"] * w)):
        for name, value in got.items():
            assert _same(value, none[name]), ("all", r, name, value, none[name])


def test_a_list_state_xcoll_cannot_lay_out_is_refused_naming_it():
    m = CatMetric()
    m.update(torch.zeros(1, 1, 1, 1, 1, 1, 1, 1))  # (rows of 7 dims)
    with pytest.raises(ValueError, match=r"^metric\.value: a list state of torch\.float32 rows of shape \(1, 1, 1, 1, 1, 1, 1\); "):
        compute(m)
