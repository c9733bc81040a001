"""One call of a collective: flatten once, resolve the backend once, take
the op's cached plan (or build it, which validates), check, run its recipe,
unflatten.

Each collective is a small :class:`Op` object (:class:`Gather`,
:class:`Reduce`, :class:`Broadcast`): its parameters, how it is described,
validated and planned (:class:`xcoll._core.recipe.Plan`). A call then takes the
plan's :class:`xcoll._core.recipe.Recipe` for its engine and mode, and
:func:`xcoll._core.execute.execute` runs it straight through. :func:`call` is what
a public function runs; :func:`run` and :func:`outcome` are what xcoll's own
modules run on trees they built themselves (no check: the public call that
made them was checked).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from .. import _backends
from .._backends.base import Transport
from .._encode import pack as _pack
from .._encode import wire as _wire
from .._guard import check as _check
from .._guard import guard as _guard
from . import execute as _execute
from . import memo as _memo
from . import recipe as _recipe
from . import tree as _tree
from .recipe import Plan

OPS = ("sum", "mean", "max", "min", "prod")

# The collective each (kind of dtype, op) takes. Missing pairs are refused:
# mean of integers would need a dtype change; sum of bools is ambiguous (count or
# any); max/min are not defined for complex numbers, which xcoll refuses anyway.
_FLOAT_OPS = {"sum": "sum", "mean": "sum", "prod": "prod", "max": "max", "min": "min"}
_INT_OPS = {"sum": "sum", "prod": "prod", "max": "max", "min": "min"}
_BOOL_OPS = {"max": "max", "min": "min", "prod": "min"}

# The buckets whose Python scalars travel in more than one element each
# (``_pack.int_parts``): in int64, all Python ints (a Python bool's prod is
# its min, its sum is refused), exactly: a sum as two limbs, a product with
# what tells whether it fits. Python ints of max and min are exact as int64.
_EXACT: dict[Hashable, str] = {(torch.int64, op): op for op in ("sum", "prod")}

_REFUSED = {
    "mean": "mean needs a floating dtype (convert first, e.g. x.float())",
    "sum": 'sum of bools is ambiguous: use "max" for any, "min" for all, or sum x.int() to count',
}


def _reduce_op(bucket: _pack.Bucket) -> str:
    """A reduce's bucket's op: its key is ``(dtype, op)``."""
    return cast(tuple[Any, str], bucket.key)[1]


@dataclass(frozen=True)
class Tuning:
    """Settings that trade copies for collectives (tests change them with
    :func:`tuned`; plans and recipes are keyed by them)."""

    #: Bytes up to which a narrower integer dtype's leaves, widened, join a
    #: wider integer bucket of the same op (:func:`merged`): a collective
    #: saved (3 ms on gloo at W=4 on 2 cores) is worth more than copying that much.
    widen: int = 1 << 20
    #: Bytes from which a move's bucket of one tensor travels as itself, in a
    #: collective of its own, on an eager engine: copying it into the joined
    #: buffer would cost more than a collective (a 16 MiB copy takes a few ms
    #: on 2 cores, as gloo's collective does) and as much memory again as the leaf.
    alone: int = 1 << 24


_TUNING: contextvars.ContextVar[Tuning] = contextvars.ContextVar(
    "xcoll_tuning",
    default=Tuning(),  # noqa: B039 (frozen)
)


@contextlib.contextmanager
def tuned(**changes: int) -> Iterator[Tuning]:
    """Within the block, this thread's calls use :class:`Tuning` with ``changes``."""
    token = _TUNING.set(dataclasses.replace(_TUNING.get(), **changes))
    try:
        yield _TUNING.get()
    finally:
        _TUNING.reset(token)


