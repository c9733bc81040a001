"""torchmetrics through xcoll: every state of every metric in one call.

torchmetrics syncs through torch.distributed, one state tensor at a time, and is
not XLA-aware. :func:`compute` gathers all states of a ``Metric`` or a
``MetricCollection`` with a single uneven :func:`xcoll.gather` (so list states of
different lengths and empty ones are fine), applies each state's own reduction,
computes, and restores the local states so that accumulation can go on::

    from xcoll.integrations.torchmetrics import compute

    metrics = MetricCollection({"acc": MulticlassAccuracy(5), "loss": MeanMetric()}).to(dev)
    for batch in loader:
        metrics.update(...)          # no sync inside the loop
    values = compute(metrics)        # one xcoll call for every state of every metric

The same code runs on XLA replicas, on torch.distributed and in one process.
"""

from __future__ import annotations

from typing import Any

import torch
from torchmetrics import Metric, MetricCollection
from torchmetrics.utilities.data import dim_zero_cat

import xcoll


def _members(metric: Metric | MetricCollection) -> dict[str, Metric]:
    if isinstance(metric, MetricCollection):
        return dict(metric.items(keep_base=True, copy_state=False))
    return {"": metric}


def _local_states(m: Metric) -> dict[str, torch.Tensor]:
    """Each state as one tensor of at least one dim (list states concatenated)."""
    out = {}
    for attr in m._reductions:
        value = getattr(m, attr)
        if isinstance(value, list):
            value = dim_zero_cat(value) if value else torch.zeros(0, dtype=m.dtype, device=m.device)
        out[attr] = (
            value.reshape(1, *value.shape) if not isinstance(getattr(m, attr), list) else value
        )
    return out


def sync_states(
    metric: Metric | MetricCollection, *, group: Any = None
) -> dict[str, dict[str, Any]]:
    """Every metric's states reduced over all replicas, ``{member: {state: value}}``,
    from one xcoll call; each state reduced by its own ``dist_reduce_fx``."""
    members = _members(metric)
    local = {name: _local_states(m) for name, m in members.items()}
    # One call: tensor states are stacked (one row per replica), list states
    # concatenated, whatever their lengths.
    every = xcoll.gather(local, uneven=True, group=group)
    synced: dict[str, dict[str, Any]] = {}
    for name, m in members.items():
        synced[name] = {}
        for attr, fx in m._reductions.items():
            value = every[name][attr]
            if isinstance(getattr(m, attr), list):
                synced[name][attr] = value  # cat states: already the concatenation
            else:  # (add_state keeps a str dist_reduce_fx as its function)
                synced[name][attr] = fx(value) if callable(fx) else value
    return synced


def compute(metric: Metric | MetricCollection, *, group: Any = None) -> Any:
    """``metric.compute()`` over the states of every replica, synced in one xcoll
    call. The metric keeps its local states afterwards (and caches the result as
    torchmetrics does until the next update)."""
    members = _members(metric)
    synced = sync_states(metric, group=group)
    saved = {}
    for name, m in members.items():
        # torchmetrics' own bookkeeping: the states are "synced", compute() must
        # not sync again, and it restores the local states when it is done.
        saved[name] = m._to_sync
        m._cache = m._copy_state_dict()
        for attr, value in synced[name].items():
            setattr(m, attr, value)
        m._is_synced, m._to_sync, m._computed = True, False, None
    try:
        return metric.compute()
    finally:
        for name, m in members.items():
            m._to_sync = saved[name]
            if m._is_synced:  # compute() failed before unsyncing
                m.unsync()
