"""One call of a collective: flatten once, resolve the backend once, plan
(cached), check, run, unflatten.

Each collective is a small :class:`Op` object (:class:`Gather`,
:class:`Reduce`, :class:`Broadcast`) that says how its buckets are keyed,
which collective a bucket takes and how a leaf's slice of the result becomes
the output leaf. :func:`call` is what a public function runs; :func:`run` is
what xcoll's own modules run on trees they built themselves (no check: the
public call that made them was checked).

Pipeline of :func:`execute`: a move (gather, broadcast) joins every live
bucket's bytes into one buffer (one kernel call) and makes one collective; a
reduce packs each bucket (one kernel call), encodes it in place and makes one
collective per bucket. Then one wait, the buffers cut back into buckets (one
kernel call), and into outputs: on the device with one kernel call, or on the
host with a torch call per run of equal shapes after one fetch per call
(``to_cpu``).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from . import _backends, _check, _guard, _memo, _pack, _tree, _wire
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


def _reduce_op(bucket: _pack.Bucket) -> str:
    """A reduce's bucket's op: its key is ``(dtype, op)``."""
    return cast(tuple[Any, str], bucket.key)[1]


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
    #: Reduce: per bucket, the ranges of mean elements (divided by W).
    means: tuple[tuple[tuple[int, int], ...], ...] = ()
    _layouts: dict = field(default_factory=dict, compare=False, repr=False)

    def layout(self, guard: int, gathered: int | None, joined: bool, alone: int) -> Layout:
        """The buckets' layout with a guard header of ``guard`` elements
        (``gathered``: W for a gather, whose header comes back as ``(W,
        guard)``): with ``joined``, a move's, whose buckets travel as one
        buffer after the header, except a bucket of one tensor of ``alone``
        bytes or more (0: none), which travels alone; otherwise at the front
        of bucket 0. (Keyed by the threshold itself, so that a layout never
        outlives the threshold it was made with.)"""
        key = (guard, gathered, joined, alone)
        if key not in self._layouts:
            self._layouts[key] = Layout.of(self, guard, gathered, joined, alone)
        return self._layouts[key]


#: Bytes from which a move's bucket of one tensor travels as itself, in a
#: collective of its own, on an eager engine: copying it into the joined
#: buffer would cost more than a collective (a 16 MiB copy takes a few ms on
#: 2 cores, as gloo's collective does) and as much memory again as the leaf.
ALONE = 1 << 24


@dataclass(frozen=True)
class Layout:
    """Per bucket: its parts' shapes, slot sizes, pieces' shapes and mean
    ranges, with the guard header (if any) as bucket 0's first slot unless
    the buckets are :attr:`joined`."""

    part_shapes: list[tuple[tuple[int, ...], ...]]
    sizes: list[list[int]]
    shapes: list[tuple[tuple[int, ...], ...]]
    means: list[tuple[tuple[int, int], ...]]
    #: Per bucket, what each piece is cast to (:attr:`_pack.Bucket.casts`,
    #: None for the header).
    casts: list[tuple[torch.dtype | None, ...]]
    #: The buckets that travel: those with elements, and bucket 0 when it
    #: carries the header.
    live: list[int]
    #: A move's live buckets as one buffer, the header first, except those
    #: :attr:`alone`; None for a reduce, and for a move with nothing to join.
    joined: _pack.Joined | None
    #: The header's piece's shape, if any.
    header_shape: tuple[int, ...] | None
    #: Positions in :attr:`live` of a move's buckets that travel as themselves.
    alone: tuple[int, ...] = ()

    @staticmethod
    def of(plan: Plan, guard: int, gathered: int | None, joined: bool, alone: int) -> Layout:
        b = plan.buckets
        part_shapes = [x.part_shapes for x in b]
        sizes = [x.sizes for x in b]
        shapes = list(plan.shapes)
        casts = [x.casts for x in b]
        means: list[tuple[tuple[int, int], ...]] = list(plan.means) or [() for _ in b]
        header_shape = ((gathered, guard) if gathered else (guard,)) if guard else None
        live = [k for k, x in enumerate(b) if x.size or (guard and k == 0 and not joined)]
        if joined:
            apart = tuple(
                j
                for j, k in enumerate(live)
                if alone
                and not b[k].scalars
                and len(b[k].tensors) == 1
                and b[k].size * b[k].dtype.itemsize >= alone
            )
            rest = [j for j in range(len(live)) if j not in apart]
            join = (
                _pack.Joined.of(
                    [b[live[j]].dtype for j in rest],
                    [part_shapes[live[j]] for j in rest],
                    guard,
                    rest,
                )
                if rest or guard
                else None
            )
            return Layout(
                part_shapes, sizes, shapes, means, casts, live, join, header_shape, apart
            )
        if guard:
            assert header_shape is not None
            part_shapes[0] = ((guard,), *part_shapes[0])
            sizes[0] = [guard, *sizes[0]]
            shapes[0] = (header_shape, *shapes[0])
            casts[0] = (None, *casts[0])
            means[0] = tuple((a + guard, z + guard) for a, z in means[0])
        return Layout(part_shapes, sizes, shapes, means, casts, live, None, header_shape)


def _layout(
    flat: _tree.Flat,
    keys: Sequence[Hashable],
    dtypes: Sequence[torch.dtype],
    lead: tuple[int, ...],
    shape,
    description: _check.Description,
    first: frozenset[int] = frozenset(),
    empty: Hashable = torch.uint8,
    **extra: Any,
) -> Plan:
    # At least one bucket, whose collective carries the guard even for a tree
    # with no leaves to send (``empty``: its key, for a uint8 bucket).
    buckets = _pack.plan(flat.leaves, keys, dtypes, first) or [_pack.Bucket(empty, torch.uint8)]
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
    def apply(
        self,
        flat: _tree.Flat,
        transport: Transport,
        plan: Plan,
        sync: bool,
        to_cpu: bool,
        signature: _guard.Signature | None,
    ):
        """Communicates and returns the output tree, guarded as ``signature``."""


class Packed(Op):
    """A collective that moves packed buckets, one collective each (:func:`execute`)."""

    #: The guard header's kind (:func:`xcoll._guard.header`).
    kind: str

    @abstractmethod
    def send(
        self, transport: Transport, wire: torch.Tensor, bucket: _pack.Bucket, guard: int
    ) -> torch.Tensor:
        """Starts the bucket's collective (``guard``: the length of the header
        at its front, which every replica's collective must reach whole)."""

    def how(self, bucket: _pack.Bucket, transport: Transport) -> str:
        """How the guard header of ``bucket`` is combined (:func:`xcoll._guard.agrees`)."""
        return ""

    #: Whether the collective's result holds every replica's buffer (a gather),
    #: which unpacking makes slot-major.
    gathers = False
    #: Whether every bucket travels in one buffer, as bytes (a move: the
    #: bytes arrive unchanged, whatever their dtype); a reduce's buckets each
    #: take the collective of their dtype and op.
    joined = True

    def finish(self, plan: Plan, i: int, t: torch.Tensor, world: int) -> torch.Tensor:
        """Leaf ``i``'s piece, for the leaves in ``plan.moved``."""
        return t

    def alone(self, transport: Transport, leaf: torch.Tensor) -> torch.Tensor:
        """The wire of a move's bucket that travels alone (:data:`ALONE`): the
        collective only reads it."""
        return _wire.encode_move(leaf.contiguous().reshape(-1), TORCH.bitcast)

    def scalar(self, block: torch.Tensor, like: Any) -> Any:
        """A Python scalar leaf's output from its slice of the scalar block."""
        return _tree.to_python(block, like)

    def apply(self, flat, transport, plan, sync, to_cpu, signature):
        return execute(
            self, flat, transport, plan, sync=sync, to_cpu=to_cpu, signature=signature
        )


