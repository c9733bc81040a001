"""gather, reduce and broadcast: flatten -> bucket -> pack -> one collective per
bucket -> one sync -> unpack.

Each public function only says how its buckets are keyed, which collective a
bucket takes, and how a leaf's slice of the result becomes the output leaf; the
pipeline in :func:`_run` is shared.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from . import _backends, _check, _memo, _pack, _tree, _wire

OPS = ("sum", "mean", "max", "min", "prod")

# The collective each (kind of dtype, op) takes. Missing pairs are refused:
# mean of integers would need a dtype change; sum of bools is ambiguous (count or
# any); max/min are not defined for complex numbers, which xcoll refuses anyway.
_FLOAT_OPS = {"sum": "sum", "mean": "sum", "prod": "prod", "max": "max", "min": "min"}
_INT_OPS = {"sum": "sum", "prod": "prod", "max": "max", "min": "min"}
_BOOL_OPS = {"max": "max", "min": "min", "prod": "min"}
_REFUSED = {
    "mean": "mean needs a floating dtype (convert first, e.g. x.float())",
    "sum": 'sum of bools is ambiguous: use "max" for any, "min" for all, or sum x.int() to count',
}


@dataclass(frozen=True)
class _Plan:
    """How one kind of call moves one kind of tree (built once per
    :attr:`_tree.Flat.key` and parameters, then reused; building validates the
    call, so a call that raises leaves nothing behind)."""

    buckets: list[_pack.Bucket]
    #: Per bucket: each tensor slot's output shape (before ``finish``), then, if
    #: it has Python scalars, the shape of their block, ``(*lead, k)``.
    shapes: list[tuple[tuple[int, ...], ...]]
    #: The leaves that go through the call's ``finish``.
    finishing: frozenset[int] = frozenset()


_plans: _memo.Memo[_Plan] = _memo.Memo()


def _layout(
    flat: _tree.Flat,
    keys: list[Hashable],
    dtypes: list[torch.dtype],
    lead: tuple[int, ...],
    shape: Callable[[int], tuple[int, ...]],
    finishing: frozenset[int] = frozenset(),
) -> _Plan:
    buckets = _pack.plan(flat.leaves, keys, dtypes)
    shapes = [
        tuple(shape(s.leaf) for s in b.tensors)
        + ((lead + (len(b.scalars),),) if b.scalars else ())
        for b in buckets
    ]
    return _Plan(buckets, shapes, finishing)


def _dtype(leaf: Any) -> torch.dtype:
    return leaf.dtype if isinstance(leaf, torch.Tensor) else _tree.scalar_dtype(leaf)


def _check_sync(flat: _tree.Flat, sync: bool, to_cpu: bool = False) -> None:
    if sync:
        return
    if to_cpu:
        raise ValueError("to_cpu=True needs sync=True: host values exist only after execution")
    if flat.scalars:
        raise ValueError(
            f"{flat.path(flat.scalars[0])}: a Python scalar leaf needs sync=True (its value is "
            "known only after execution); pass a tensor to trace it into the pending graph"
        )


def _run(
    backend: _backends.Backend,
    flat: _tree.Flat,
    plan: _Plan,
    pack: Callable[[list[_pack.Bucket], list[list[torch.Tensor]]], list[torch.Tensor]],
    send: Callable[[torch.Tensor, _pack.Bucket], torch.Tensor],
    unpack: Callable[[list[torch.Tensor], list[_pack.Bucket]], list[torch.Tensor]],
    finish: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    *,
    sync: bool,
    to_cpu: bool = False,
    name: str,
) -> list[Any]:
    """Runs one collective per bucket and returns one output per leaf.

    ``pack(buckets, parts)`` turns each bucket's :func:`_pack.parts` into the 1-d
    buffer ``send`` starts its collective on. Once every collective of the call
    has been started and ``backend.wait()`` has returned, ``unpack(results,
    buckets)`` turns the results into one 1-d buffer per bucket in which each
    slot's block is contiguous, in slot order (the Python scalars' block last),
    and that buffer is cut into ``plan.shapes``. Python scalar leaves come back
    as CPU tensors of the scalar block's shape without its last dim. Leaves in
    ``plan.finishing`` then go through ``finish(i, t)``.
    """
    if plan.finishing:
        finishing, finish_leaf = plan.finishing, finish
        finish = lambda i, t: finish_leaf(i, t) if i in finishing else t  # noqa: E731
    else:
        finish = None
    out: list[Any] = [None] * len(flat.leaves)
    live, shapes = [], []
    for b, bucket_shapes in zip(plan.buckets, plan.shapes):
        if b.size:
            live.append(b)
            shapes.append(bucket_shapes)
            continue
        for s, shape in zip(b.tensors, bucket_shapes):  # only empty tensors: nothing to send
            device = "cpu" if to_cpu else flat.leaves[s.leaf].device
            t = torch.empty(shape, dtype=b.dtype, device=device)
            out[s.leaf] = finish(s.leaf, t) if finish else t
    if not live:
        return out
    wires = pack(live, [_pack.parts(b, flat.leaves, backend.upload) for b in live])
    results = [send(wire, b) for wire, b in zip(wires, live)]
    del wires
    try:
        backend.wait()  # eager backends started every collective asynchronously
    except RuntimeError as e:  # e.g. gloo's timeout when a replica never arrives
        raise RuntimeError(
            f"{name}: a collective did not complete on rank {backend.rank()}: {e}"
        ) from e
    flats = unpack(results, live)
    del results
    if to_cpu:
        backend.sync()
        pieces = [_pack.split(h, s) for h, s in zip(backend.to_host(flats), shapes)]
        del flats
    else:
        # Outputs are traced before the sync so that it materialises them; only
        # they and the scalar blocks stay referenced, so they alone become graph
        # outputs.
        pieces = backend.split(flats, shapes)
        del flats
    blocks = []
    for b, bucket_pieces in zip(live, pieces):
        tensors = bucket_pieces[: len(b.tensors)]
        if finish:
            tensors = [finish(s.leaf, t) for s, t in zip(b.tensors, tensors)]
        for s, t in zip(b.tensors, tensors):
            out[s.leaf] = t
        if b.scalars:
            blocks.append((b, bucket_pieces[-1]))
    del pieces, bucket_pieces
    if not to_cpu:
        if sync:
            backend.sync()
        if blocks:
            blocks = list(zip([b for b, _ in blocks], backend.to_host([t for _, t in blocks])))
    for b, block in blocks:
        for j, s in enumerate(b.scalars):
            t = block[..., j]
            out[s.leaf] = finish(s.leaf, t) if finish else t
    return out


def _outputs(flat: _tree.Flat, out: list[Any], scalar: Callable[[torch.Tensor, Any], Any]) -> Any:
    """The output tree: tensors as they are, Python scalars back to Python values."""
    for i in flat.scalars:
        out[i] = scalar(out[i], flat.leaves[i])
    return flat.unflatten(out)


def _gather_plan(flat: _tree.Flat, dim: int, stack: bool, w: int) -> _Plan:
    dims = {
        i: _gather_dim(flat, i, dim, stack)
        for i, leaf in enumerate(flat.leaves)
        if isinstance(leaf, torch.Tensor)
    }

    def shape(i: int) -> tuple[int, ...]:
        leaf_shape = tuple(flat.leaves[i].shape)
        if dims[i] == 0 and not stack and leaf_shape:  # concatenated along dim 0
            return (w * leaf_shape[0], *leaf_shape[1:])
        return (w, *leaf_shape)  # stacked, or moved into place by finish

    dtypes = [_dtype(leaf) for leaf in flat.leaves]
    return _layout(flat, dtypes, dtypes, (w,), shape, frozenset(i for i, d in dims.items() if d))


def _gather_dim(flat: _tree.Flat, i: int, dim: int, stack: bool) -> int:
    ndim = flat.leaves[i].dim()
    if ndim == 0:
        return 0
    n = ndim + 1 if stack else ndim
    if not -n <= dim < n:
        raise ValueError(
            f"{flat.path(i)}: dim={dim} is out of range for a leaf of shape {tuple(flat.leaves[i].shape)}"
        )
    return dim % n


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

    ``uneven=True`` lets tensor leaves differ in size along ``dim`` between
    replicas (other dims and dtypes must match); the result holds exactly every
    replica's entries, in rank order, and an empty shard is valid. It costs one
    small shape exchange for the whole tree, then one gather of leaves padded to
    a shared power-of-two size (so XLA compiles a bounded number of graphs); with
    ``max_size`` (an upper bound known on every replica, e.g. the batch size) there
    is no exchange and the call is a single execution. Uneven gathers stage
    through the host (``sync=True`` only; ``stack`` does not apply).

    >>> import torch, xcoll
    >>> xcoll.gather({"x": torch.tensor([1, 2]), "n": 3})  # a world of one
    {'x': tensor([1, 2]), 'n': [3]}
    """
    with _check.outermost() as outer:
        if outer:
            params = f"dim={dim} stack={stack} uneven={uneven or max_size is not None} max_size={max_size} to_cpu={to_cpu} sync={sync}"
            _check.check(
                "xcoll.gather",
                lambda: [params, *_describe_gather(tree, dim, stack, uneven, max_size, group)],
                group=group,
            )
        return _gather(
            tree,
            dim=dim,
            stack=stack,
            sync=sync,
            to_cpu=to_cpu,
            uneven=uneven,
            max_size=max_size,
            group=group,
        )


