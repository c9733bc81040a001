"""The public collectives: ``gather``, ``reduce``, ``broadcast``,
``reduce_scatter``, ``all_to_all``, and the
replica's ``rank``, ``world_size`` and ``sync``.

Each builds its op (:mod:`xcoll._core.ops`; an uneven gather's is
``_uneven``'s) and runs it with :func:`xcoll._core.grad.call`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypedDict, TypeVar, overload

import torch

from . import _backends
from ._core import grad as _grad
from ._core import ops as _ops
from ._core import traced as _traced
from ._core import uneven as _uneven
from ._guard import order as _order
from ._guard import verdict as _verdict
from ._guard import watchdog as _watchdog

if TYPE_CHECKING:
    from typing_extensions import Unpack


def _flags(**flags: Any) -> None:
    """Refuses a flag that is not a bool: truthiness would read ``sync="no"``
    as True. (The public calls test ``x.__class__ is bool`` first, which makes
    no call, and call this only to name the flag.)"""
    for name, value in flags.items():
        if value is not True and value is not False:
            raise TypeError(f"{name} must be a bool (True or False), got {value!r:.80}")


_REDUCTIONS_NAMED = " ".join(f'"{r}"' for r in _ops.REDUCTIONS)

T = TypeVar("T")
M = TypeVar("M", bound=Mapping[Any, torch.Tensor])
S = TypeVar("S", bound=Sequence[torch.Tensor])
#: A mapping of Python scalars only (a bool or int is a float to a type checker)
F = TypeVar("F", bound=Mapping[Any, float])
K = TypeVar("K")

#: A reduction, by name.
ReduceOp = Literal["sum", "mean", "max", "min", "prod"]
#: ``reduce``'s ``op``: one reduction for every leaf, or a tree of them that is
#: a prefix of the tree's structure (a dict, list or tuple of names or of such
#: trees; a type checker reads its inner names as Any).
OpTree = ReduceOp | Mapping[Any, Any] | list[Any] | tuple[Any, ...]


class GatherOptions(TypedDict, total=False):
    """:func:`gather`'s keyword arguments, for its typed overloads."""

    dim: int
    stack: bool
    sync: bool
    to_cpu: bool
    uneven: bool
    max_size: int | None
    group: Any
    tag: str | int | None
    grad: bool


class ReduceOptions(TypedDict, total=False):
    """:func:`reduce`'s keyword arguments, for its typed overloads."""

    sync: bool
    to_cpu: bool
    group: Any
    tag: str | int | None
    grad: bool


class BroadcastOptions(ReduceOptions, total=False):
    """:func:`broadcast`'s keyword arguments, for its typed overloads."""

    src: int


