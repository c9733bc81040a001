"""One call of a collective: flatten once, resolve the backend once, plan
(cached), check, run, unflatten.

Each collective is a small :class:`Op` object (:class:`Gather`,
:class:`Reduce`, :class:`Broadcast`) that says how its buckets are keyed,
which collective a bucket takes and how a leaf's slice of the result becomes
the output leaf. :func:`call` is what a public function runs; :func:`run` is
what xcoll's own modules run on trees they built themselves (no check: the
public call that made them was checked).

Pipeline of :func:`execute`: pack every live bucket (one kernel call; a
reduce then encodes each bucket with a few torch ops), start one collective per
bucket, wait once, unpack (one kernel call for a move; a few torch ops per
bucket for a reduce), then cut into outputs: on the device with one kernel
call, or on the host with a torch call per run of equal shapes after one fetch
per call (``to_cpu``).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _backends, _check, _memo, _pack, _tree, _wire
from ._backends.base import TORCH, Kernels, Transport

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
class Plan:
    """How one op moves one kind of tree (built once per op parameters, world
    size and :attr:`_tree.Flat.key`, then reused; building validates the call,
    so a call that raises leaves nothing behind)."""

    buckets: list[_pack.Bucket]
    #: Per bucket: each tensor slot's output shape (before :meth:`Op.finish`),
    #: then, if it has Python scalars, the shape of their block, ``(*lead, k)``.
    shapes: list[tuple[tuple[int, ...], ...]]
    #: What the replicas must agree on (the consistency check compares it).
    description: _check.Description
    #: Gather: leaf -> the dim its replica axis moves to (:meth:`Packed.finish`
    #: runs for these leaves only).
    moved: Mapping[int, int] = field(default_factory=dict)
    #: Uneven gather: leaf -> the dim that may differ between replicas.
    growing: Mapping[int, int] = field(default_factory=dict)
    #: Reduce: per bucket, the ranges of mean elements (divided by W).
    means: tuple[tuple[tuple[int, int], ...], ...] = ()


def _layout(
    flat: _tree.Flat,
    keys: Sequence[Hashable],
    dtypes: Sequence[torch.dtype],
    lead: tuple[int, ...],
    shape,
    description: _check.Description,
    first: frozenset[int] = frozenset(),
    **extra: Any,
) -> Plan:
    buckets = _pack.plan(flat.leaves, keys, dtypes, first)
    shapes = [
        tuple(shape(s.leaf) for s in b.tensors) + ((lead + (len(b.scalars),),) if b.scalars else ())
        for b in buckets
    ]
    return Plan(buckets, shapes, description, **extra)


def _leaf_shape(flat: _tree.Flat):
    return lambda i: tuple(flat.leaves[i].shape)


_plans: _memo.Memo[Plan] = _memo.Memo()


class Op(ABC):
    """A collective call's kind: how it is described, validated and planned."""

    name: str

    def head(self, sync: bool, to_cpu: bool) -> str:
        """The call's parameters, as the consistency check compares them."""
        return f"sync={sync}"

    def validate(self, flat: _tree.Flat, transport: Transport, sync: bool, to_cpu: bool) -> None:
        """Checks of the call's arguments that are not cached with the plan."""
        if sync:
            return
        if to_cpu:
            raise ValueError("to_cpu=True needs sync=True: host values exist only after execution")
        if flat.scalars:
            raise ValueError(
                f"{flat.path(flat.scalars[0])}: a Python scalar leaf needs sync=True (its value is "
                "known only after execution); pass a tensor to trace it into the pending graph"
            )

    @abstractmethod
    def key(self, flat: _tree.Flat, world: int) -> Hashable:
        """Everything :meth:`plan` depends on (it is cached under this key)."""

    @abstractmethod
    def plan(self, flat: _tree.Flat, world: int) -> Plan:
        """Validates the call for ``flat`` and lays out its buckets."""

    @abstractmethod
    def apply(self, flat: _tree.Flat, transport: Transport, plan: Plan, sync: bool, to_cpu: bool):
        """Communicates and returns the output tree."""