def _plan(
    flat: _tree.Flat,
    keys: Sequence[Hashable],
    dtypes: Sequence[torch.dtype],
    lead: tuple[int, ...],
    shape,
    description: _check.Description,
    first: frozenset[int] = frozenset(),
    empty: Hashable = torch.uint8,
    exact: dict[Hashable, str] | None = None,
    **extra: Any,
) -> Plan:
    # At least one bucket, whose collective carries the guard even for a tree
    # with no leaves to send (``empty``: its key, for a uint8 bucket).
    buckets = _pack.plan(flat.leaves, keys, dtypes, first, exact) or [
        _pack.Bucket(empty, torch.uint8)
    ]
    shapes = [
        tuple(shape(s.leaf) for s in b.tensors) + ((lead + (b.block,),) if b.scalars else ())
        for b in buckets
    ]
    return Plan(buckets, shapes, description, **extra)


def _leaf_shape(flat: _tree.Flat):
    return lambda i: tuple(flat.leaves[i].shape)


_plans: _memo.Memo[Plan] = _memo.Memo()


class Op(ABC):
    """A collective call's kind: how it is described, validated and planned."""

    name: str
    #: What it does: "gather", "reduce", "broadcast" or "uneven" (a gather).
    kind: str
    #: Whether the call is differentiable (``grad=True``, :mod:`xcoll._core.grad`).
    grad: bool = False
    #: A broadcast's source rank (a field of that op).
    src: int = 0

    def head(self, sync: bool, to_cpu: bool) -> str:
        """The call's parameters, as the consistency check compares them."""
        return f"to_cpu={to_cpu} sync={sync}" + (" grad=True" if self.grad else "")

    def validate(self, flat: _tree.Flat, transport: Transport, sync: bool, to_cpu: bool) -> None:
        """Checks of the call's arguments that are not cached with the plan."""
        if self.grad and to_cpu:
            raise ValueError(
                "grad=True needs to_cpu=False: gradients flow back to the leaves' device"
            )
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
    ) -> tuple[Any, Any]:
        """Communicates, guarded as ``signature``; returns the output tree and
        what a backward needs of this call beyond its signature (an uneven
        gather's sizes; None for the others)."""


class Packed(Op):
    """A collective that moves packed buckets (:mod:`xcoll._core.execute`)."""

    #: A gather's stacking (a field of that op).
    stack: bool = False

    def how(self, plan: Plan, transport: Transport) -> str:
        """How the collective combines the guard header (:func:`xcoll._guard.guard.size`)."""
        return ""

    def recipe(
        self, plan: Plan, transport: Transport, guarded: bool, to_cpu: bool
    ) -> _recipe.Recipe:
        """``plan``'s recipe on ``transport`` (with the guard's header if
        ``guarded``; outputs to the host if ``to_cpu``), kept on the plan."""
        w = transport.world_size()
        # (everything the recipe reads beyond the plan: the engine's kind
        # decides lazy and how a broadcast's header combines)
        key = (type(transport), w, guarded, to_cpu, _TUNING.get().alone, self.src)
        r = plan.recipes.get(key)
        if r is None:  # (two threads may build it: setdefault keeps one)
            r = plan.recipes.setdefault(key, self._recipe(plan, transport, w, guarded, to_cpu))
        return r

    def _recipe(
        self, plan: Plan, transport: Transport, w: int, guarded: bool, to_cpu: bool
    ) -> _recipe.Recipe:
        guard = None
        if guarded:
            dtype = plan.buckets[0].dtype if self.kind == "reduce" else torch.int32
            how = self.how(plan, transport)
            guard = _recipe.guard(self.kind, dtype, how, w, transport.lazy)
        # (a large tensor travels alone on eager engines only: on XLA its
        # bytes are in the graph either way)
        alone = 0 if transport.lazy else _TUNING.get().alone
        # (a world of one whose outputs stay on a lazy engine's device runs its
        # one program: made of copies, it would trace one per leaf)
        identity = w == 1 and (to_cpu or not transport.lazy)
        return _recipe.build(
            plan, self.kind, w, guard, alone, self.src, self.stack, identity, transport.lazy
        )

    def apply(self, flat, transport, plan, sync, to_cpu, signature):
        r = self.recipe(plan, transport, signature is not None, to_cpu)
        out, agree = _execute.execute(r, flat, transport, signature, sync=sync, to_cpu=to_cpu)
        if not agree:
            _guard.fire(transport, signature, r.src)
        return out, None