@overload
def gather(tree: torch.Tensor, **options: Unpack[GatherOptions]) -> torch.Tensor: ...
@overload
def gather(tree: float, **options: Unpack[GatherOptions]) -> list[Any]: ...
@overload
def gather(tree: M, **options: Unpack[GatherOptions]) -> M: ...
@overload
def gather(tree: S, **options: Unpack[GatherOptions]) -> S: ...
@overload
def gather(tree: Any, **options: Unpack[GatherOptions]) -> Any: ...


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
    grad: bool = False,
) -> Any:
    """Every replica's leaves, concatenated along ``dim`` in rank order.

    For a tensor leaf of shape ``(*pre, n, *post)`` (``n`` at ``dim``) the output has
    shape ``(*pre, W * n, *post)``, and rank ``r``'s leaf is the slice
    ``r * n : (r + 1) * n`` along ``dim``. With ``stack=True`` a new axis of size
    ``W`` is inserted at ``dim`` instead (``dim=0``: a leading axis; rank ``r``'s
    leaf is ``out[r]``). A 0-d leaf gives shape ``(W,)`` either way. The output's
    rank never depends on ``W``. A Python scalar leaf gives a list of ``W`` values.

    One packed collective carries the whole tree. The input is left
    unmodified; outputs are new tensors, which require grad only with
    ``grad=True``.

    Args:
        tree: a pytree (dicts, lists, tuples, namedtuples, ... as optree
            flattens them; ``None`` is an empty subtree) of tensors and Python
            bool, int and float leaves, of the same structure, shapes and
            dtypes on every replica, on one device, whose backend the call
            uses (XLA, torch.distributed, or a world of one: docs/design.md).
        dim: the dimension along which tensor leaves are concatenated (or
            stacked).
        stack: insert a new axis of size ``W`` at ``dim`` instead of
            concatenating along it.
        sync: run the call now (on XLA: one graph execution, with the caller's
            pending work; a call of at most 4 KiB runs the pending work, then
            one all-gather program that every such call shares:
            docs/design.md). With ``False`` nothing is executed (but for a call
            of more than 1024 leaves of one dtype, which packs those that are
            data first, in chunks, in programs without collectives:
            docs/design.md): the collectives join the caller's pending graph
            (tensor leaves only), and the guard is read after the caller's
            next sync (``xcoll.sync()``), which raises
            :class:`xcoll.CollectiveMismatchError` where the calls differed.
            On torch.distributed the call starts its collectives and returns
            (a call of several waits for its first one); it completes at
            ``xcoll.sync()``, the group's next call or the first use of an
            output, whichever comes first, in the order of the calls
            (docs/design.md, "Calls in flight").
        to_cpu: return CPU tensors, fetched with one transfer per packed buffer.
        uneven: let tensor leaves differ in size along ``dim`` between
            replicas (other dims and dtypes must match; an empty shard is
            valid): the result holds exactly every replica's entries, in rank
            order. One small shape exchange, then one gather, through the host
            (``sync=True`` only; not with ``stack``); how each engine pads:
            docs/metrics.md.
        max_size: with ``uneven``, an upper bound on every leaf's size along
            ``dim``, the same on every replica (implies ``uneven``): no shape
            exchange, one execution.
        group: a torch.distributed process group (default: the default group);
            not for XLA leaves.
        tag: a str or an int that names the call, with any :class:`xcoll.step`
            around it. The replicas' tags must match, or every replica raises
            :class:`xcoll.CollectiveMismatchError` naming both (a replica that
            skipped a call is named at its next one; docs/reliability.md).
        grad: make the outputs differentiable (docs/gradients.md): the total
            loss is the sum of every replica's loss, and a replica's input
            gradient is the sum over replicas of its own rows of their output
            gradients. The backward is one guarded reduce-scatter of the
            output gradients (one per dtype; with ``uneven``, an all-reduce,
            on its own, after the pending work); every replica must run it,
            as it runs the call.
            Not with ``to_cpu``.

    Returns:
        A tree of ``tree``'s structure: each tensor leaf gathered (new tensors
        on the leaves' device, or on the CPU with ``to_cpu``), each Python
        scalar leaf a list of the ``W`` replicas' values in rank order. Type
        checkers read a tensor for a tensor, the same mapping or sequence
        type for a dict or list of tensors, a list for a Python scalar, and
        Any for other trees.

    Raises:
        TypeError: a leaf that is not a tensor, bool, int or float (or a
            complex, sparse, nested or meta tensor), leaves on two devices, CPU
            leaves in a process that runs XLA replicas, a ``dim`` or ``tag`` of
            the wrong type; raised before any communication, naming the leaf's
            path. A flag (``stack``, ``sync``, ``to_cpu``, ``uneven``,
            ``grad``) that is not a bool, a ``group`` that is neither a
            process group nor None, naming the argument.
        ValueError: ``dim`` out of range, ``uneven`` with ``stack``, a leaf
            larger than ``max_size``, Python scalars or ``to_cpu`` with
            ``sync=False``, ``to_cpu`` with ``grad``, ``group`` with XLA
            leaves or on a rank that is not its member.
        xcoll.CollectiveMismatchError: the replicas' calls differ (tree,
            shapes, dtypes, parameters or tags); raised on every replica, naming
            the first difference and both ranks.
        xcoll.ConcurrentCallError: another thread of this process called on
            the same process group at the same time (the group is unusable on
            this process from then on).
        RuntimeError: the launch went wrong (a launcher started this process as
            one of several but no process group is initialised; an XLA:CPU
            thread pool smaller than the replicas), a ``group`` given where
            torch.distributed is not initialised (never, or no longer), or a
            collective did not complete (a replica that never came: the
            engine's timeout).

    >>> import torch, xcoll
    >>> xcoll.gather({"x": torch.tensor([1, 2]), "n": 3})  # a world of one
    {'x': tensor([1, 2]), 'n': [3]}
    """
    if torch.compiler.is_dynamo_compiling():  # (xcoll._core.traced)
        return _traced.call(gather, tree, dict(
            dim=dim, stack=stack, group=group, sync=sync, to_cpu=to_cpu,
            uneven=uneven, max_size=max_size, grad=grad, tag=tag,
        ))
    if not (
        stack.__class__ is sync.__class__ is to_cpu.__class__ is uneven.__class__ is grad.__class__ is bool
    ):
        _flags(stack=stack, sync=sync, to_cpu=to_cpu, uneven=uneven, grad=grad)
    if uneven or max_size is not None:
        op: _ops.Op = _uneven.UnevenGather(dim, max_size, stack, grad)
    else:
        op = _ops.Gather(dim, stack, grad)
    return _grad.call(op, tree, group, sync=sync, to_cpu=to_cpu, tag=tag)