class Packed(Op):
    """A collective that moves packed buckets, one collective each (:func:`execute`)."""

    def pack(self, kernels: Kernels, plan: Plan, live: list[int], parts) -> list[torch.Tensor]:
        """The wire buffer of each live bucket (indices into ``plan.buckets``)."""
        return kernels.pack(parts, [plan.buckets[k].part_shapes for k in live], encode=True)

    @abstractmethod
    def send(self, transport: Transport, wire: torch.Tensor, bucket: _pack.Bucket) -> torch.Tensor:
        """Starts the bucket's collective."""

    #: Whether the collective's result holds every replica's buffer (a gather),
    #: which unpacking makes slot-major.
    gathers = False

    def unpack(
        self, kernels: Kernels, plan: Plan, live: list[int], results, world: int, wire: bool
    ) -> list[torch.Tensor]:
        """Each result as a 1-d buffer of the bucket's dtype in which each slot's
        block is contiguous, in slot order (the Python scalars' block last).
        With ``wire``, the buffers keep the integer wire form, for
        :meth:`decode_on_host` after the download (a device's download of
        floats may change NaN payloads: torch_xla's float16 download does)."""
        buckets = [plan.buckets[k] for k in live]
        return kernels.unpack(
            results,
            [_wire.wire_dtype(b.dtype) if wire else b.dtype for b in buckets],
            [b.sizes for b in buckets],
            world if self.gathers else None,
        )

    def decode_on_host(self, plan: Plan, live: list[int], hosts) -> list[torch.Tensor]:
        """:meth:`unpack`'s ``wire`` buffers, downloaded, as the buckets' dtypes."""
        return [
            _wire.decode_move(h, plan.buckets[k].dtype, TORCH.bitcast)
            for h, k in zip(hosts, live, strict=True)
        ]

    def finish(self, plan: Plan, i: int, t: torch.Tensor, world: int) -> torch.Tensor:
        """Leaf ``i``'s piece, for the leaves in ``plan.moved``."""
        return t

    def scalar(self, block: torch.Tensor, like: Any) -> Any:
        """A Python scalar leaf's output from its slice of the scalar block."""
        return _tree.to_python(block, like)

    def apply(self, flat, transport, plan, sync, to_cpu):
        return execute(self, flat, transport, plan, sync=sync, to_cpu=to_cpu)


@dataclass(frozen=True)
class Gather(Packed):
    dim: int = 0
    stack: bool = False
    name = "xcoll.gather"
    gathers = True

    def head(self, sync, to_cpu):
        return (
            f"dim={self.dim} stack={self.stack} uneven=False max_size=None "
            f"to_cpu={to_cpu} sync={sync}"
        )

    def validate(self, flat, transport, sync, to_cpu):
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(f"dim must be an int, got {self.dim!r}")
        super().validate(flat, transport, sync, to_cpu)

    def key(self, flat, world):
        return ("gather", self.dim, self.stack, world, flat.key)

    def plan(self, flat, world):
        dims = {
            i: self._dim(flat, i)
            for i, leaf in enumerate(flat.leaves)
            if isinstance(leaf, torch.Tensor)
        }

        def shape(i: int) -> tuple[int, ...]:
            leaf_shape = tuple(flat.leaves[i].shape)
            if dims[i] == 0 and not self.stack and leaf_shape:  # concatenated along dim 0
                return (world * leaf_shape[0], *leaf_shape[1:])
            return (world, *leaf_shape)  # stacked, or moved into place by finish

        dtypes = [_tree.dtype_of(leaf) for leaf in flat.leaves]
        moved = {i: d for i, d in dims.items() if d}
        return _layout(flat, dtypes, dtypes, (world,), shape, _check.describe(flat), moved=moved)

    def _dim(self, flat: _tree.Flat, i: int) -> int:
        ndim = flat.leaves[i].dim()
        if ndim == 0:
            return 0
        n = ndim + 1 if self.stack else ndim
        if not -n <= self.dim < n:
            raise ValueError(
                f"{flat.path(i)}: dim={self.dim} is out of range for a leaf of shape "
                f"{tuple(flat.leaves[i].shape)}"
            )
        return self.dim % n

    def send(self, transport, wire, bucket):
        return transport.all_gather(wire)

    def finish(self, plan, i, t, world):  # (W, *shape) -> (*shape[:d], W, *shape[d:])
        d = plan.moved[i]
        t = t.movedim(0, d)
        if self.stack:
            return t
        pre = t.shape
        return t.reshape(*pre[:d], world * pre[d + 1], *pre[d + 2 :])

    def scalar(self, block, like):
        return [_tree.to_python(v, like) for v in block]