def gather_params(dim: Any, stack: bool, uneven: bool, max_size: int | None) -> str:
    """A gather's parameters, even or uneven, as its call's head names them
    (:meth:`Op.head`: one text, so that the check compares the two kinds)."""
    return f"dim={dim} stack={stack} uneven={uneven} max_size={max_size}"


@dataclass(frozen=True)
class Gather(Packed):
    dim: int = 0
    stack: bool = False
    grad: bool = False
    name = "xcoll.gather"
    kind = "gather"

    def head(self, sync, to_cpu):
        return f"{gather_params(self.dim, self.stack, False, None)} {super().head(sync, to_cpu)}"

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
        return _plan(flat, dtypes, dtypes, (world,), shape, _check.describe(flat), moved=moved)

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


@dataclass(frozen=True)
class Reduce(Packed):
    op: Any = "sum"
    grad: bool = False
    name = "xcoll.reduce"
    kind = "reduce"

    def key(self, flat, world):
        # (the plan reads the tuning's widen: a plan never outlives the value it was made with)
        return ("reduce", _tree.prefix_key(self.op), self.grad, world, _TUNING.get().widen, flat.key)

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
            if self.grad and dtype.is_floating_point and ops[i] not in ("sum", "mean"):
                raise ValueError(
                    f"{flat.path(i)}: op {ops[i]!r} has no gradient in xcoll (grad=True "
                    "differentiates sum and mean); reduce this leaf in a call without grad"
                )
            keys.append((dtype, table[ops[i]]))
        keys = merged(flat, keys)
        means = frozenset(i for i, o in enumerate(ops) if o == "mean")
        plan = _plan(
            flat,
            keys,
            [k[0] for k in keys],
            (),
            _leaf_shape(flat),
            _check.describe(flat, ops=ops),
            first=means,
            empty=(torch.uint8, "max"),
            exact=_EXACT,
        )
        return dataclasses.replace(
            plan,
            means=tuple(_ranges(b, means) for b in plan.buckets),
            ops=tuple(_reduce_op(b) for b in plan.buckets),
        )

    def how(self, plan, transport):
        return plan.ops[0]


def merged(flat: _tree.Flat, keys: list[tuple[torch.dtype, str]]) -> list[tuple[torch.dtype, str]]:
    """A reduce's bucket keys ``(dtype, collective op)``, with buckets merged
    where every result stays bit for bit the same, into one collective:

    * half-precision sums and products (means included) with float32's of
      the same op, or with each other as float32: each accumulates in float32
      anyway and is rounded back once (``_wire.ACCUMULATE``);
    * an integer or bool bucket with the widest integer bucket of the same op
      that holds all its values (a bool in any, uint8 in int16 and wider), up
      to :attr:`Tuning.widen` bytes widened: sums and products wrap modulo 2**bits,
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
    widen = _TUNING.get().widen
    for op, by_dtype in counts.items():
        halves = [d for d in by_dtype if d in (torch.float16, torch.bfloat16, torch.float32)]
        if op in ("sum", "prod") and len(halves) > 1:
            into.update({(d, op): (torch.float32, op) for d in halves})
        ints = [d for d in by_dtype if d in _wire.INTS]
        if len(ints) > 1:
            wide = max(ints, key=_wire.INTS.index)
            for d in ints:
                if _holds(wide, d) and by_dtype[d] * wide.itemsize <= widen:
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
    grad: bool = False
    name = "xcoll.broadcast"
    kind = "broadcast"

    def head(self, sync, to_cpu):
        return f"src={self.src} {super().head(sync, to_cpu)}"

    def validate(self, flat, transport, sync, to_cpu):
        super().validate(flat, transport, sync, to_cpu)
        w = transport.world_size()
        if isinstance(self.src, bool) or not isinstance(self.src, int) or not 0 <= self.src < w:
            raise ValueError(f"src={self.src!r} is not a replica rank: world size is {w}")

    def key(self, flat, world):
        return ("broadcast", flat.key)

    def plan(self, flat, world):
        dtypes = [_tree.dtype_of(leaf) for leaf in flat.leaves]
        return _plan(flat, dtypes, dtypes, (), _leaf_shape(flat), _check.describe(flat))

    def how(self, plan, transport):
        return "sum" if transport.broadcast_sums else ""


def _prepare(op: Op, flat: _tree.Flat, transport: Transport, sync: bool, to_cpu: bool) -> Plan:
    op.validate(flat, transport, sync, to_cpu)
    w = transport.world_size()
    return _plans.get(op.key(flat, w), lambda: op.plan(flat, w))


@dataclass
class Prepared:
    """A public call's tree flattened once, its backend resolved once and its
    plan taken (or the call's own error, which :func:`called` shares with
    every replica): what the call, and a differentiable call's forward, run."""

    flat: _tree.Flat | None
    transport: Transport
    plan: Plan | None
    error: Exception | None

    def clear(self) -> None:
        """Drops the tree and the error: the error's traceback holds the
        frames that hold this, and an XLA tensor kept alive on one replica
        (until a garbage collection frees the cycle) joins its next graph
        (seen: XLA's abort after a caught error, the replicas' programs
        differing)."""
        self.flat = self.plan = self.error = None