# (the first overload that matches wins: a mapping of tensors, or of Python
# scalars, keeps its type; a mapping of both, a dict literal of a loss and a
# count, gives Any values, each then used as what it is)
@overload
def reduce(tree: M, op: OpTree = "sum", **options: Unpack[ReduceOptions]) -> M: ...  # type: ignore[overload-overlap]
@overload
def reduce(tree: F, op: OpTree = "sum", **options: Unpack[ReduceOptions]) -> F: ...  # type: ignore[overload-overlap]
@overload
def reduce(tree: Mapping[K, torch.Tensor | float], op: OpTree = "sum", **options: Unpack[ReduceOptions]) -> dict[K, Any]: ...
@overload
def reduce(tree: T, op: OpTree = "sum", **options: Unpack[ReduceOptions]) -> T: ...


def reduce(
    tree: T,
    op: OpTree = "sum",
    *,
    sync: bool = True,
    to_cpu: bool = False,
    group: Any = None,
    tag: str | int | None = None,
    grad: bool = False,
) -> T:
    """The elementwise reduction of every replica's leaves.

    Shapes, dtypes and devices are preserved. max/min propagate NaN; integer
    tensors' sums and products wrap as the dtype does; Python ints reduce as
    Python computes them: a sum exactly (it may exceed int64: a Python int),
    a product exactly or with an ``OverflowError`` (below), never a wrapped
    value; float16 and bfloat16 sums, products and means accumulate in
    float32 and are rounded once. One collective per dtype and op (fewer
    where merging stays exact).

    The input is left unmodified; outputs are new tensors, which require grad
    only with ``grad=True``.

    Args:
        tree: a pytree of tensors and Python bool, int and float leaves, as in
            :func:`gather`, with the same shapes and dtypes on every replica.
        op: one of ``"sum" "mean" "max" "min" "prod"``, or an optree prefix tree
            of them (``{"loss": "mean", "count": "sum"}``). Refused: mean of
            integers or bools, sum of bools (use ``"max"`` for any, ``"min"``
            for all, or sum ``x.int()`` to count). Type checkers read a name
            as ``xcoll.ReduceOp`` (a misspelt one fails the check) and a tree
            of names as a dict, list or tuple.
        sync: as in :func:`gather`.
        to_cpu: return CPU tensors, fetched in the call's one transfer (on XLA,
            with the guard's header: a metric read on the host costs no second
            transfer).
        group: as in :func:`gather`.
        tag: as in :func:`gather`.
        grad: make the outputs differentiable (docs/gradients.md): a sum's
            input gradient is the sum of every replica's output gradient, a
            mean's their mean; other ops of floating leaves are refused. Not
            with ``to_cpu``.

    Returns:
        A tree of ``tree``'s structure whose leaves are the reduced values (new
        tensors on the leaves' device, or on the CPU with ``to_cpu``; Python
        scalars for Python scalar leaves). Type checkers read ``tree``'s
        type, and for a mapping of tensors and Python scalars both (a dict
        literal of a loss and a count) a dict of Any values.

    Raises:
        TypeError: an unsupported leaf (as in :func:`gather`), or an op its
            dtype refuses (mean of integers or bools, sum of bools), naming
            the leaf's path; before any communication. A flag (``sync``,
            ``to_cpu``, ``grad``) that is not a bool, or a ``group`` as in
            :func:`gather`.
        ValueError: an unknown op (None included), an op tree that is not a
            prefix of ``tree`` (naming where they part),
            Python scalars or ``to_cpu`` with ``sync=False``, ``to_cpu`` with
            ``grad``, an op other than sum and mean of a floating leaf with
            ``grad``, ``group`` with XLA leaves or on a rank that is not its
            member.
        xcoll.CollectiveMismatchError: the replicas' calls differ (as in
            :func:`gather`; ops included).
        xcoll.ConcurrentCallError: as in :func:`gather`.
        OverflowError: a product of Python ints that may not fit in int64
            (the replicas' magnitudes, each rounded up to a power of two,
            multiply past 2**63), naming the leaf's path, on every replica
            after the collective: reduce a tensor (whose product wraps) or
            multiply a gather's values in Python.
        RuntimeError: as in :func:`gather`.

    >>> import torch, xcoll
    >>> xcoll.reduce({"loss": torch.tensor(0.5), "n": 4}, {"loss": "mean", "n": "sum"})
    {'loss': tensor(0.5000), 'n': 4}
    """
    if torch.compiler.is_dynamo_compiling():  # (xcoll._core.traced)
        traced: T = _traced.call(reduce, tree, dict(op=op, group=group, sync=sync, to_cpu=to_cpu, grad=grad, tag=tag))
        return traced
    if not sync.__class__ is to_cpu.__class__ is grad.__class__ is bool:
        _flags(sync=sync, to_cpu=to_cpu, grad=grad)
    if op is None and tree is not None:  # (optree reads None as an empty tree, the prefix
        # of None alone: its own error named none of this)
        raise ValueError(
            f"op must be one of {_REDUCTIONS_NAMED}, or a prefix tree of them "
            '(e.g. {"loss": "mean", "n": "sum"}), got None'
        )
    # (a tree of the input's structure and leaf types)
    out: T = _grad.call(_ops.Reduce(op, grad), tree, group, sync=sync, to_cpu=to_cpu, tag=tag)
    return out