@dataclass(frozen=True)
class Reduce(Packed):
    op: Any = "sum"
    name = "xcoll.reduce"

    def key(self, flat, world):
        return ("reduce", _tree.prefix_key(self.op), world, flat.key)

    def plan(self, flat, world):
        ops = _tree.broadcast_prefix(self.op, flat, "op")
        keys = []
        for i, leaf in enumerate(flat.leaves):
            dtype = _tree.dtype_of(leaf)
            table = (
                _BOOL_OPS
                if dtype == torch.bool
                else _FLOAT_OPS
                if dtype.is_floating_point
                else _INT_OPS
            )
            if not isinstance(ops[i], str) or ops[i] not in OPS:
                raise ValueError(
                    f"{flat.path(i)}: unknown op {ops[i]!r}; expected one of {', '.join(OPS)}"
                )
            if ops[i] not in table:
                raise TypeError(
                    f"{flat.path(i)}: op {ops[i]!r} is not defined for {dtype}; {_REFUSED[ops[i]]}"
                )
            keys.append((dtype, table[ops[i]]))
        means = frozenset(i for i, o in enumerate(ops) if o == "mean")
        plan = _layout(
            flat,
            keys,
            [k[0] for k in keys],
            (),
            _leaf_shape(flat),
            _check.describe(flat, ops=ops),
            first=means,
        )
        return dataclasses.replace(plan, means=tuple(_ranges(b, means) for b in plan.buckets))

    def pack(self, kernels, plan, live, parts):
        joined = kernels.pack(parts, [plan.buckets[k].part_shapes for k in live], encode=False)
        return kernels.encode_reduce(joined, [plan.buckets[k].key[1] for k in live])

    def send(self, transport, wire, bucket):
        return transport.all_reduce(wire, bucket.key[1])

    def unpack(self, kernels, plan, live, results, world, wire):
        # (NaN results are the quiet NaN, which every download keeps)
        buckets = [plan.buckets[k] for k in live]
        return kernels.decode_reduce(
            results,
            [b.dtype for b in buckets],
            [b.key[1] for b in buckets],
            [plan.means[k] for k in live],
            world,
        )

    def decode_on_host(self, plan, live, hosts):
        return hosts


def _ranges(bucket: _pack.Bucket, leaves: frozenset[int]) -> tuple[tuple[int, int], ...]:
    """The element ranges of ``leaves``' slots in ``bucket``, adjacent ones merged."""
    out: list[tuple[int, int]] = []
    for s in bucket.tensors + bucket.scalars:
        if s.leaf in leaves:
            if out and out[-1][1] == s.offset:
                out[-1] = (out[-1][0], s.offset + s.numel)
            else:
                out.append((s.offset, s.offset + s.numel))
    return tuple(out)


@dataclass(frozen=True)
class Broadcast(Packed):
    src: int = 0
    name = "xcoll.broadcast"

    def head(self, sync, to_cpu):
        return f"src={self.src} sync={sync}"

    def validate(self, flat, transport, sync, to_cpu):
        super().validate(flat, transport, sync, to_cpu)
        w = transport.world_size()
        if isinstance(self.src, bool) or not isinstance(self.src, int) or not 0 <= self.src < w:
            raise ValueError(f"src={self.src!r} is not a replica rank: world size is {w}")

    def key(self, flat, world):
        return ("broadcast", flat.key)

    def plan(self, flat, world):
        dtypes = [_tree.dtype_of(leaf) for leaf in flat.leaves]
        return _layout(flat, dtypes, dtypes, (), _leaf_shape(flat), _check.describe(flat))

    def send(self, transport, wire, bucket):
        return transport.broadcast(wire, self.src)


def _prepare(op: Op, flat: _tree.Flat, transport: Transport, sync: bool, to_cpu: bool) -> Plan:
    op.validate(flat, transport, sync, to_cpu)
    w = transport.world_size()
    return _plans.get(op.key(flat, w), lambda: op.plan(flat, w))


def call(op: Op, tree: Any, group: Any, *, sync: bool = True, to_cpu: bool = False) -> Any:
    """A public call: ``tree`` flattened once, its backend resolved once, the
    plan taken from the cache (or built, which validates), the consistency
    check when due (a local error is shared with every replica), then run."""
    flat = transport = plan = error = None
    try:
        flat = _tree.flatten(tree)
        transport = _backends.resolve(flat, group)
        plan = _prepare(op, flat, transport, sync, to_cpu)
    except (TypeError, ValueError) as e:
        error = e
    if transport is None:  # the call's own error is the one to report
        try:
            transport = _backends.current(group)
        except RuntimeError:
            if error is None:
                raise
            raise error from None
    if _check.due(transport):
        _check.verify(
            transport,
            op.name,
            op.head(sync, to_cpu),
            None if plan is None else plan.description,
            error,
        )
    if error is not None:
        raise error
    return op.apply(flat, transport, plan, sync, to_cpu)