def prepare(op: Op, tree: Any, group: Any, sync: bool, to_cpu: bool) -> Prepared:
    """``tree`` flattened, its backend resolved and ``op``'s plan taken; an
    argument's error is kept for :func:`called` to raise on every replica."""
    flat = transport = plan = error = None
    try:
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
        return Prepared(flat, transport, plan, error)
    finally:
        # The error's traceback holds this frame: cleared, the frame holds
        # neither the error (a cycle that only a later garbage collection
        # would free, on each replica at its own time) nor the tree's tensors.
        error = flat = tree = plan = None  # noqa: F841


def call(
    op: Op, tree: Any, group: Any, *, sync: bool = True, to_cpu: bool = False, tag: Any = None
) -> Any:
    """A public call without ``grad`` (:func:`xcoll._core.grad.call` runs
    every public call): ``tree`` flattened once, its backend resolved once,
    the plan taken from the cache (or built, which validates), the
    consistency check when due (a local error is shared with every replica),
    then run with the guard (``_guard``) unless the mode is "never". ``tag``:
    the call's own step tag (:mod:`xcoll._guard.steps`)."""
    return called(op, prepare(op, tree, group, sync, to_cpu), sync=sync, to_cpu=to_cpu, tag=tag)[0]


def called(
    op: Op, p: Prepared, *, sync: bool = True, to_cpu: bool = False, tag: Any = None
) -> tuple[Any, Any, _guard.Signature | None]:
    """The call ``p`` was prepared for: its output tree, what a backward
    needs of it (:meth:`Op.apply`), and its guard's signature (whose tag and
    number its backward is named by)."""
    description = None if p.plan is None else p.plan.description
    try:
        with _guard.entered(
            p.transport, op.name, op.head(sync, to_cpu), description, p.error, tag=tag
        ) as sig:
            assert p.flat is not None and p.plan is not None  # (else entered raised the error)
            return (*op.apply(p.flat, p.transport, p.plan, sync, to_cpu, sig), sig)
    finally:
        p.clear()


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
    out, agree = outcome(op, tree, transport, to_cpu=to_cpu, signature=signature)
    if not agree:
        _guard.fire(transport, signature, op.src)
    return out


def outcome(
    op: Packed,
    tree: Any,
    transport: Transport,
    *,
    to_cpu: bool = False,
    signature: _guard.Signature | None = None,
) -> tuple[Any, bool]:
    """As :func:`run`, and the verdict instead of its error where the verdict
    is one-sided (a receiver of gloo's broadcast: see
    :func:`xcoll._core.execute.execute`), for a caller whose protocol goes on."""
    flat = _tree.flatten(tree)
    transport.validate(flat)
    plan = _prepare(op, flat, transport, True, to_cpu)
    r = op.recipe(plan, transport, signature is not None, to_cpu)
    return _execute.execute(r, flat, transport, signature, to_cpu=to_cpu)