def reduce_scatter(
    tree: T,
    op: OpTree = "sum",
    *,
    dim: int = 0,
    sync: bool = True,
    to_cpu: bool = False,
    group: Any = None,
    tag: str | int | None = None,
    grad: bool = False,
) -> T:
    """On replica ``r``, the elementwise reduction of every replica's part
    ``r`` of each leaf.

    Each tensor leaf of shape ``(*pre, W * n, *post)`` (``W * n`` at
    ``dim``) is cut into ``W`` parts of ``n`` along ``dim``; replica ``r``
    returns, of shape ``(*pre, n, *post)``, the reduction over replicas of
    their slices ``r * n : (r + 1) * n``: ``reduce(tree, op)``'s result, cut
    the same way, with the same exactness (:func:`reduce`). One collective
    per dtype and op, as a reduce makes, each moving a W-th of its bytes.

    The input is left unmodified; outputs are new tensors, which require grad
    only with ``grad=True``.

    Args:
        tree: a pytree of tensors of at least one dim, as in :func:`gather`,
            with the same shapes and dtypes on every replica; each leaf's
            ``dim`` a multiple of ``W``.
        op: as in :func:`reduce`.
        dim: the dimension along which each leaf is cut into the replicas' parts.
        sync: as in :func:`gather`.
        to_cpu: as in :func:`reduce`.
        group: as in :func:`gather`.
        tag: as in :func:`gather`.
        grad: make the outputs differentiable (docs/gradients.md): a sum's
            input gradient is every replica's output gradient, gathered
            along ``dim`` (a mean's, divided by ``W``); other ops of floating
            leaves are refused. Not with ``to_cpu``.

    Returns:
        A tree of ``tree``'s structure whose leaves are this replica's
        reduced parts (new tensors on the leaves' device, or on the CPU with
        ``to_cpu``).

    Raises:
        TypeError: as in :func:`reduce`; a Python scalar leaf (it has no dim to
            cut), naming its path.
        ValueError: as in :func:`reduce`; a 0-d leaf, ``dim`` out of range,
            or a leaf whose ``dim`` is not a multiple of ``W``, naming its
            path, before any communication.
        xcoll.CollectiveMismatchError: as in :func:`gather` (``dim`` and ops
            included).
        xcoll.ConcurrentCallError: as in :func:`gather`.
        RuntimeError: as in :func:`gather`.

    >>> import torch, xcoll
    >>> xcoll.reduce_scatter({"grad": torch.tensor([1.0, 2.0])})  # a world of one
    {'grad': tensor([1., 2.])}
    """
    if torch.compiler.is_dynamo_compiling():  # (xcoll._core.traced)
        traced: T = _traced.call(reduce_scatter, tree, dict(
            op=op, dim=dim, group=group, sync=sync, to_cpu=to_cpu, grad=grad, tag=tag
        ))
        return traced
    if not sync.__class__ is to_cpu.__class__ is grad.__class__ is bool:
        _flags(sync=sync, to_cpu=to_cpu, grad=grad)
    out: T = _grad.call(_ops.ReduceScatter(op, dim=dim, grad=grad), tree, group, sync=sync, to_cpu=to_cpu, tag=tag)
    return out