def _describe_gather(tree, dim, stack, uneven, max_size, group) -> list[str]:
    flat = _tree.flatten(tree)
    _backends.resolve(flat, group)  # device errors are shared like the others
    if uneven or max_size is not None:
        from . import _uneven

        # only the growing dim may differ between replicas
        dims = _uneven.growing_dims(flat, dim)
        return [*_check.describe_tree(flat, dims), _check.describe_structure(flat)]
    for i, leaf in enumerate(flat.leaves):
        if isinstance(leaf, torch.Tensor):
            _gather_dim(flat, i, dim, stack)
    return [*_check.describe_tree(flat), _check.describe_structure(flat)]


def _gather(tree, *, dim, stack, sync, to_cpu, uneven, max_size, group):
    if uneven or max_size is not None:
        if stack or not sync:
            raise ValueError(
                "uneven gathers concatenate and run now: stack=True and sync=False do not apply"
            )
        if max_size is not None and (
            isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 0
        ):
            raise ValueError(f"max_size must be a non-negative int, got {max_size!r}")
        from . import _uneven

        return _uneven.gather(tree, dim=dim, max_size=max_size, to_cpu=to_cpu, group=group)
    flat = _tree.flatten(tree)
    _check_sync(flat, sync, to_cpu)
    backend = _backends.resolve(flat, group)
    w = backend.world_size()
    plan = _plans.get(("gather", dim, stack, w, flat.key), lambda: _gather_plan(flat, dim, stack, w))
    dims = {i: _gather_dim(flat, i, dim, stack) for i in plan.finishing}

    def finish(i: int, t: torch.Tensor) -> torch.Tensor:  # (W, *shape) -> (*shape[:d], W, *shape[d:])
        d = dims[i]
        t = t.movedim(0, d)
        if stack:
            return t
        pre = t.shape
        return t.reshape(*pre[:d], w * pre[d + 1], *pre[d + 2 :])

    out = _run(
        backend,
        flat,
        plan,
        _pack_moves(backend),
        lambda wire, b: backend.all_gather(wire),
        _unpack_moves(backend, w),
        finish,
        sync=sync,
        to_cpu=to_cpu,
        name="xcoll.gather",
    )
    return _outputs(flat, out, lambda block, like: [_tree.to_python(v, like) for v in block])


