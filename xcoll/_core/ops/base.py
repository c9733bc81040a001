"""What every collective is: :class:`Op` (described, validated, planned,
run, differentiated), :class:`Packed` (run by :mod:`xcoll._core.execute`
from a recipe, through its rules, one method each) and :class:`Move` (a
gather's or broadcast's buckets joined into one buffer); and :class:`Tuning`,
the settings that trade copies for collectives."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..._backends.base import TORCH, Kernels, Transport
from ..._base import tree as _tree
from ..._encode import pack as _pack
from ..._encode import wire as _wire
from ..._guard import check as _check
from ..._guard import header as _header
from ..._guard import verdict as _verdict
from .. import execute as _execute
from .. import recipe as _recipe
from ..recipe import Plan, Recipe


@dataclass(frozen=True)
class Tuning:
    """Settings that trade copies for collectives (tests change them with
    :func:`tuned`; plans and recipes are keyed by them)."""

    #: Bytes up to which a narrower integer dtype's leaves, widened, join a
    #: wider integer bucket of the same reduction (:func:`merged`): a collective
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


#: This thread's :class:`Tuning` (the context variable's own getter: it is
#: read on every call's path).
tuning: Callable[[], Tuning] = _TUNING.get


@contextlib.contextmanager
def tuned(**changes: int) -> Iterator[Tuning]:
    """Within the block, this thread's calls use :class:`Tuning` with ``changes``."""
    token = _TUNING.set(dataclasses.replace(_TUNING.get(), **changes))
    try:
        yield _TUNING.get()
    finally:
        _TUNING.reset(token)


def laid_out(
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


def leaf_shape(flat: _tree.Flat):
    return lambda i: tuple(flat.leaves[i].shape)


def unsynced(flat: _tree.Flat, to_cpu: bool) -> None:
    """Refuses what a call with ``sync=False`` cannot do, whatever its op."""
    if to_cpu:
        raise ValueError("to_cpu=True needs sync=True: host values exist only after execution")
    if flat.scalars:
        raise ValueError(
            f"{flat.path(flat.scalars[0])}: a Python scalar leaf needs sync=True (its value is "
            "known only after execution); pass a tensor to trace it into the pending graph"
        )


#: What every op refuses of ``grad=True`` (:func:`xcoll._core.call.prepare`).
GRAD_ON_HOST = "grad=True needs to_cpu=False: gradients flow back to the leaves' device"


class Op(ABC):
    """A collective call: how it is described, validated, planned, run and
    differentiated."""

    #: The call's name in messages and signatures (a field of each op, so
    #: that a backward's op is named after its forward: "xcoll.gather backward").
    name: str
    #: Whether the call is differentiable (``grad=True``, :mod:`xcoll._core.grad`).
    grad: bool = False
    #: A broadcast's source rank (a field of that op).
    src: int = 0

    def head(self, sync: bool, to_cpu: bool) -> str:
        """The call's parameters, as the consistency check compares them."""
        return f"to_cpu={to_cpu} sync={sync}" + (" grad=True" if self.grad else "")

    def validate(self, flat: _tree.Flat, transport: Transport, sync: bool, to_cpu: bool) -> None:
        """The op's own checks of the call's arguments that are not cached
        with the plan (:func:`xcoll._core.call.prepare` makes those every op
        shares, after)."""

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
        signature: _header.Signature | None,
    ) -> tuple[Any, Any]:
        """Communicates, guarded as ``signature``; returns the output tree and
        what a backward needs of this call beyond its signature (an uneven
        gather's sizes; None for the others)."""