def all_to_all(
    tree: T,
    *,
    dim: int = 0,
    sync: bool = True,
    to_cpu: bool = False,
    group: Any = None,
    tag: str | int | None = None,
    grad: bool = False,
) -> T:
    """On replica ``r``, every replica's part ``r`` of each leaf, in rank order.

    Each tensor leaf of shape ``(*pre, W * n, *post)`` (``W * n`` at
    ``dim``) is cut into ``W`` parts of ``n`` along ``dim``, part ``s``
    addressed to replica ``s``; replica ``r`` returns a tensor of the same
    shape whose slice ``s * n : (s + 1) * n`` along ``dim`` is replica
    ``s``'s part ``r``, bit for bit. One collective carries the whole tree.

    The input is left unmodified; outputs are new tensors, which require grad
    only with ``grad=True``.

    Args:
        tree: a pytree of tensors of at least one dim, as in :func:`gather`,
            with the same shapes and dtypes on every replica; each leaf's
            ``dim`` a multiple of ``W``.
        dim: the dimension along which each leaf is cut and its parts
            concatenated.
        sync: as in :func:`gather`.
        to_cpu: as in :func:`gather`.
        group: as in :func:`gather`.
        tag: as in :func:`gather`.
        grad: make the outputs differentiable (docs/gradients.md): the
            input gradient is the same all-to-all of the output gradients.
            Not with ``to_cpu``.

    Returns:
        A tree of ``tree``'s structure and shapes: each leaf the parts
        addressed to this replica (new tensors on the leaves' device, or on
        the CPU with ``to_cpu``).

    Raises:
        TypeError: as in :func:`gather`; a Python scalar leaf, naming its path.
        ValueError: as in :func:`reduce_scatter`.
        xcoll.CollectiveMismatchError: as in :func:`gather`.
        xcoll.ConcurrentCallError: as in :func:`gather`.
        RuntimeError: as in :func:`gather`.

    >>> import torch, xcoll
    >>> xcoll.all_to_all({"tokens": torch.tensor([[1, 2], [3, 4]])}, dim=1)  # a world of one
    {'tokens': tensor([[1, 2],
            [3, 4]])}
    """
    if torch.compiler.is_dynamo_compiling():  # (xcoll._core.traced)
        traced: T = _traced.call(all_to_all, tree, dict(
            dim=dim, group=group, sync=sync, to_cpu=to_cpu, grad=grad, tag=tag
        ))
        return traced
    if not sync.__class__ is to_cpu.__class__ is grad.__class__ is bool:
        _flags(sync=sync, to_cpu=to_cpu, grad=grad)
    out: T = _grad.call(_ops.AllToAll(dim=dim, grad=grad), tree, group, sync=sync, to_cpu=to_cpu, tag=tag)
    return out