@dataclass(frozen=True)
class Gather(Packed):
    dim: int = 0
    stack: bool = False
    name = "xcoll.gather"
    kind = "gather"
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

    def send(self, transport, wire, bucket, guard):
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
    kind = "reduce"
    joined = False

    def key(self, flat, world):
        # (WIDEN is read by the plan: a plan never outlives the value it was made with)
        return ("reduce", _tree.prefix_key(self.op), world, WIDEN, flat.key)

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
        keys = merged(flat, keys)
        means = frozenset(i for i, o in enumerate(ops) if o == "mean")
        plan = _layout(
            flat,
            keys,
            [k[0] for k in keys],
            (),
            _leaf_shape(flat),
            _check.describe(flat, ops=ops),
            first=means,
            empty=(torch.uint8, "max"),
        )
        return dataclasses.replace(plan, means=tuple(_ranges(b, means) for b in plan.buckets))

    def pack(
        self, kernels: Kernels, plan: Plan, lay: Layout, live: list[int], parts
    ) -> list[torch.Tensor]:
        """The wire buffer of each live bucket (indices into ``plan.buckets``)."""
        shapes = [lay.part_shapes[k] for k in live]
        joined = kernels.pack(parts, shapes, [plan.buckets[k].dtype for k in live])
        return kernels.encode_reduce(joined, [_reduce_op(plan.buckets[k]) for k in live])

    def send(self, transport, wire, bucket, guard):
        return transport.all_reduce(wire, _reduce_op(bucket))

    def how(self, bucket, transport):
        return _reduce_op(bucket)

    def unpack(
        self, kernels: Kernels, plan: Plan, lay: Layout, live: list[int], results, world: int
    ) -> list[torch.Tensor]:
        """Each result decoded, as a 1-d buffer of its bucket's dtype (NaN
        results are the quiet NaN, which every download keeps)."""
        buckets = [plan.buckets[k] for k in live]
        return kernels.decode_reduce(
            results,
            [b.dtype for b in buckets],
            [_reduce_op(b) for b in buckets],
            [lay.means[k] for k in live],
            world,
        )


