"""The public collectives: ``gather``, ``reduce``, ``broadcast``, and the
replica's ``rank``, ``world_size`` and ``sync``.

Each is one :func:`xcoll._call.call` of its op (``_call``); uneven gathers are
``_uneven``'s.
"""

from __future__ import annotations

from typing import Any

from . import _backends, _call, _uneven, _watchdog


def gather(
    tree: Any,
    *,
    dim: int = 0,
    stack: bool = False,
    sync: bool = True,
    to_cpu: bool = False,
    uneven: bool = False,
    max_size: int | None = None,
    group: Any = None,
    tag: str | int | None = None,
) -> Any:
    """Every replica's leaves, concatenated along ``dim`` in rank order.

    For a tensor leaf of shape ``(*pre, n, *post)`` (``n`` at ``dim``) the output has
    shape ``(*pre, W * n, *post)``, and rank ``r``'s leaf is the slice
    ``r * n : (r + 1) * n`` along ``dim``. With ``stack=True`` a new axis of size
    ``W`` is inserted at ``dim`` instead (``dim=0``: a leading axis; rank ``r``'s
    leaf is ``out[r]``). A 0-d leaf gives shape ``(W,)`` either way. The output's
    rank never depends on ``W``. A Python scalar leaf gives a list of ``W`` values.

    All leaves must have the same shapes and dtypes on every replica. ``to_cpu=True``
    returns CPU tensors, fetched with one transfer per packed buffer. With
    ``sync=False`` nothing is executed: the collectives join the caller's pending
    graph (tensor leaves only; on eager backends the call completes anyway).
    ``group`` selects a torch.distributed process group (default: the default
    group); the backend follows from the leaves' device (see docs/design.md).
    ``tag`` (a str or an int) names the call, with any :func:`xcoll.step`
    around it: the replicas' tags must match, or every replica raises
    :class:`xcoll.CollectiveMismatchError` naming both (a replica that skipped
    a call is named at its next one; docs/reliability.md).

    ``uneven=True`` lets tensor leaves differ in size along ``dim`` between
    replicas (other dims and dtypes must match); the result holds exactly every
    replica's entries, in rank order, and an empty shard is valid. It costs one
    small shape exchange for the whole tree, then one gather of leaves padded to
    a shared power-of-two size (so XLA compiles a bounded number of graphs); with
    ``max_size`` (an upper bound known on every replica, e.g. the batch size) there
    is no exchange and the call is a single execution. Uneven gathers stage
    through the host (``sync=True`` only; ``stack`` does not apply).

    The input is left unmodified; outputs are new tensors that never require grad.

    >>> import torch, xcoll
    >>> xcoll.gather({"x": torch.tensor([1, 2]), "n": 3})  # a world of one
    {'x': tensor([1, 2]), 'n': [3]}
    """
    if uneven or max_size is not None:
        op: _call.Op = _uneven.UnevenGather(dim, max_size, stack)
    else:
        op = _call.Gather(dim, stack)
    return _call.call(op, tree, group, sync=sync, to_cpu=to_cpu, tag=tag)


def reduce(
    tree: Any,
    op: Any = "sum",
    *,
    sync: bool = True,
    group: Any = None,
    tag: str | int | None = None,
) -> Any:
    """The elementwise reduction of every replica's leaves.

    ``op`` is one of ``"sum" "mean" "max" "min" "prod"``, or an optree prefix tree of
    them (``{"loss": "mean", "count": "sum"}``). Shapes, dtypes and devices are
    preserved. max/min propagate NaN; integer sums and products wrap as the dtype
    does; float16 and bfloat16 sums, products and means accumulate in float32 and
    are rounded once. Refused, before any communication: mean of integers or
    bools, sum of bools (use ``"max"`` for any, ``"min"`` for all, or sum
    ``x.int()`` to count). ``group`` and ``tag`` as in :func:`gather`.

    The input is left unmodified; outputs are new tensors that never require grad.

    >>> import torch, xcoll
    >>> xcoll.reduce({"loss": torch.tensor(0.5), "n": 4}, {"loss": "mean", "n": "sum"})
    {'loss': tensor(0.5000), 'n': 4}
    """
    return _call.call(_call.Reduce(op), tree, group, sync=sync, tag=tag)


def broadcast(
    tree: Any,
    *,
    src: int = 0,
    sync: bool = True,
    group: Any = None,
    tag: str | int | None = None,
) -> Any:
    """Replica ``src``'s leaves, bit for bit, on every replica.

    Values of the other replicas (NaN included) never reach the result; their
    leaves only need the same shapes and dtypes as ``src``'s. ``src`` is a rank in
    ``group`` (``group`` and ``tag`` as in :func:`gather`).

    The input is left unmodified; outputs are new tensors that never require grad.

    >>> import torch, xcoll
    >>> xcoll.broadcast({"seed": 7, "w": torch.ones(2)})
    {'seed': 7, 'w': tensor([1., 1.])}
    """
    return _call.call(_call.Broadcast(src), tree, group, sync=sync, tag=tag)


def rank(group: Any = None) -> int:
    """This replica's rank in ``[0, world_size(group))``.

    >>> import xcoll
    >>> xcoll.rank()
    0
    """
    return _backends.current(group).rank()


def world_size(group: Any = None) -> int:
    """The number of replicas: XLA replicas, the torch.distributed process group
    (``group``, default: the default group), or 1 in a plain single process."""
    return _backends.current(group).world_size()


def sync() -> None:
    """Runs this replica's pending graph (after calls with ``sync=False``).

    On XLA this is ``torch_xla.sync()`` under xcoll's process-wide lock, which
    thread-per-device replicas (XLA:CPU, older TPUs) need to avoid compiling the
    same graph once per thread, followed by a wait for this replica's execution;
    elsewhere it does nothing. A wait of more than a few seconds (a replica
    that skipped a call) prints xcoll's diagnosis to stderr.
    """
    transport = _backends.current()
    if transport.world_size() == 1:
        transport.sync()
        return
    with _watchdog.watch(_waited):
        transport.sync()


def _waited(seconds: float) -> str:
    return (
        f"xcoll: xcoll.sync has waited {seconds:.0f} s: the pending collectives of calls made "
        "with sync=False wait for a replica that has not made the same calls (it skipped one, "
        "or raised before it); the engine then times out or aborts the process"
    )