@overload
def broadcast(tree: M, **options: Unpack[BroadcastOptions]) -> M: ...  # type: ignore[overload-overlap]
@overload
def broadcast(tree: F, **options: Unpack[BroadcastOptions]) -> F: ...  # type: ignore[overload-overlap]
@overload
def broadcast(tree: Mapping[K, torch.Tensor | float], **options: Unpack[BroadcastOptions]) -> dict[K, Any]: ...
@overload
def broadcast(tree: T, **options: Unpack[BroadcastOptions]) -> T: ...


def broadcast(
    tree: T,
    *,
    src: int = 0,
    sync: bool = True,
    to_cpu: bool = False,
    group: Any = None,
    tag: str | int | None = None,
    grad: bool = False,
) -> T:
    """Replica ``src``'s leaves, bit for bit, on every replica.

    Values of the other replicas (NaN included) never reach the result; their
    leaves only need the same shapes and dtypes as ``src``'s.

    The input is left unmodified; outputs are new tensors, which require grad
    only with ``grad=True``.

    Args:
        tree: a pytree of tensors and Python bool, int and float leaves, as in
            :func:`gather`, with the same shapes and dtypes on every replica.
        src: the rank, in ``group``, whose leaves every replica gets.
        sync: as in :func:`gather`.
        to_cpu: as in :func:`gather`.
        group: as in :func:`gather`.
        tag: as in :func:`gather`.
        grad: make the outputs differentiable (docs/gradients.md): ``src``'s
            input gradient is the sum of every replica's output gradient, the
            others' are zeros. Not with ``to_cpu``.

    Returns:
        A tree of ``tree``'s structure with ``src``'s values (new tensors on
        the leaves' device, or on the CPU with ``to_cpu``; Python scalars for
        Python scalar leaves): of ``tree``'s type, as :func:`reduce`'s.

    Raises:
        TypeError: an unsupported leaf (as in :func:`gather`), naming its
            path; a flag (``sync``, ``to_cpu``, ``grad``) that is not a bool,
            or a ``group`` as in :func:`gather`.
        ValueError: ``src`` is not a rank in ``[0, W)``; Python scalars or
            ``to_cpu`` with ``sync=False``; ``to_cpu`` with ``grad``; ``group``
            with XLA leaves or on a rank that is not its member.
        xcoll.CollectiveMismatchError: the replicas' calls differ (as in
            :func:`gather`; ``src`` included), on every replica. On
            torch.distributed a broadcast over 4 KiB (or of CUDA leaves) is a
            star from ``src``: the receivers raise, and ``src`` returns its
            own tree, its result whatever the others did.
        xcoll.ConcurrentCallError: as in :func:`gather`.
        RuntimeError: as in :func:`gather`.

    >>> import torch, xcoll
    >>> xcoll.broadcast({"seed": 7, "w": torch.ones(2)})
    {'seed': 7, 'w': tensor([1., 1.])}
    """
    if torch.compiler.is_dynamo_compiling():  # (xcoll._core.traced)
        traced: T = _traced.call(broadcast, tree, dict(
            src=src, group=group, sync=sync, to_cpu=to_cpu, grad=grad, tag=tag
        ))
        return traced
    if not sync.__class__ is to_cpu.__class__ is grad.__class__ is bool:
        _flags(sync=sync, to_cpu=to_cpu, grad=grad)
    # (a tree of the input's structure and leaf types)
    out: T = _grad.call(_ops.Broadcast(src, grad), tree, group, sync=sync, to_cpu=to_cpu, tag=tag)
    return out