#: Bytes up to which a narrower integer dtype's leaves, widened, join a
#: wider integer bucket of the same op (:func:`merged`): a collective saved
#: (3 ms on gloo at W=4 on 2 cores) is worth more than copying that much.
WIDEN = 1 << 20


def merged(flat: _tree.Flat, keys: list[tuple[torch.dtype, str]]) -> list[tuple[torch.dtype, str]]:
    """A reduce's bucket keys ``(dtype, collective op)``, with buckets merged
    where every result stays bit for bit the same, into one collective:

    * half-precision sums and products (means included) with float32's of
      the same op, or with each other as float32: each accumulates in float32
      anyway and is rounded back once (``_wire.ACCUMULATE``);
    * an integer or bool bucket with the widest integer bucket of the same op
      that holds all its values (a bool in any, uint8 in int16 and wider), up
      to :data:`WIDEN` bytes widened: sums and products wrap modulo 2**bits,
      which the cast back keeps, and max and min compare the same values.

    Float max and min (ordered keys of each width) and float64 keep their own.

    >>> flat = _tree.flatten([torch.ones(2, dtype=torch.float16), torch.ones(3), 1, True])
    >>> merged(flat, [(torch.float16, "sum"), (torch.float32, "sum"), (torch.int64, "max"), (torch.bool, "max")])
    [(torch.float32, 'sum'), (torch.float32, 'sum'), (torch.int64, 'max'), (torch.int64, 'max')]
    """
    counts: dict[str, dict[torch.dtype, int]] = {}  # op -> dtype -> elements
    for leaf, (dtype, op) in zip(flat.leaves, keys, strict=True):
        n = leaf.numel() if isinstance(leaf, torch.Tensor) else 1
        counts.setdefault(op, {})[dtype] = counts.get(op, {}).get(dtype, 0) + n
    into: dict[tuple[torch.dtype, str], tuple[torch.dtype, str]] = {}
    for op, by_dtype in counts.items():
        halves = [d for d in by_dtype if d in (torch.float16, torch.bfloat16, torch.float32)]
        if op in ("sum", "prod") and len(halves) > 1:
            into.update({(d, op): (torch.float32, op) for d in halves})
        ints = [d for d in by_dtype if d in _wire.INTS]
        if len(ints) > 1:
            wide = max(ints, key=_wire.INTS.index)
            for d in ints:
                if _holds(wide, d) and by_dtype[d] * wide.itemsize <= WIDEN:
                    into[d, op] = (wide, op)
    return [into.get(k, k) for k in keys]


