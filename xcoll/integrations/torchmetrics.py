"""torchmetrics through xcoll: every state of every metric in one call.

torchmetrics syncs through torch.distributed, one state tensor at a time, and is
not XLA-aware. :func:`compute` gathers all states of a ``Metric`` or a
``MetricCollection`` with a single uneven :func:`xcoll.gather` (so list states of
different lengths and empty ones are fine: where a metric has list states, one
small gather of their layouts comes first, so that a replica that saw no data
sends no rows of the others' dtype and shape), applies each state's own reduction,
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


#: The dtypes a list state's empty placeholder can take, by index (:func:`_layout`).
_DTYPES = (
    *(torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64),
    *(torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool),
)
#: The most dims of a list state's rows that its layout carries.
_DIMS = 6


def _list_states(members: dict[str, Metric]) -> list[tuple[str, str]]:
    """Every list state, as ``(member, state)``, in one order on every replica."""
    return [
        (name, attr)
        for name, m in members.items()
        for attr in m._reductions
        if isinstance(getattr(m, attr), list)
    ]


def _layout(name: str, attr: str, value: list[torch.Tensor]) -> list[int]:
    """A list state's layout: its dtype (an index of :data:`_DTYPES`, -1
    where it holds nothing), then the shape of its rows (their number of
    dims, then each, zeros after)."""
    if not value:
        return [-1] + [0] * (_DIMS + 1)
    t = dim_zero_cat(value)  # (its dtype: torch.cat's of the list's, which may differ)
    shape = list(t.shape[1:])
    if len(shape) > _DIMS or t.dtype not in _DTYPES:
        raise ValueError(
            f"{name or 'metric'}.{attr}: a list state of {t.dtype} rows of shape {tuple(shape)}; "
            f"xcoll syncs list states of rows of at most {_DIMS} dims, of the dtypes {_DTYPES}"
        )
    return [_DTYPES.index(t.dtype), len(shape), *shape] + [0] * (_DIMS - len(shape))


def _list_layouts(members: dict[str, Metric], group: Any) -> dict[tuple[str, str], list[int]]:
    """Each list state's layout (:func:`_layout`) as the first replica that
    holds rows has it (-1 first where none does): a replica whose list state
    is empty (it saw no data) sends no rows of that dtype and shape. One
    small call, made where the metric has list states."""
    keys = _list_states(members)
    if not keys:
        return {}
    mine = [_layout(name, attr, getattr(members[name], attr)) for name, attr in keys]
    every = xcoll.gather(mine, stack=True, group=group)  # (per value, the replicas' W)
    rows = [list(zip(*state, strict=True)) for state in every]  # (per state, per replica)
    return {key: list(next((r for r in rows[k] if r[0] >= 0), rows[k][0])) for k, key in enumerate(keys)}


def _local_states(m: Metric, name: str, layouts: dict[tuple[str, str], list[int]]) -> dict[str, torch.Tensor]:
    """Each state as one tensor of at least one dim (list states concatenated;
    an empty one as no rows of the others' layout)."""
    out = {}
    for attr in m._reductions:
        value = getattr(m, attr)
        if isinstance(value, list) and value:
            value = dim_zero_cat(value)
        elif isinstance(value, list):
            code, dims, *shape = layouts[(name, attr)]
            # (where no replica has rows: the metric's dtype, dropped after)
            dtype = _DTYPES[code] if code >= 0 else m.dtype
            value = torch.zeros((0, *shape[:dims]), dtype=dtype, device=m.device)
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
    layouts = _list_layouts(members, group)
    local = {name: _local_states(m, name, layouts) for name, m in members.items()}
    # One call: tensor states are stacked (one row per replica), list states
    # concatenated, whatever their lengths.
    every = xcoll.gather(local, uneven=True, group=group)
    synced: dict[str, dict[str, Any]] = {}
    for name, m in members.items():
        synced[name] = {}
        for attr, fx in m._reductions.items():
            value = every[name][attr]
            if isinstance(getattr(m, attr), list):
                # cat states: already the concatenation; none where no replica
                # had rows, as torchmetrics' own sync leaves them
                synced[name][attr] = value if layouts[(name, attr)][0] >= 0 else []
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
