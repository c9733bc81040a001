"""torchmetrics through xcoll: every state of every metric in one call.

torchmetrics syncs through torch.distributed, one state tensor at a time, and is
not XLA-aware. Here all states of a ``Metric`` or a ``MetricCollection`` travel
in a single uneven :func:`xcoll.gather`: tensor states stacked, list states as
their rows' bytes with their dtype and row shape (Python ints, which ride in
the gather's own shape exchange), so list states of different lengths are fine
and a replica that saw no data takes the others' layout. Each state's own
reduction is applied after, and the local states are restored so that
accumulation goes on.

Two ways in. :func:`sync_with_xcoll` makes ``metric.compute()`` itself (and so
Lightning's logging, and any code that calls it) sync this way::

    from xcoll.integrations.torchmetrics import sync_with_xcoll

    metrics = sync_with_xcoll(MetricCollection({"acc": MulticlassAccuracy(5), "loss": MeanMetric()}).to(dev))
    for batch in loader:
        metrics.update(...)          # no sync inside the loop
    values = metrics.compute()       # one xcoll call for every state of every metric

and :func:`compute` does it once for a metric left as it is
(``values = compute(metrics)``). The same code runs on XLA replicas, on
torch.distributed and in one process.
"""

from __future__ import annotations

import types
from typing import Any, TypeVar

import torch
from torchmetrics import Metric, MetricCollection
from torchmetrics.utilities.data import dim_zero_cat

import xcoll

M = TypeVar("M", Metric, MetricCollection)

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


def _layout(name: str, attr: str, rows: torch.Tensor | None) -> list[int]:
    """A list state's layout: its dtype (an index of :data:`_DTYPES`, -1
    where it holds nothing), then the shape of its rows (their number of
    dims, then each, zeros after)."""
    if rows is None:
        return [-1] + [0] * (_DIMS + 1)
    shape = list(rows.shape[1:])
    if len(shape) > _DIMS or rows.dtype not in _DTYPES:
        raise ValueError(
            f"{name or 'metric'}.{attr}: a list state of {rows.dtype} rows of shape {tuple(shape)}; "
            f"xcoll syncs list states of rows of at most {_DIMS} dims, of the dtypes {_DTYPES}"
        )
    return [_DTYPES.index(rows.dtype), len(shape), *shape] + [0] * (_DIMS - len(shape))


def _local_list(m: Metric, name: str, attr: str) -> dict[str, Any]:
    """A list state as its rows' bytes and their layout: a replica that saw
    no data sends no bytes, and reads the dtype and row shape from the others'."""
    value = getattr(m, attr)
    # (the concatenation's dtype: torch.cat's of the list's, which may differ)
    rows = dim_zero_cat(value) if value else None
    if rows is None:
        data = torch.zeros(0, dtype=torch.uint8, device=m.device)
    else:
        data = rows.contiguous().reshape(-1).view(torch.uint8)
    return {"bytes": data, "layout": _layout(name, attr, rows)}


def _local_states(m: Metric, name: str) -> dict[str, Any]:
    """Each tensor state with one more dim (a row per replica, once
    gathered), each list state as :func:`_local_list`."""
    out: dict[str, Any] = {}
    for attr in m._reductions:
        value = getattr(m, attr)
        if isinstance(value, list):
            out[attr] = _local_list(m, name, attr)
        else:
            out[attr] = value.reshape(1, *value.shape)
    return out


def _joined_list(name: str, attr: str, every: dict[str, Any]) -> Any:
    """A list state's rows from every replica, in rank order (``[]`` where no
    replica has any, as torchmetrics' own sync leaves it); the replicas that
    have rows must agree on their dtype and row shape."""
    ranks = {r: x for r, x in enumerate(zip(*every["layout"], strict=True)) if x[0] >= 0}
    layouts = set(ranks.values())
    if not layouts:
        return []
    if len(layouts) > 1:
        first: dict[tuple[int, ...], str] = {}
        for r, (code, dims, *shape) in ranks.items():
            first.setdefault((code, dims, *shape), f"rank {r} has {_DTYPES[code]} rows of shape {tuple(shape[:dims])}")
        raise xcoll.CollectiveMismatchError(
            f"{name or 'metric'}.{attr}: the replicas' list states differ in dtype or row shape: "
            + "; ".join(first.values())
        )
    code, dims, *shape = layouts.pop()
    data, dtype = every["bytes"], _DTYPES[code]
    if data.storage_offset() % dtype.itemsize:  # (a view into the packed buffer)
        data = data.clone()
    return data.view(dtype).reshape(-1, *shape[:dims])