def _holds(wide: torch.dtype, d: torch.dtype) -> bool:
    """Whether every value of integer dtype ``d`` is one of ``wide``'s."""
    if d in (torch.bool, wide):
        return True
    if wide in (torch.bool, torch.uint8):
        return False
    return d.itemsize < wide.itemsize or (d != torch.uint8 and d.itemsize == wide.itemsize)


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
    kind = "broadcast"

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

    def send(self, transport, wire, bucket, guard):
        return transport.broadcast(wire, self.src, guard)

    def alone(self, transport, leaf):
        # written in place: src's own copy (its output must not alias its
        # input), a receiver's empty buffer
        if transport.rank() == self.src:
            own = leaf.clone(memory_format=torch.contiguous_format)
        else:
            own = torch.empty(leaf.shape, dtype=leaf.dtype, device=leaf.device)
        return _wire.encode_move(own.reshape(-1), TORCH.bitcast)  # (a view: contiguous)

    def how(self, bucket, transport):
        return "sum" if transport.broadcast_sums else ""


def _prepare(op: Op, flat: _tree.Flat, transport: Transport, sync: bool, to_cpu: bool) -> Plan:
    op.validate(flat, transport, sync, to_cpu)
    w = transport.world_size()
    return _plans.get(op.key(flat, w), lambda: op.plan(flat, w))


def call(
    op: Op, tree: Any, group: Any, *, sync: bool = True, to_cpu: bool = False, tag: Any = None
) -> Any:
    """A public call: ``tree`` flattened once, its backend resolved once, the
    plan taken from the cache (or built, which validates), the consistency
    check when due (a local error is shared with every replica), then run
    with the guard (``_guard``) unless the mode is "never". ``tag``: the
    call's own step tag (:mod:`xcoll._steps`)."""
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
    # A lazy engine's results exist only after the caller's own sync: the
    # guard cannot be read in time, so such a call is checked in full first.
    head = op.head(sync, to_cpu)
    description = None if plan is None else plan.description
    unread = transport.lazy and not sync
    try:
        with _guard.entered(
            transport, op.name, head, description, error, unread=unread, tag=tag
        ) as sig:
            assert flat is not None and plan is not None  # (else entered raised the error)
            return op.apply(flat, transport, plan, sync, to_cpu, sig)
    finally:
        # An error raised here has this frame in its traceback: cleared, the
        # frame no longer holds the error (a cycle that only a later garbage
        # collection would free), so the tree's tensors go with the exception.
        # An XLA tensor kept alive on one replica joins its next graph, and the
        # replicas' programs differ (seen: XLA's abort after a caught error).
        error = flat = tree = plan = None  # noqa: F841


def run(
    op: Packed,
    tree: Any,
    transport: Transport,
    *,
    to_cpu: bool = False,
    signature: _guard.Signature | None = None,
) -> Any:
    """``op`` on a tree that xcoll built itself, on ``transport``, synchronously
    (guarded as ``signature``, the public call's, if given)."""
    flat = _tree.flatten(tree)
    transport.validate(flat)
    plan = _prepare(op, flat, transport, True, to_cpu)
    return execute(op, flat, transport, plan, to_cpu=to_cpu, signature=signature)