def rank(group: Any = None) -> int:
    """This replica's rank.

    Args:
        group: a torch.distributed process group (default: the default group,
            or the XLA replicas where XLA's runtime runs here).

    Returns:
        The rank in ``[0, world_size(group))``: the XLA replica's, the rank in
        ``group``, or 0 in a plain single process (a world of one).

    Raises:
        TypeError: ``group`` is neither a torch.distributed process group nor
            None.
        ValueError: ``group`` is one this process is not a member of.
        RuntimeError: a launcher started this process as one of several
            (``WORLD_SIZE``, ``OMPI_COMM_WORLD_SIZE``, ``PMI_SIZE`` > 1) but no
            process group is initialised (docs/launchers.md), or ``group`` is
            given and torch.distributed is not initialised.

    >>> import xcoll
    >>> xcoll.rank()
    0
    """
    if torch.compiler.is_dynamo_compiling():  # (a constant of the graph, where it is one)
        return _traced.asked(rank, group)
    return _backends.current(group).rank()


def world_size(group: Any = None) -> int:
    """The number of replicas.

    Args:
        group: as in :func:`rank`.

    Returns:
        The number of XLA replicas, of processes in ``group`` (default: the
        default process group), or 1 in a plain single process.

    Raises:
        TypeError: as in :func:`rank`.
        ValueError: as in :func:`rank`.
        RuntimeError: as in :func:`rank`.

    >>> import xcoll
    >>> xcoll.world_size()
    1
    """
    if torch.compiler.is_dynamo_compiling():  # (a constant of the graph, where it is one)
        return _traced.asked(world_size, group)
    return _backends.current(group).world


def sync(group: Any = None) -> None:
    """Completes this replica's pending calls (those made with ``sync=False``).

    On XLA this is ``torch_xla.sync()`` under xcoll's process-wide lock, which
    thread-per-device replicas (XLA:CPU, older TPUs) need to avoid compiling the
    same graph once per thread, followed by a wait for this replica's execution
    and a read of the guards of the ``sync=False`` calls it ran. On
    torch.distributed it completes the process's calls in flight, in the
    order they were made on each group (of ``group`` only, if given): waits for their
    collectives, reads their guards and makes their outputs. A wait of more
    than a few seconds (a replica that skipped a call) prints xcoll's
    diagnosis to stderr.

    Args:
        group: on torch.distributed, complete only the calls made on this
            process group (default: every group's). Ignored on XLA, whose
            sync runs the whole pending graph.

    Raises:
        CollectiveMismatchError: a ``sync=False`` call that it completed
            differed between replicas (on every replica).
        RuntimeError: as in :func:`rank` (a launched process without a process
            group, a ``group`` given where torch.distributed is not
            initialised).

    >>> import xcoll
    >>> xcoll.sync()  # a world of one: nothing is pending
    """
    if torch.compiler.is_dynamo_compiling():  # (a graph break: xcoll._core.traced)
        _traced.eagerly(sync, group)
        return
    transport = _backends.current(group)
    if not transport.lazy:
        _order.sync(None if group is None else transport.group_key)
        return
    if transport.world == 1:
        _verdict.synced(transport)
        return
    with _watchdog.watch(lambda seconds: _waited(seconds, True)):
        _verdict.synced(transport)


def _waited(seconds: float, lazy: bool) -> str:
    return (
        f"xcoll: xcoll.sync has waited {seconds:.0f} s: the pending collectives of calls made "
        f"with sync=False wait for the other replicas. {_verdict.causes(lazy)}"
    )