def sync_states(
    metric: Metric | MetricCollection, *, group: Any = None
) -> dict[str, dict[str, Any]]:
    """Every metric's states reduced over all replicas, from one xcoll call.

    Args:
        metric: a ``Metric`` or a ``MetricCollection``; left unmodified.
        group: as in :func:`xcoll.gather`.

    Returns:
        ``{member: {state: value}}`` (the member ``""`` for a single
        ``Metric``): tensor states stacked (a row per replica) and reduced by
        their own ``dist_reduce_fx``; list states as one tensor of every
        replica's rows in rank order, or ``[]`` where no replica has any.

    Raises:
        ValueError: a list state of rows of more than 6 dims or of another
            dtype than :data:`_DTYPES`, naming it.
        CollectiveMismatchError: the replicas' states differ in dtype or shape.
    """
    members = _members(metric)
    local = {name: _local_states(m, name) for name, m in members.items()}
    every = xcoll.gather(local, uneven=True, group=group)
    synced: dict[str, dict[str, Any]] = {}
    for name, m in members.items():
        synced[name] = {}
        for attr, fx in m._reductions.items():
            value = every[name][attr]
            if isinstance(getattr(m, attr), list):
                synced[name][attr] = _joined_list(name, attr, value)
            else:  # (add_state keeps a str dist_reduce_fx as its function)
                synced[name][attr] = fx(value) if callable(fx) else value
    return synced


def compute(metric: Metric | MetricCollection, *, group: Any = None) -> Any:
    """``metric.compute()`` over the states of every replica, synced in one xcoll call.

    Args:
        metric: a ``Metric`` or a ``MetricCollection``; it keeps its local
            states afterwards (and caches the result as torchmetrics does,
            until the next update).
        group: as in :func:`xcoll.gather`.

    Returns:
        What ``metric.compute()`` returns over every replica's data.

    Raises:
        ValueError: as in :func:`sync_states`.
        CollectiveMismatchError: as in :func:`sync_states`.

    >>> from torchmetrics import MeanMetric
    >>> m = MeanMetric(); m.update(torch.tensor([1.0, 2.0, 6.0]))
    >>> compute(m).item()  # (one process: its own data)
    3.0
    """
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
        # (a collection's own compute: sync_with_xcoll's sets the instance's)
        return metric.compute() if isinstance(metric, Metric) else type(metric).compute(metric)
    finally:
        for name, m in members.items():
            m._to_sync = saved[name]
            if m._is_synced:  # compute() failed before unsyncing
                m.unsync()


def _sync_dist(self: Metric, dist_sync_fn: Any = None, process_group: Any = None) -> None:
    """torchmetrics' ``Metric._sync_dist`` (which ``sync()`` calls, with
    its cache and unsync around it), through :func:`sync_states`."""
    for attr, value in sync_states(self, group=process_group or self.process_group)[""].items():
        setattr(self, attr, value)


def _compute_collection(self: MetricCollection) -> Any:
    """A collection's ``compute()``: every member's states in one call."""
    members = list(_members(self).values())
    return compute(self, group=members[0].process_group if members else None)


def _distributed() -> bool:
    """Whether torchmetrics should sync: on XLA replicas too."""
    return xcoll.world_size() > 1


def sync_with_xcoll(metric: M, *, group: Any = None) -> M:
    """Makes ``metric.compute()`` sync every state of ``metric`` through one xcoll call.

    torchmetrics' own ``sync()`` (which ``compute()``, ``forward`` with
    ``dist_sync_on_step`` and Lightning's logging call) then moves all states
    of a metric in one uneven gather instead of one collective per state,
    syncs on XLA replicas too (torchmetrics reads torch.distributed only),
    and is right where replicas called ``update`` a different number of
    times. A collection's ``compute()`` syncs all its members in one call.

    Args:
        metric: a ``Metric`` or a ``MetricCollection``, changed in place: its
            members' sync (and a collection's ``compute``). Members added to a
            collection afterwards are not changed.
        group: the process group (each member's ``process_group``); default:
            the metric's own, else the default group or every XLA replica.

    Returns:
        ``metric`` itself.

    Raises:
        Nothing itself; ``compute()`` raises as :func:`compute` does.

    >>> from torchmetrics import MeanMetric
    >>> m = sync_with_xcoll(MeanMetric()); m.update(torch.tensor([1.0, 2.0, 6.0]))
    >>> m.compute().item()  # (one process: no sync)
    3.0
    """
    for m in _members(metric).values():
        m._sync_dist = types.MethodType(_sync_dist, m)  # type: ignore[method-assign]
        m.distributed_available_fn = _distributed
        if group is not None:
            m.process_group = group
    if isinstance(metric, MetricCollection):
        metric.compute = types.MethodType(_compute_collection, metric)  # type: ignore[method-assign]
    return metric