def execute(
    op: Packed,
    flat: _tree.Flat,
    transport: Transport,
    plan: Plan,
    *,
    sync: bool = True,
    to_cpu: bool = False,
    signature: _guard.Signature | None = None,
) -> Any:
    """Runs one collective per bucket and returns the output tree; with
    ``signature``, the first carries the guard, checked before anything returns.

    Outputs never require grad (collectives are not differentiated) and never
    alias the inputs. Python scalar leaves come back as Python values.
    """
    try:
        with torch.no_grad():
            out = _leaves_out(op, flat, transport, plan, sync, to_cpu, signature)
    except _check.CollectiveMismatchError as e:
        received = getattr(e, "received", None)
        if received is not None:  # a receiver's one-sided verdict: what src sent
            e.received = _tree_out(op, flat, received)  # type: ignore[attr-defined]
        raise
    return _tree_out(op, flat, out)


def _tree_out(op: Packed, flat: _tree.Flat, out: list[Any]) -> Any:
    for i in flat.scalars:
        out[i] = op.scalar(out[i], flat.leaves[i])
    return flat.unflatten(out)


def _place(op: Packed, plan: Plan, bucket: _pack.Bucket, pieces, out: list[Any], w: int) -> None:
    """Each tensor slot's output from its piece (the scalar block, last, is extra)."""
    for s, t in zip(bucket.tensors, pieces, strict=False):
        out[s.leaf] = op.finish(plan, s.leaf, t, w) if s.leaf in plan.moved else t


def _unjoin(kernels: Kernels, lay: Layout, buckets, results, gathered: int | None, wire: bool):
    """A move's header piece (or None) and each live bucket's 1-d buffer (in
    the integer ``wire`` form, or decoded), from its collectives' ``results``:
    the joined buffer's first, if any, then those of the buckets that travel
    alone (eager engines only; a gather's result of one slot is slot-major
    already)."""
    flats: list[Any] = [None] * len(buckets)
    header = None
    results = list(results)
    if lay.joined is not None:
        segments = kernels.unjoin(results.pop(0), lay.joined, gathered, wire)
        header = segments.pop(0) if lay.header_shape else None
        for j, seg in zip(lay.joined.order, segments, strict=True):
            flats[j] = seg
    for j, r in zip(lay.alone, results, strict=True):
        flats[j] = r if wire else _wire.decode_move(r, buckets[j].dtype, TORCH.bitcast)
    return header, flats


