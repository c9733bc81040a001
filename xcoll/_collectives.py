"""gather, reduce and broadcast: flatten -> bucket -> pack -> one collective per
bucket -> one sync -> unpack.

Each public function only says how its buckets are keyed, which collective a
bucket takes, and how a leaf's slice of the result becomes the output leaf; the
pipeline in :func:`_run` is shared.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import _backends, _check, _pack, _tree, _wire

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


def _dtype(leaf: Any) -> torch.dtype:
    return leaf.dtype if isinstance(leaf, torch.Tensor) else _tree.scalar_dtype(leaf)


def _check_sync(flat: _tree.Flat, sync: bool, to_cpu: bool = False) -> None:
    if sync:
        return
    if to_cpu:
        raise ValueError("to_cpu=True needs sync=True: host values exist only after execution")
    for i, leaf in enumerate(flat.leaves):
        if not isinstance(leaf, torch.Tensor):
            raise ValueError(
                f"{flat.path(i)}: a Python scalar leaf needs sync=True (its value is known "
                "only after execution); pass a tensor to trace it into the pending graph"
            )


def _run(
    backend: _backends.Backend,
    flat: _tree.Flat,
    buckets: list[_pack.Bucket],
    lead: tuple[int, ...],
    send: Callable[[torch.Tensor, _pack.Bucket], torch.Tensor],
    receive: Callable[[torch.Tensor, _pack.Bucket], torch.Tensor],
    shape: Callable[[int], tuple[int, ...]],
    finish: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    *,
    sync: bool,
    to_cpu: bool = False,
    name: str,
) -> list[Any]:
    """Runs one collective per bucket and returns one output per leaf.

    ``send`` starts a bucket's collective on its packed ``(size,)`` buffer and
    returns the backend's result tensor; after every collective of the call has
    been started and ``backend.wait()`` has returned, ``receive`` turns it into the
    bucket's ``(*lead, size)`` result. Tensor leaf ``i``'s ``(*lead, *leaf.shape)``
    block of it comes out reshaped to ``shape(i)``, then passed through
    ``finish(i, t)`` if given. Python scalar leaves come back as CPU tensors of
    shape ``lead``, through ``finish`` too.
    """
    finish = finish or (lambda i, t: t)
    out: list[Any] = [None] * len(flat.leaves)
    results = []
    for b in buckets:
        if b.size == 0:  # only empty tensors: nothing to send
            for s in b.tensors:
                device = "cpu" if to_cpu else flat.leaves[s.leaf].device
                out[s.leaf] = finish(s.leaf, torch.empty(shape(s.leaf), dtype=b.dtype, device=device))
            continue
        results.append((b, send(_pack.pack(b, flat.leaves, backend.upload, backend.concat), b)))
    try:
        backend.wait()  # eager backends started every collective asynchronously
    except RuntimeError as e:  # e.g. gloo's timeout when a replica never arrives
        raise RuntimeError(
            f"{name}: a collective did not complete on rank {backend.rank()}: {e}"
        ) from e

    pieces = [_slot_major(backend, b, receive(r, b), lead, shape) for b, r in results]
    del results
    if to_cpu:
        backend.sync()
        host = backend.to_host([r for _, r, _ in pieces])
        scalar_blocks = [
            _split(_pack.split, b, r, shapes, out, finish) for (b, _, shapes), r in zip(pieces, host)
        ]
    else:
        # Outputs are traced before the sync so that it materialises them; only
        # they and the scalar blocks stay referenced, so they alone become graph
        # outputs.
        blocks = [_split(backend.split, b, r, shapes, out, finish) for b, r, shapes in pieces]
        blocks = [(b, block) for b, block in blocks if b.scalars]
        del pieces
        if sync:
            backend.sync()
        host = backend.to_host([block for _, block in blocks]) if blocks else []
        scalar_blocks = [(b, block) for (b, _), block in zip(blocks, host)]
    for b, block in scalar_blocks:
        for j, s in enumerate(b.scalars):
            out[s.leaf] = finish(s.leaf, block[..., j])
    return out


def _slot_major(backend, b: _pack.Bucket, r: torch.Tensor, lead, shape):
    """The bucket's ``(*lead, size)`` result as one 1-d buffer in which every
    slot's ``(*lead, *shape)`` block is contiguous, and the shapes to split it
    into: each tensor leaf's ``shape(i)``, then the Python scalars' ``(*lead, k)``."""
    if lead:
        r = backend.slot_major(r, [s.numel for s in b.tensors] + [len(b.scalars)])
    return b, r, [shape(s.leaf) for s in b.tensors] + [lead + (len(b.scalars),)]


def _split(split, b: _pack.Bucket, r, shapes, out: list, finish):
    """Fills ``out`` with the bucket's tensor leaves; returns its scalar block."""
    *tensors, scalars = split(r, shapes)
    for s, t in zip(b.tensors, tensors):
        out[s.leaf] = finish(s.leaf, t)
    return b, scalars


