"""torchmetrics metrics and collections computed over replicas through xcoll
equal the same metrics computed in one process over the whole dataset."""

from __future__ import annotations

import contextlib
import functools
import math
import threading

import pytest
import torch
from torchmetrics import CatMetric, MeanMetric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy

import xcoll
from tests.replicas import device, shared_pool
from xcoll.integrations.torchmetrics import compute, sync_with_xcoll

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
_installed = [0, None]  # (replica threads counting now; the real xcoll.gather)


@contextlib.contextmanager
def _counting_gathers():
    """xcoll.gather wrapped to count each thread's calls while any replica
    thread of the process is inside, then restored (a wrapper left in a
    shared pool would be a frame in later tests' step places)."""
    with _install:
        if _installed[0] == 0:
            real = _installed[1] = xcoll.gather

            @functools.wraps(real)
            def counting(*args, **kwargs):
                _counts.calls = getattr(_counts, "calls", 0) + 1
                return real(*args, **kwargs)

            xcoll.gather = counting
        _installed[0] += 1
    try:
        yield
    finally:
        with _install:
            _installed[0] -= 1
            if _installed[0] == 0:
                xcoll.gather = _installed[1]


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
    with _counting_gathers():
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
        # one xcoll call per compute() (the collection, then the single metric;
        # list states' layouts ride in the gather's own shape exchange)
        assert out["calls"] == 2
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


# ---- metric.compute() itself, through sync_with_xcoll -------------------------------


def _hooked_metrics():
    """A collection of accuracy, AUROC (two list states), a mean and a 2-D
    CatMetric, and a metric of 4 tensor states."""
    from torchmetrics.classification import BinaryAUROC, MulticlassStatScores

    return MetricCollection(
        {
            "acc": MulticlassAccuracy(CLASSES, average="micro"),
            "auroc": BinaryAUROC(),
            "mean": MeanMetric(),
            "rows": CatMetric(),
        }
    ), MulticlassStatScores(CLASSES, average=None)  # (tp, fp, tn, fn: 4 states)


def _hooked_updates(c, stats, rank, dev):
    """Rank r updates r + 1 times (different numbers of update calls, so
    list states of different lengths), each batch from its own seed."""
    for step in range(rank + 1):
        g = torch.Generator().manual_seed(100 * rank + step)
        logits, classes = torch.randn(BATCH + step, CLASSES, generator=g), torch.randint(0, CLASSES, (BATCH + step,), generator=g)
        logits, classes = logits.to(dev), classes.to(dev)
        c["acc"].update(logits, classes)
        c["auroc"].update(logits[:, 0].sigmoid(), classes % 2)
        c["mean"].update(logits[:, 1])
        c["rows"].update(logits.double())
        stats.update(logits, classes)


def _through_the_hook(own: bool):
    """metric.compute() with the hook (and, with ``own``, the same metrics
    synced by torchmetrics itself): the values, and xcoll calls per compute."""
    import warnings

    warnings.simplefilter("ignore")
    dev, rank = device(), xcoll.rank()
    out = {}
    for how in ("xcoll", "own") if own else ("xcoll",):
        c, stats = _hooked_metrics()
        c, stats = c.to(dev), stats.to(dev)
        if how == "xcoll":
            c, stats = sync_with_xcoll(c), sync_with_xcoll(stats)
        _hooked_updates(c, stats, rank, dev)
        with _counting_gathers():
            _counts.calls = 0
            values = c.compute()
            calls = [_counts.calls]
            values["stats"] = stats.compute()
            values["auroc alone"] = c["auroc"].compute()  # (a member's own compute: cached)
            c["mean"].update(torch.ones(1, device=dev))  # (local states kept: accumulation goes on)
            values["mean after"] = c["mean"].compute()
            calls.append(_counts.calls - calls[0])
        out[how] = ({k: v.cpu() for k, v in values.items()}, calls)
    return out


@pytest.mark.parametrize("world", ["gloo-2", "gloo-4"])
def test_metric_compute_through_the_hook_equals_torchmetrics_own_sync(world):
    pool = shared_pool(world)
    for r, out in enumerate(pool.run(_through_the_hook, [True] * pool.world_size)):
        (mine, calls), (theirs, own_calls) = out["xcoll"], out["own"]
        # one xcoll call per compute(): the collection's, the 4-state
        # metric's, the mean's after its update (the auroc's was cached)
        assert calls == [1, 2], (r, calls)
        assert own_calls == [0, 0], (r, own_calls)  # (torchmetrics' own: no xcoll)
        assert mine.keys() == theirs.keys()
        for k in mine:
            assert mine[k].dtype == theirs[k].dtype and torch.equal(mine[k], theirs[k]), (r, k, mine[k], theirs[k])


def test_metric_compute_through_the_hook_syncs_xla_replicas():
    # torchmetrics' own sync reads torch.distributed only: on XLA replicas it
    # computes each replica's own data; through the hook, every replica's
    pool = shared_pool("xla-cpu-2")
    w = pool.world_size
    got = [out["xcoll"] for out in pool.run(_through_the_hook, [False] * w)]
    c, stats = _hooked_metrics()
    for rank in range(w):
        _hooked_updates(c, stats, rank, "cpu")
    want = c.compute()
    want["stats"] = stats.compute()
    for r, (values, calls) in enumerate(got):
        assert calls == [1, 2], (r, calls)
        assert torch.equal(values["acc"], want["acc"]) and torch.equal(values["stats"], want["stats"]), r
        assert torch.allclose(values["auroc"], want["auroc"]) and torch.allclose(values["mean"], want["mean"]), r
        assert torch.equal(values["rows"], want["rows"]), r  # (rank order: as one process's updates)


def test_the_hook_leaves_one_process_alone():
    c, stats = _hooked_metrics()
    plain_c, plain_stats = _hooked_metrics()
    sync_with_xcoll(c), sync_with_xcoll(stats)
    for m in (c, plain_c):
        _hooked_updates(m, stats if m is c else plain_stats, 2, "cpu")
    got, want = c.compute(), plain_c.compute()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(stats.compute(), plain_stats.compute())


def _rows_of_another_shape(_=None):
    m = CatMetric()
    m.update(torch.zeros(3) if xcoll.rank() == 0 else torch.zeros(2, 3))
    try:
        compute(m)
        text = "returned"
    except xcoll.CollectiveMismatchError as e:
        text = str(e)
    return text, xcoll.reduce(torch.ones(1)).item()


def test_replicas_whose_list_states_differ_in_row_shape_raise_on_every_replica():
    pool = shared_pool("gloo-2")
    for r, (text, after) in enumerate(pool.run(_rows_of_another_shape, [None] * 2)):
        assert text.startswith("metric.value: the replicas' list states differ in dtype or row shape"), (r, text)
        assert text.endswith(": rank 0 has torch.float32 rows of shape (); rank 1 has torch.float32 rows of shape (3,)"), (r, text)
        assert after == 2, (r, text)