def run(op: Packed, tree: Any, transport: Transport, *, to_cpu: bool = False) -> Any:
    """``op`` on a tree that xcoll built itself, on ``transport``, synchronously."""
    flat = _tree.flatten(tree)
    transport.validate(flat)
    return execute(op, flat, transport, _prepare(op, flat, transport, True, to_cpu), to_cpu=to_cpu)


def execute(
    op: Packed,
    flat: _tree.Flat,
    transport: Transport,
    plan: Plan,
    *,
    sync: bool = True,
    to_cpu: bool = False,
) -> Any:
    """Runs one collective per bucket and returns the output tree.

    Outputs never require grad (collectives are not differentiated) and never
    alias the inputs. Python scalar leaves come back as Python values.
    """
    with torch.no_grad():
        out = _leaves_out(op, flat, transport, plan, sync, to_cpu)
    for i in flat.scalars:
        out[i] = op.scalar(out[i], flat.leaves[i])
    return flat.unflatten(out)


def _place(op: Packed, plan: Plan, bucket: _pack.Bucket, pieces, out: list[Any], w: int) -> None:
    """Each tensor slot's output from its piece (the scalar block, last, is extra)."""
    for s, t in zip(bucket.tensors, pieces, strict=False):
        out[s.leaf] = op.finish(plan, s.leaf, t, w) if s.leaf in plan.moved else t


def _leaves_out(op, flat, transport, plan, sync, to_cpu) -> list[Any]:
    """The output leaves, in leaf order (Python scalars as 0-d CPU tensors)."""
    w = transport.world_size()
    out: list[Any] = [None] * len(flat.leaves)
    live: list[int] = []
    for k, (b, shapes) in enumerate(zip(plan.buckets, plan.shapes, strict=True)):
        if b.size:
            live.append(k)
            continue
        for s, shape in zip(b.tensors, shapes, strict=True):  # only empty tensors: nothing to send
            device = "cpu" if to_cpu else flat.leaves[s.leaf].device
            t = torch.empty(shape, dtype=b.dtype, device=device)
            out[s.leaf] = op.finish(plan, s.leaf, t, w) if s.leaf in plan.moved else t
    if not live:
        return out
    buckets = [plan.buckets[k] for k in live]
    shapes = [plan.shapes[k] for k in live]
    leaves = transport.own_buffers(flat)
    parts = [_pack.parts(b, leaves, transport.upload) for b in buckets]
    del leaves
    wires = op.pack(transport.kernels, plan, live, parts)
    del parts
    results = [op.send(transport, wire, b) for wire, b in zip(wires, buckets, strict=True)]
    del wires
    try:
        transport.wait()  # eager engines started every collective asynchronously
    except RuntimeError as e:  # e.g. gloo's timeout when a replica never arrives
        raise RuntimeError(
            f"{op.name}: a collective did not complete on rank {transport.rank()}: {e}"
        ) from e
    flats = op.unpack(transport.kernels, plan, live, results, w, wire=to_cpu)
    del results
    if to_cpu:
        transport.sync()
        pieces = TORCH.split(op.decode_on_host(plan, live, transport.to_host(flats)), shapes)
    else:
        # Outputs are traced before the sync so that it materialises them; only
        # they and the scalar blocks stay referenced, so they alone become graph
        # outputs.
        pieces = transport.kernels.split(flats, shapes)
    del flats
    # Only the outputs and the scalar blocks may stay referenced at the sync: a
    # piece that was finished (moved) would become a graph output of its own.
    blocks = [
        bucket_pieces[-1] for b, bucket_pieces in zip(buckets, pieces, strict=True) if b.scalars
    ]
    for b, bucket_pieces in zip(buckets, pieces, strict=True):
        _place(op, plan, b, bucket_pieces, out, w)
    del pieces, bucket_pieces
    if not to_cpu:
        if sync:
            transport.sync()
        if blocks:
            blocks = transport.to_host(blocks)
    scalar_buckets = [b for b in buckets if b.scalars]
    for b, block in zip(scalar_buckets, blocks, strict=True):
        for j, s in enumerate(b.scalars):
            out[s.leaf] = block[..., j]
    return out