def reduce(tree: Any, op: Any = "sum", *, sync: bool = True, group: Any = None) -> Any:
    """The elementwise reduction of every replica's leaves.

    ``op`` is one of ``"sum" "mean" "max" "min" "prod"``, or an optree prefix tree of
    them (``{"loss": "mean", "count": "sum"}``). Shapes, dtypes and devices are
    preserved. max/min propagate NaN; integer sums and products wrap as the dtype
    does; float16 and bfloat16 sums and products accumulate in float32. Refused,
    before any communication: mean of integers or bools, sum of bools (use
    ``"max"`` for any, ``"min"`` for all, or sum ``x.int()`` to count). ``group``
    as in :func:`gather`.

    >>> import torch, xcoll
    >>> xcoll.reduce({"loss": torch.tensor(0.5), "n": 4}, {"loss": "mean", "n": "sum"})
    {'loss': tensor(0.5000), 'n': 4}
    """

    def describe() -> list[str]:
        flat = _tree.flatten(tree)
        _check_sync(flat, sync)
        ops, _ = _reduce_ops(flat, op)
        _backends.resolve(flat, group)
        lines = _check.describe_tree(flat)
        return [
            f"sync={sync}",
            *(f"{line} op={o}" for line, o in zip(lines, ops)),
            _check.describe_structure(flat),
        ]

    with _check.outermost() as outer:
        if outer:
            _check.check("xcoll.reduce", describe, group=group)
        return _reduce(tree, op, sync, group)


def _reduce_ops(flat: _tree.Flat, op: Any) -> tuple[list[str], list[tuple[torch.dtype, str]]]:
    """Validates ``op`` for ``flat``: (op per leaf, bucket key per leaf)."""
    ops = _tree.broadcast_prefix(op, flat, "op")
    keys = []
    for i, leaf in enumerate(flat.leaves):
        dtype = _dtype(leaf)
        table = (
            _BOOL_OPS
            if dtype == torch.bool
            else _FLOAT_OPS
            if dtype.is_floating_point
            else _INT_OPS
        )
        if ops[i] not in OPS:
            raise ValueError(
                f"{flat.path(i)}: unknown op {ops[i]!r}; expected one of {', '.join(OPS)}"
            )
        if ops[i] not in table:
            raise TypeError(
                f"{flat.path(i)}: op {ops[i]!r} is not defined for {dtype}; {_REFUSED[ops[i]]}"
            )
        keys.append((dtype, table[ops[i]]))
    return ops, keys