def _leaves_out(op, flat, transport, plan, sync, to_cpu, signature) -> list[Any]:
    """The output leaves, in leaf order (Python scalars as 0-d CPU tensors)."""
    w = transport.world_size()
    # (the header rides in bucket 0: a move's int32 words, a reduce's first bucket)
    how = op.how(plan.buckets[0], transport)
    dtype = torch.int32 if op.joined else plan.buckets[0].dtype
    guard = _guard.size(op.kind, dtype, how, w) if signature is not None else 0
    # (a large tensor travels alone on eager engines only: on XLA its bytes
    # are in the graph either way)
    alone = 0 if transport.lazy else ALONE
    lay = plan.layout(guard, w if op.gathers else None, op.joined, alone)
    out: list[Any] = [None] * len(flat.leaves)
    live = lay.live
    for b, shapes in zip(plan.buckets, plan.shapes, strict=True):
        if b.size:
            continue
        for s, shape in zip(b.tensors, shapes, strict=True):  # only empty tensors: nothing to send
            device = "cpu" if to_cpu else flat.leaves[s.leaf].device
            t = torch.empty(shape, dtype=s.dtype or b.dtype, device=device)
            out[s.leaf] = op.finish(plan, s.leaf, t, w) if s.leaf in plan.moved else t
    if not live and not guard:
        return out
    buckets = [plan.buckets[k] for k in live]
    shapes = [lay.shapes[k] for k in live]
    casts = [lay.casts[k] for k in live]
    leaves = transport.own_buffers(flat)
    parts = [_pack.parts(b, leaves, transport.upload) for b in buckets]
    del leaves
    joined = lay.joined
    if guard:
        mine = signature.header(dtype, op.kind, how, w)
        head = [signature.uploaded(transport, mine, op.kind)]
        if not op.joined:
            parts[0] = head + parts[0]
    if op.joined:
        wires = []
        if joined is not None:
            segments = ([head] if guard else []) + [parts[j] for j in joined.order]
            wires.append(transport.kernels.join(segments, joined))
            del segments
        wires += [op.alone(transport, parts[j][0]) for j in lay.alone]
        sends = [None] * len(wires)
    else:
        wires, sends = op.pack(transport.kernels, plan, lay, live, parts), buckets
    del parts
    # A one-sided verdict (a broadcast from src) is read after every
    # collective of the call: src cannot learn it, so the receivers take part
    # in all of them, as src does, and raise last.
    one_sided = guard and op.kind == "broadcast" and not how

    def check(got: bytes, expected: bytes) -> None:
        # The same result on every replica, so the same verdict (_guard)
        if got != expected:
            _guard.fire(transport, signature)

    def arrived(result: torch.Tensor) -> bytes:
        """The header of bucket 0's result (eager engines), downloaded alone."""
        first = result.view(w, -1).narrow(1, 0, guard) if op.gathers else result[:guard]
        return _guard.as_bytes(transport.to_host([first])[0])

    late = None
    results = [op.send(transport, wires[0], sends[0], guard)]
    if guard and not transport.lazy and not one_sided:
        transport.wait()  # checked before the call's other collectives start
        check(arrived(results[0]), mine.wire)
    results += [op.send(transport, x, b, 0) for x, b in zip(wires[1:], sends[1:], strict=True)]
    del wires
    transport.wait()  # eager engines started every collective asynchronously
    if one_sided:
        late = arrived(results[0])
    # Each bucket's buffer is made on the engine's device: one computation
    # on XLA, where every torch call of a replica thread can hand the GIL to
    # another (docs/design.md). With to_cpu, a move's buffers come to the
    # host in their integer wire form (a device's download of floats may
    # change NaN payloads: torch_xla's float16 one does; a reduce's NaN are
    # the quiet NaN, which every download keeps) and are cut there.
    # Otherwise outputs are traced before the sync so that it materialises
    # them; only they, the scalar blocks and the header stay referenced, so
    # they alone become graph outputs.
    header = None
    if op.joined:
        header, flats = _unjoin(
            transport.kernels, lay, buckets, results, w if op.gathers else None, to_cpu
        )
    else:
        flats = op.unpack(transport.kernels, plan, lay, live, results, w)
    del results
    if to_cpu:
        flats = transport.sync_and_fetch(flats + ([header] if header is not None else []))
        header = flats.pop() if header is not None else None
        if op.joined:
            flats = [
                _wire.decode_move(f, b.dtype, TORCH.bitcast)
                for f, b in zip(flats, buckets, strict=True)
            ]
        pieces = TORCH.split(flats, shapes, casts)
    else:
        pieces = transport.kernels.split(flats, shapes, casts) if flats else []
    del flats
    if guard and not op.joined:  # the header's piece of bucket 0
        header = pieces[0].pop(0)
    if not transport.lazy:  # (eager engines checked its wire form)
        header = None
    if header is not None and to_cpu:
        check(_guard.as_bytes(header), mine.decoded)
        header = None
    # Only the outputs and the scalar blocks may stay referenced at the sync: a
    # piece that was finished (moved) would become a graph output of its own.
    blocks = [
        bucket_pieces[-1] for b, bucket_pieces in zip(buckets, pieces, strict=True) if b.scalars
    ]
    for b, bucket_pieces in zip(buckets, pieces, strict=True):
        _place(op, plan, b, bucket_pieces, out, w)
    del pieces
    bucket_pieces = []
    if not to_cpu:
        fetch = blocks + ([header] if header is not None else [])
        if sync and fetch:
            blocks = transport.sync_and_fetch(fetch)
        elif sync:
            transport.sync()
        elif fetch:
            blocks = transport.to_host(fetch)
        if header is not None:
            check(_guard.as_bytes(blocks.pop()), mine.decoded)
    scalar_buckets = [b for b in buckets if b.scalars]
    for b, block in zip(scalar_buckets, blocks, strict=True):
        for j, s in enumerate(b.scalars):
            out[s.leaf] = block[..., j]
    if late is not None and late != mine.wire:
        _guard.fire(transport, signature, op.src, received=out)
    return out