@dataclass(frozen=True)
class Transpose:
    """A differentiable call's backward rule (:mod:`xcoll._core.grad`), for
    one op and signature: the output gradients of its floating tensor leaves
    go through its dual collective (:attr:`dual`), sent as :meth:`sent` makes
    them, and each input's gradient is taken from the result by :meth:`take`.
    This one sends and takes them as they are (a reduce's, an all-to-all's);
    a collective whose rule differs has its own subclass, beside it."""

    #: The backward's collective, on the tree of the travelling leaves'
    #: output gradients (None elsewhere), named ``"<forward's name> backward"``.
    dual: Op
    #: Whether it runs on its own, after the pending work (an uneven
    #: gather's: the replicas' shapes differ).
    separate: bool = False

    def sent(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The travelling leaves' output gradients as :attr:`dual` takes them."""
        return grads

    def take(
        self,
        reduced: list[torch.Tensor],
        shapes: tuple[tuple[int, ...], ...],
        transport: Transport,
        sizes: Any,
    ) -> list[torch.Tensor]:
        """Each travelling leaf's input gradient, from its output gradient's
        result of :attr:`dual` (``shapes``: the leaves'; ``sizes``: what
        :meth:`Op.apply` returned for the forward)."""
        return reduced


#: A collective's transpose: its :class:`Transpose` for a call on ``flat``
#: whose travelling leaves are ``leaves``.
TransposeRule = Callable[[Any, _tree.Flat, tuple[int, ...]], Transpose]

#: Each collective's transpose, by its type, declared beside it (a gather's
#: and a reduce-scatter's beside the gather: each is the other's dual), as
#: JAX declares its primitives' transposes.
TRANSPOSES: dict[type[Op], TransposeRule] = {}


def transpose(op: Op, flat: _tree.Flat, leaves: tuple[int, ...]) -> Transpose:
    """The backward rule of a differentiable call of ``op`` on ``flat``,
    whose floating tensor leaves ``leaves`` carry gradients."""
    return TRANSPOSES[type(op)](op, flat, leaves)


class Packed(Op):
    """A collective that moves packed buckets, run by :mod:`xcoll._core.execute`
    from its :class:`~xcoll._core.recipe.Recipe`, which holds the op: the
    executor and the guard read the rules below, one method each."""

    #: Whether its buckets travel joined, as one buffer of int32 words with
    #: the header first (a move), or in one collective each, the header at
    #: the front of bucket 0 (a reduce).
    joins: bool = True
    #: Whether each leaf is cut along its dim into W parts, part ``r``
    #: addressed to replica ``r``: the wire is W segments of the same layout,
    #: one per replica (``ReduceScatter`` in :mod:`xcoll._core.ops.gather`,
    #: :mod:`xcoll._core.ops.all_to_all`), and no bucket
    #: travels alone.
    scatters: bool = False
    #: How its collective carries the guard's header (one of
    #: :data:`xcoll._guard.header.CARRIES`), which is all the guard reads of it.
    carries: str

    def rows(self, world: int) -> int:
        """The rows of a collective's result, one per replica that sent it."""
        return 1

    def scalar(self, value: Any, dtype: torch.dtype) -> torch.Tensor:
        """A Python scalar's output as its collective gives it, in a world of one."""
        return torch.tensor(value, dtype=dtype)

    def python(self, block: Any, leaf: Any) -> Any:
        """A Python scalar's output, from its block's elements (a tensor; or
        an exact int, read back already)."""
        return _tree.to_python(block, leaf) if isinstance(block, torch.Tensor) else block

    def finish(self, r: Recipe, leaf: int, t: torch.Tensor) -> torch.Tensor:
        """A tensor leaf's output from its piece, shaped as the collective gives it."""
        return t

    @abstractmethod
    def send(self, transport: Transport, wire: torch.Tensor, k: int, r: Recipe) -> torch.Tensor:
        """Starts collective ``k`` of the call (the first carries the header)."""

    @abstractmethod
    def wires(
        self, r: Recipe, transport: Transport, parts: list[list[torch.Tensor]], head: list
    ) -> list[torch.Tensor]:
        """The buffers the call's collectives send, from each live bucket's
        parts and the header's part (``head``: ``[[part]]``, or empty)."""

    @abstractmethod
    def decoded(
        self, r: Recipe, transport: Transport, results: list[torch.Tensor], to_cpu: bool
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Each live bucket's 1-d buffer, decoded, and a move's header piece
        (None for a reduce's, which is still bucket 0's first part): on the
        engine's device (one computation on XLA), or with ``to_cpu`` on the
        host, after one transfer."""

    def recipe(self, plan: Plan, transport: Transport, guarded: bool, to_cpu: bool) -> Recipe:
        """``plan``'s recipe on ``transport`` (with the guard's header if
        ``guarded``; outputs to the host if ``to_cpu``), kept on the plan."""
        w = transport.world
        # (everything the recipe reads beyond the plan: the engine's kind
        # decides lazy and how a broadcast's header combines; of the op, only
        # fields that the plan's key or this one holds: src)
        key = (type(transport), transport.device.type, w, guarded, to_cpu, _TUNING.get().alone, self.src)
        r = plan.recipes.get(key)
        if r is None:  # (two threads may build it: setdefault keeps one)
            r = plan.recipes.setdefault(key, self._recipe(plan, transport, w, guarded, to_cpu))
        return r

    def _recipe(self, plan: Plan, transport: Transport, w: int, guarded: bool, to_cpu: bool) -> Recipe:
        # (a world of one whose outputs stay on a lazy engine's device runs its
        # one program: made of copies, it would trace one per leaf)
        identity = w == 1 and (to_cpu or not transport.lazy)
        if transport.lazy:
            return self._built(plan, w, guarded, transport.broadcast_sums, identity, True)
        # A small guarded call on an eager engine's host runs as a lazy
        # engine's small call does: hosted, every kind of call one all-gather
        # of SMALL bytes, so that replicas whose calls differ in kind or size
        # still meet, and the guard's header names the difference on every
        # replica (a broadcast's header summed: every replica reads it).
        if guarded and not identity and transport.device.type == "cpu":
            r = self._built(plan, w, guarded, True, identity, True)
            if r.hosted:
                return r
        return self._built(plan, w, guarded, transport.broadcast_sums, identity, False)

    def _built(self, plan: Plan, w: int, guarded: bool, sums: bool, identity: bool, lazy: bool) -> Recipe:
        """``plan``'s recipe as a ``lazy`` engine (or a hosted call) runs it,
        or an eager engine; ``sums``: whether a broadcast sums its header."""
        guard = None
        if guarded:
            # (bucket 0's: a reduce's header is its first part)
            reduction = plan.reductions[0] if plan.reductions else ""
            guard = _header.guard(self.carries, plan.buckets[0].dtype, reduction, sums, w, lazy)
        # (a large tensor travels alone on eager engines only: on XLA its
        # bytes are in the graph either way)
        alone = 0 if lazy or self.scatters else _TUNING.get().alone
        return _recipe.build(plan, self, w, guard, alone, identity, lazy)

    def apply(self, flat, transport, plan, sync, to_cpu, signature):
        r = self.recipe(plan, transport, signature is not None, to_cpu)
        out, agree = _execute.execute(r, flat, transport, signature, sync=sync, to_cpu=to_cpu)
        if not agree:
            _verdict.fire(transport, signature, r.op.src)
        return out, None


class Move(Packed):
    """A gather or a broadcast: every bucket's bytes joined into one buffer
    of int32 words (the header first), in one collective; on an eager engine
    a bucket of one large tensor travels as itself (:attr:`Tuning.alone`)."""

    def wires(self, r, transport, parts, head):
        wires = []
        if r.joined is not None:
            segments = head + list(map(parts.__getitem__, r.joined.order))
            wires = [transport.kernels.join(segments, r.joined)]
        if r.alone:
            wires += [self.alone(transport, parts[j][0]) for j in r.alone]
        return wires

    @abstractmethod
    def alone(self, transport: Transport, leaf: torch.Tensor) -> torch.Tensor:
        """The wire of a bucket that travels as itself (eager engines)."""

    def decoded(self, r, transport, results, to_cpu):
        # (cut into segments on the device first: on the host, a gather's
        # slot-major copies cost more than the computation; in their integer
        # wire form, for the host: a device's download of floats may change
        # NaN payloads)
        flats, header = _unjoin(r, transport.kernels, results, wire=to_cpu)
        if not to_cpu:
            return flats, header
        fetched = _verdict.synced(transport, flats + ([header] if header is not None else []))
        header = fetched.pop() if header is not None else None
        decoded = [_wire.decode_move(f, d, TORCH.bitcast) for f, d in zip(fetched, r.dtypes, strict=True)]
        return decoded, header


def _unjoin(r: Recipe, kernels: Kernels, results, wire: bool):
    """Each live bucket's 1-d buffer of a move (in the integer ``wire`` form,
    or decoded), and its header piece (or None): the joined buffer's first,
    then those of the buckets that travel alone (a gather's result of one
    slot is slot-major already)."""
    flats: list[Any] = [None] * len(r.buckets)
    header = None
    if r.joined is not None:
        # (the header's segment is cut only where it is read with the outputs,
        # on a lazy engine: an eager one read it from the result as it arrived)
        late = r.guard is not None and r.guard.when == "outputs"
        skip = int(r.guard is not None and not late)
        segments = kernels.unjoin(results[0], r.joined, r.rows, wire, skip)
        results = results[1:]
        header = segments.pop(0) if late else None
        for j, seg in zip(r.joined.order, segments, strict=True):
            flats[j] = seg
    for j, got in zip(r.alone, results, strict=True):
        flats[j] = got if wire else _wire.decode_move(got, r.buckets[j].dtype, kernels.bitcast)
    return flats, header