def _reduce(tree: Any, op: Any, sync: bool, group: Any) -> Any:
    flat = _tree.flatten(tree)
    _check_sync(flat, sync)
    backend = _backends.resolve(flat, group)
    w = backend.world_size()

    def build() -> _Plan:
        ops, keys = _reduce_ops(flat, op)
        means = frozenset(i for i, o in enumerate(ops) if o == "mean")
        return _layout(flat, keys, [k[0] for k in keys], (), _leaf_shape(flat), means)

    plan = _plans.get(("reduce", op, flat.key), build)  # (a dict of ops: built per call)

    def pack(buckets: list[_pack.Bucket], parts: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        return [
            _wire.encode_reduce(backend.concat(p, b.part_shapes), b.key[1], backend.bitcast)
            for b, p in zip(buckets, parts)
        ]

    def unpack(results: list[torch.Tensor], buckets: list[_pack.Bucket]) -> list[torch.Tensor]:
        return [
            _wire.decode_reduce(r, b.key[0], b.key[1], backend.bitcast)
            for r, b in zip(results, buckets)
        ]

    out = _run(
        backend,
        flat,
        plan,
        pack,
        lambda wire, b: backend.all_reduce(wire, b.key[1]),
        unpack,
        lambda i, t: t / w,
        sync=sync,
        name="xcoll.reduce",
    )
    return _outputs(flat, out, _tree.to_python)


def _pack_moves(backend: _backends.Backend):
    """A move's ``pack``: buffers that carry their buckets bit for bit."""
    return lambda buckets, parts: backend.pack_moves(parts, [b.part_shapes for b in buckets])


def _unpack_moves(backend: _backends.Backend, world: int | None):
    """A move's ``unpack`` (``world``: a gather's)."""
    return lambda results, buckets: backend.unpack_moves(
        results, [b.dtype for b in buckets], [b.sizes for b in buckets], world
    )


def _leaf_shape(flat: _tree.Flat) -> Callable[[int], tuple[int, ...]]:
    return lambda i: tuple(flat.leaves[i].shape)


def broadcast(tree: Any, *, src: int = 0, sync: bool = True, group: Any = None) -> Any:
    """Replica ``src``'s leaves, bit for bit, on every replica.

    Values of the other replicas (NaN included) never reach the result; their
    leaves only need the same shapes and dtypes as ``src``'s. ``src`` is a rank in
    ``group`` (as in :func:`gather`).

    >>> import torch, xcoll
    >>> xcoll.broadcast({"seed": 7, "w": torch.ones(2)})
    {'seed': 7, 'w': tensor([1., 1.])}
    """

    def describe() -> list[str]:
        flat, _ = _broadcast_plan(tree, src, sync, group)
        return [f"src={src} sync={sync}", *_check.describe_tree(flat), _check.describe_structure(flat)]

    with _check.outermost() as outer:
        if outer:
            _check.check("xcoll.broadcast", describe, group=group)
        return _broadcast(tree, src, sync, group)


def _broadcast_plan(tree: Any, src: Any, sync: bool, group: Any):
    flat = _tree.flatten(tree)
    _check_sync(flat, sync)
    backend = _backends.resolve(flat, group)
    w = backend.world_size()
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < w:
        raise ValueError(f"src={src!r} is not a replica rank: world size is {w}")
    return flat, backend


def _broadcast(tree: Any, src: int, sync: bool, group: Any) -> Any:
    flat, backend = _broadcast_plan(tree, src, sync, group)

    def build() -> _Plan:
        dtypes = [_dtype(leaf) for leaf in flat.leaves]
        return _layout(flat, dtypes, dtypes, (), _leaf_shape(flat))

    plan = _plans.get(("broadcast", flat.key), build)

    out = _run(
        backend,
        flat,
        plan,
        _pack_moves(backend),
        lambda wire, b: backend.broadcast(wire, src),
        _unpack_moves(backend, None),
        sync=sync,
        name="xcoll.broadcast",
    )
    return _outputs(flat, out, _tree.to_python)


def rank(group: Any = None) -> int:
    """This replica's rank in ``[0, world_size(group))``."""
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
    elsewhere it does nothing.
    """
    _backends.current().sync()
