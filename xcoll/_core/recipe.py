"""What a call does, decided once per signature: the op's :class:`Plan`, and
the :class:`Recipe` that :mod:`xcoll._core.execute` runs straight through.

A plan depends on the op's parameters, the world size and the tree's
signature (:attr:`xcoll._base.tree.Flat.key`); a recipe adds what the engine and
the mode decide: the guard header (its dtype, the reduction the collective combines it by,
its size and when its verdict is read: :class:`xcoll._guard.header.Guard`), which buckets travel, joined or alone,
and every shape, cast and mean range the executor needs. Both are frozen and
cached (a plan in ``_call``'s cache, its recipes on the plan), so a repeated
call reads them straight through.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .._encode import pack as _pack
from .._encode import wire as _wire
from .._guard import check as _check
from .._guard import header as _header

Shapes = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Plan:
    """How one op moves one kind of tree (built once per op parameters, world
    size and :attr:`xcoll._base.tree.Flat.key`, then reused; building validates the
    call, so a call that raises leaves nothing behind)."""

    buckets: list[_pack.Bucket]
    #: Per bucket: each tensor slot's output shape (before a gather moves its
    #: replica axis), then, if it has Python scalars, their block's ``(*lead, k)``.
    shapes: list[Shapes]
    #: What the replicas must agree on (the consistency check compares it).
    description: _check.Description
    #: Gather: leaf -> the dim its replica axis moves to.
    moved: Mapping[int, int] = field(default_factory=dict)
    #: Reduce: per bucket, the ranges of mean elements (divided by W).
    means: tuple[tuple[tuple[int, int], ...], ...] = ()
    #: Reduce: per bucket, the engine's reduction its all-reduce makes.
    reductions: tuple[str, ...] = ()
    #: Its recipes, by what else they depend on (:meth:`xcoll._core.ops.Packed.recipe`).
    recipes: dict = field(default_factory=dict, compare=False, repr=False)


class Collective(Protocol):
    """What :func:`build` and :mod:`xcoll._core.execute` read of a collective
    (:class:`xcoll._core.ops.Packed`: its rules, one method each)."""

    name: str
    src: int
    joins: bool
    scatters: bool

    def rows(self, world: int) -> int: ...

    def send(self, transport: Any, wire: torch.Tensor, k: int, r: Recipe) -> torch.Tensor: ...

    def wires(self, r: Recipe, transport: Any, parts: list, head: list) -> list[torch.Tensor]: ...

    def decoded(self, r: Recipe, transport: Any, results: list, to_cpu: bool) -> tuple[list, Any]: ...

    def scalar(self, value: Any, dtype: torch.dtype) -> torch.Tensor: ...

    def python(self, block: Any, leaf: Any) -> Any: ...

    def finish(self, r: Recipe, leaf: int, t: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class Recipe:
    """Everything :func:`xcoll._core.execute.execute` does, per live bucket (those
    that travel: with elements, or carrying the header)."""

    #: The collective whose rules the executor reads (of its fields, only
    #: those that the recipe's key holds: a gather's stack, a broadcast's src).
    op: Collective
    world: int
    #: The rows of each collective's result (W for a gather, else 1).
    rows: int
    #: The segments of each collective's wire, each of a bucket's layout (W
    #: where each replica is sent its own part: a reduce-scatter, an
    #: all-to-all; else 1).
    segments: int
    buckets: tuple[_pack.Bucket, ...]
    #: Each bucket's dtype.
    dtypes: tuple[torch.dtype, ...]
    #: Reduce: each bucket's reduction (its all-reduce's).
    reductions: tuple[str, ...]
    #: Each bucket's parts' shapes, output pieces' shapes, casts (empty where
    #: no piece is cast) and mean ranges, the header (a reduce's) as bucket
    #: 0's first part.
    part_shapes: tuple[Shapes, ...]
    shapes: tuple[Shapes, ...]
    casts: tuple[tuple[torch.dtype | None, ...], ...]
    means: tuple[tuple[tuple[int, int], ...], ...]
    #: Whether the header is bucket 0's first part and piece (a reduce's).
    header_in_bucket: bool
    #: A move's buckets as one buffer, the header first (None: a reduce, or
    #: nothing to join); positions of the buckets that travel as themselves.
    joined: _pack.Joined | None
    alone: tuple[int, ...]
    guard: _header.Guard | None
    #: The tensor leaves without elements: (leaf, shape, dtype); nothing to send.
    empties: tuple[tuple[int, tuple[int, ...], torch.dtype], ...]
    #: Gather: leaf -> the dim its replica axis moves to.
    moved: Mapping[int, int]
    #: The Python scalars of each bucket that has some: (leaf, position in its block).
    scalars: tuple[tuple[tuple[int, int], ...], ...]
    #: Of each bucket that has Python scalars: the reduction its Python ints
    #: are read back from their parts by (:attr:`xcoll._encode.pack.Bucket.exact`:
    #: "sum", "prod"; "": each is its block's element at its position).
    ints: tuple[str, ...] = ()
    #: A world of one (outputs to the host, on a lazy engine): every
    #: collective is an identity, so each output is its leaf's own copy
    #: (:func:`xcoll._core.execute.execute`).
    identity: bool = False
    #: Of an eager engine's guarded call (:attr:`~xcoll._guard.header.Guard.when` "first"): the
    #: elements of its first collective's buffer, and of the size class it is
    #: sent in (:data:`xcoll._encode.pack.SMALL` bytes; 0: larger, sent as it
    #: is), per segment.
    first: tuple[int, int] = (0, 0)
    #: Whether the verdict is read as the first collective arrives, before
    #: the others start (an eager engine's guarded call: :attr:`~xcoll._guard.header.Guard.when`
    #: "first").
    early: bool = False
    #: A lazy engine's call whose buffers, header included, fit in
    #: :data:`xcoll._encode.pack.SMALL` bytes: with sync, packed and cut on
    #: the host around one all-gather of that size (:mod:`xcoll._backends.hosted`).
    hosted: bool = False

    @functools.cached_property
    def tensor_leaves(self) -> tuple[int, ...]:
        """The tensor leaves that travel, bucket after bucket."""
        return tuple(leaf for b in self.buckets for leaf in b.tensor_leaves)


def _nbytes(joined: _pack.Joined | None, buckets, reductions, part_shapes) -> int:
    """The bytes that a lazy engine's collectives send, the header included:
    a move's joined buffer (nothing travels alone there), or a reduce's
    encoded buckets."""
    if not reductions:
        return joined.words * 4 if joined is not None else 0
    return sum(
        sum(math.prod(s) for s in shapes) * _wire.reduced_dtype(b.dtype, reduction).itemsize
        for b, reduction, shapes in zip(buckets, reductions, part_shapes, strict=True)
    )


def build(
    plan: Plan,
    op: Collective,
    world: int,
    g: _header.Guard | None,
    alone: int,
    identity: bool,
    lazy: bool,
) -> Recipe:
    """``plan``'s recipe for ``op``: with ``g``'s header, and a move's
    buckets of one tensor of ``alone`` bytes or more (0: none) travelling as
    themselves; made of copies if ``identity``; on a ``lazy`` engine, hosted
    if it is small."""
    b = plan.buckets
    joined = op.joins
    in_bucket = g is not None and not joined
    live = [k for k, x in enumerate(b) if x.size or (in_bucket and k == 0)]
    means = list(plan.means) or [() for _ in b]
    part_shapes = [b[k].part_shapes for k in live]
    shapes = [plan.shapes[k] for k in live]
    casts = [b[k].casts for k in live]
    means = [means[k] for k in live]
    if g and in_bucket:  # the header: bucket 0's first part
        part_shapes[0] = ((g.size,), *part_shapes[0])
        shapes[0] = ((g.size,), *shapes[0])
        casts[0] = (None, *casts[0])
        means[0] = tuple((a + g.size, z + g.size) for a, z in means[0])
    apart = _apart(b, live, alone) if joined else ()
    layout = _joined(b, live, apart, g) if joined else None
    reductions = tuple(plan.reductions[k] for k in live) if plan.reductions else ()
    segments = world if op.scatters else 1
    early = g is not None and g.when == "first"
    small = _nbytes(layout, [b[k] for k in live], reductions, part_shapes) * segments <= _pack.SMALL
    return Recipe(
        op=op,
        world=world,
        rows=op.rows(world),
        segments=segments,
        buckets=tuple(b[k] for k in live),
        dtypes=tuple(b[k].dtype for k in live),
        reductions=reductions,
        part_shapes=tuple(part_shapes),
        shapes=tuple(shapes),
        casts=tuple(casts) if any(any(c) for c in casts) else (),
        means=tuple(means),
        header_in_bucket=in_bucket,
        joined=layout,
        alone=apart,
        guard=g,
        empties=_empties(plan),
        moved=plan.moved,
        scalars=tuple(
            tuple((s.leaf, s.offset - b[k].scalars[0].offset) for s in b[k].scalars)
            for k in live
            if b[k].scalars
        ),
        ints=tuple(b[k].exact for k in live if b[k].scalars),
        identity=identity,
        hosted=lazy and world > 1 and not identity and small,
        first=_first(layout, [b[k] for k in live], reductions, part_shapes) if early else (0, 0),
        early=early,
    )


def _first(joined: _pack.Joined | None, buckets, reductions, part_shapes) -> tuple[int, int]:
    """:attr:`Recipe.first`: a move's joined buffer (int32 words; the header
    makes one), or a reduce's bucket 0, encoded."""
    if joined is not None:
        n, size = joined.words, 4
    else:
        n = sum(math.prod(s) for s in part_shapes[0])
        size = _wire.reduced_dtype(buckets[0].dtype, reductions[0]).itemsize
    return n, _pack.SMALL // size if n * size <= _pack.SMALL else 0


def _apart(b: list[_pack.Bucket], live: list[int], alone: int) -> tuple[int, ...]:
    """Positions in ``live`` of a move's buckets that travel as themselves:
    one tensor of ``alone`` bytes or more."""
    return tuple(
        j
        for j, k in enumerate(live)
        if alone
        and not b[k].scalars
        and len(b[k].tensors) == 1
        and b[k].size * b[k].dtype.itemsize >= alone
    )


def _joined(
    b: list[_pack.Bucket], live: list[int], apart: tuple[int, ...], g: _header.Guard | None
) -> _pack.Joined | None:
    rest = [j for j in range(len(live)) if j not in apart]
    if not rest and not g:
        return None
    dtypes = [b[live[j]].dtype for j in rest]
    return _pack.Joined.of(dtypes, [b[live[j]].part_shapes for j in rest], g.size if g else 0, rest)


def _empties(plan: Plan) -> tuple[tuple[int, tuple[int, ...], torch.dtype], ...]:
    out: list[Any] = []
    for b, shapes in zip(plan.buckets, plan.shapes, strict=True):
        if not b.size:
            out += [
                (s.leaf, sh, s.dtype or b.dtype) for s, sh in zip(b.tensors, shapes, strict=True)
            ]
    return tuple(out)