def _outputs(flat: _tree.Flat, out: list[Any], scalar: Callable[[torch.Tensor, Any], Any]) -> Any:
    """The output tree: tensors as they are, Python scalars back to Python values."""
    return flat.unflatten(
        [
            o if isinstance(leaf, torch.Tensor) else scalar(o, leaf)
            for leaf, o in zip(flat.leaves, out)
        ]
    )


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
        # only the growing dim may differ between replicas
        dims = {
            i: dim % max(leaf.dim(), 1)
            for i, leaf in enumerate(flat.leaves)
            if isinstance(leaf, torch.Tensor)
        }
        return [*_check.describe_tree(flat, dims), str(flat.treespec)]
    for i, leaf in enumerate(flat.leaves):
        if isinstance(leaf, torch.Tensor):
            _gather_dim(flat, i, dim, stack)
    return [*_check.describe_tree(flat), str(flat.treespec)]


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
    dims = {
        i: _gather_dim(flat, i, dim, stack)
        for i, leaf in enumerate(flat.leaves)
        if isinstance(leaf, torch.Tensor)
    }
    backend = _backends.resolve(flat, group)
    w = backend.world_size()
    dtypes = [_dtype(leaf) for leaf in flat.leaves]
    buckets = _pack.plan(flat.leaves, dtypes, dtypes)

    def send(buf: torch.Tensor, b: _pack.Bucket) -> torch.Tensor:
        return backend.all_gather(_wire.encode_move(buf, backend.bitcast))

    def receive(gathered: torch.Tensor, b: _pack.Bucket) -> torch.Tensor:
        return _wire.decode_move(gathered, b.dtype, backend.bitcast).view(w, b.size)

    def shape(i: int) -> tuple[int, ...]:
        leaf_shape = tuple(flat.leaves[i].shape)
        if dims[i] == 0 and not stack and leaf_shape:  # concatenated along dim 0
            return (w * leaf_shape[0], *leaf_shape[1:])
        return (w, *leaf_shape)

    def finish(i: int, t: torch.Tensor) -> torch.Tensor:  # t: shape(i)
        d = dims.get(i, 0)
        if not d:
            return t
        t = t.movedim(0, d)  # (W, *shape) -> (*shape[:d], W, *shape[d:])
        if stack:
            return t
        pre = t.shape
        return t.reshape(*pre[:d], w * pre[d + 1], *pre[d + 2 :])

    out = _run(
        backend,
        flat,
        buckets,
        (w,),
        send,
        receive,
        shape,
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
        flat, ops, _, _ = _reduce_plan(tree, op, sync, group)
        lines = _check.describe_tree(flat)
        return [
            f"sync={sync}",
            *(f"{line} op={o}" for line, o in zip(lines, ops)),
            str(flat.treespec),
        ]

    with _check.outermost() as outer:
        if outer:
            _check.check("xcoll.reduce", describe, group=group)
        return _reduce(tree, op, sync, group)


def _reduce_plan(tree: Any, op: Any, sync: bool, group: Any):
    """Validates a reduce: (flat, op per leaf, bucket key per leaf, backend)."""
    flat = _tree.flatten(tree)
    _check_sync(flat, sync)
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
    return flat, ops, keys, _backends.resolve(flat, group)


def _reduce(tree: Any, op: Any, sync: bool, group: Any) -> Any:
    flat, ops, keys, backend = _reduce_plan(tree, op, sync, group)
    w = backend.world_size()
    buckets = _pack.plan(flat.leaves, keys, [k[0] for k in keys])

    def send(buf: torch.Tensor, b: _pack.Bucket) -> torch.Tensor:
        return backend.all_reduce(_wire.encode_reduce(buf, b.key[1], backend.bitcast), b.key[1])

    def receive(reduced: torch.Tensor, b: _pack.Bucket) -> torch.Tensor:
        return _wire.decode_reduce(reduced, b.key[0], b.key[1], backend.bitcast)

    def finish(i: int, t: torch.Tensor) -> torch.Tensor:
        return t / w if ops[i] == "mean" else t

    out = _run(
        backend,
        flat,
        buckets,
        (),
        send,
        receive,
        lambda i: tuple(flat.leaves[i].shape),
        finish,
        sync=sync,
        name="xcoll.reduce",
    )
    return _outputs(flat, out, _tree.to_python)


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
        return [f"src={src} sync={sync}", *_check.describe_tree(flat), str(flat.treespec)]

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
    dtypes = [_dtype(leaf) for leaf in flat.leaves]
    buckets = _pack.plan(flat.leaves, dtypes, dtypes)

    def send(buf: torch.Tensor, b: _pack.Bucket) -> torch.Tensor:
        return backend.broadcast(_wire.encode_move(buf, backend.bitcast), src)

    def receive(wire: torch.Tensor, b: _pack.Bucket) -> torch.Tensor:
        return _wire.decode_move(wire, b.dtype, backend.bitcast)

    out = _run(
        backend,
        flat,
        buckets,
        (),
        send,
        receive,
        lambda i: tuple(flat.leaves[i].shape),
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
