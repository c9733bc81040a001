"""The reduce: every replica's leaves combined elementwise, one all-reduce
per (dtype, reduction) bucket (its rules: :class:`Reduce`), and which
reduction each dtype takes and which buckets merge (:func:`merged`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from ..._backends.base import TORCH
from ..._base import tree as _tree
from ..._encode import pack as _pack
from ..._encode import wire as _wire
from ..._guard import check as _check
from ..._guard import verdict as _verdict
from .base import TRANSPOSES, Op, Packed, Transpose, laid_out, leaf_shape, tuning

#: The reductions a reduce takes (its public ``op=``).
REDUCTIONS = ("sum", "mean", "max", "min", "prod")

# The engine's reduction each (kind of dtype, reduction) takes. Missing pairs are refused:
# mean of integers would need a dtype change; sum of bools is ambiguous (count or
# any); max/min are not defined for complex numbers, which xcoll refuses anyway.
_FLOAT_REDUCTIONS = {"sum": "sum", "mean": "sum", "prod": "prod", "max": "max", "min": "min"}
_INT_REDUCTIONS = {"sum": "sum", "prod": "prod", "max": "max", "min": "min"}
_BOOL_REDUCTIONS = {"max": "max", "min": "min", "prod": "min"}

# The buckets whose Python scalars travel in more than one element each
# (``_pack.int_parts``): in int64, all Python ints (a Python bool's prod is
# its min, its sum is refused), exactly: a sum as two limbs, a product with
# what tells whether it fits. Python ints of max and min are exact as int64.
_EXACT: dict[Hashable, str] = {(torch.int64, reduction): reduction for reduction in ("sum", "prod")}

_REFUSED = {
    "mean": "mean needs a floating dtype (convert first, e.g. x.float())",
    "sum": 'sum of bools is ambiguous: use "max" for any, "min" for all, or sum x.int() to count',
}


def _reduction(bucket: _pack.Bucket) -> str:
    """A reduce's bucket's reduction: its key is ``(dtype, reduction)``."""
    return cast(tuple[Any, str], bucket.key)[1]


@dataclass(frozen=True)
class Reduce(Packed):
    """Every replica's leaves combined elementwise by ``reduction`` (the
    public ``op=``: a name, or a prefix tree of names): one all-reduce per
    (dtype, reduction) bucket, encoded so that the engine's arithmetic is exact."""

    reduction: Any = "sum"
    grad: bool = False
    name: str = "xcoll.reduce"
    carries = "reduced"
    joins = False

    def key(self, flat, world):
        # (the plan reads the tuning's widen: a plan never outlives the value it was made with)
        reduction = self.reduction if self.reduction.__class__ is str else _tree.prefix_key(self.reduction)
        return ("reduce", reduction, self.grad, world, tuning().widen, flat.key)

    def plan(self, flat, world):
        reductions = _tree.broadcast_prefix(self.reduction, flat, "op")
        keys = []
        for i, leaf in enumerate(flat.leaves):
            dtype = _tree.dtype_of(leaf)
            table = (
                _BOOL_REDUCTIONS
                if dtype == torch.bool
                else _FLOAT_REDUCTIONS
                if dtype.is_floating_point
                else _INT_REDUCTIONS
            )
            # (the messages name the public argument, op=)
            if not isinstance(reductions[i], str) or reductions[i] not in REDUCTIONS:
                raise ValueError(
                    f"{flat.path(i)}: unknown op {reductions[i]!r}; expected one of {', '.join(REDUCTIONS)}"
                )
            if reductions[i] not in table:
                raise TypeError(
                    f"{flat.path(i)}: op {reductions[i]!r} is not defined for {dtype}; {_REFUSED[reductions[i]]}"
                )
            if self.grad and dtype.is_floating_point and reductions[i] not in ("sum", "mean"):
                raise ValueError(
                    f"{flat.path(i)}: op {reductions[i]!r} has no gradient in xcoll (grad=True "
                    "differentiates sum and mean); reduce this leaf in a call without grad"
                )
            keys.append((dtype, table[reductions[i]]))
        keys = merged(flat, keys)
        means = frozenset(i for i, o in enumerate(reductions) if o == "mean")
        plan = laid_out(
            flat,
            keys,
            [k[0] for k in keys],
            (),
            leaf_shape(flat),
            _check.describe(flat, reductions=reductions),
            first=means,
            empty=(torch.uint8, "max"),
            exact=_EXACT,
        )
        return dataclasses.replace(
            plan,
            means=tuple(_ranges(b, means) for b in plan.buckets),
            reductions=tuple(_reduction(b) for b in plan.buckets),
        )

    def send(self, transport, wire, k, r):
        return transport.all_reduce(wire, r.reductions[k])

    def wires(self, r, transport, parts, head):
        parts[0] = [*(head[0] if head else []), *parts[0]]
        return transport.kernels.encode_reduce(parts, r.part_shapes, r.dtypes, r.reductions)

    def decoded(self, r, transport, results, to_cpu):
        # (with to_cpu, fetched as they arrived and decoded on the host: no
        # computation after the collectives)
        kernels = transport.kernels
        if to_cpu:
            results, kernels = _verdict.synced(transport, results), TORCH
        return kernels.decode_reduce(results, r.dtypes, r.reductions, r.means, r.world), None


def _reduce_transpose(op: Reduce, flat: _tree.Flat, leaves: tuple[int, ...]) -> Transpose:
    """An all-reduce of the output gradients, each by its leaf's own reduction:
    sum, or mean (the others have no gradient: :meth:`Reduce.plan` refuses them)."""
    reductions = _tree.broadcast_prefix(op.reduction, flat, "op")
    out: list[Any] = [None] * len(flat.leaves)
    for i in leaves:
        out[i] = reductions[i]
    return Transpose(Reduce(flat.unflatten(out), name=f"{op.name} backward"))


TRANSPOSES[Reduce] = _reduce_transpose


def summed(op: Op, flat: _tree.Flat, leaves: Sequence[int]) -> Reduce:
    """The backward of ``op`` whose input gradients are a sum over replicas
    (a broadcast's, an uneven gather's): an all-reduce sum of the output
    gradients of ``leaves``."""
    reductions: list[Any] = [None] * len(flat.leaves)
    for i in leaves:
        reductions[i] = "sum"
    return Reduce(flat.unflatten(reductions), name=f"{op.name} backward")


def merged(flat: _tree.Flat, keys: list[tuple[torch.dtype, str]]) -> list[tuple[torch.dtype, str]]:
    """A reduce's bucket keys ``(dtype, the engine's reduction)``, with buckets merged
    where every result stays bit for bit the same, into one collective:

    * half-precision sums and products (means included) with float32's of
      the same reduction, or with each other as float32: each accumulates in float32
      anyway and is rounded back once (``_wire.ACCUMULATE``);
    * an integer or bool bucket with the widest integer bucket of the same reduction
      that holds all its values (a bool in any, uint8 in int16 and wider), up
      to :attr:`Tuning.widen` bytes widened: sums and products wrap modulo 2**bits,
      which the cast back keeps, and max and min compare the same values.

    Float max and min (ordered keys of each width) and float64 keep their own.

    >>> flat = _tree.flatten([torch.ones(2, dtype=torch.float16), torch.ones(3), 1, True])
    >>> merged(flat, [(torch.float16, "sum"), (torch.float32, "sum"), (torch.int64, "max"), (torch.bool, "max")])
    [(torch.float32, 'sum'), (torch.float32, 'sum'), (torch.int64, 'max'), (torch.int64, 'max')]
    """
    counts: dict[str, dict[torch.dtype, int]] = {}  # reduction -> dtype -> elements
    for leaf, (dtype, reduction) in zip(flat.leaves, keys, strict=True):
        n = leaf.numel() if isinstance(leaf, torch.Tensor) else 1
        counts.setdefault(reduction, {})[dtype] = counts.get(reduction, {}).get(dtype, 0) + n
    into: dict[tuple[torch.dtype, str], tuple[torch.dtype, str]] = {}
    widen = tuning().widen
    for reduction, by_dtype in counts.items():
        halves = [d for d in by_dtype if d in (torch.float16, torch.bfloat16, torch.float32)]
        if reduction in ("sum", "prod") and len(halves) > 1:
            into.update({(d, reduction): (torch.float32, reduction) for d in halves})
        ints = [d for d in by_dtype if d in _wire.INTS]
        if len(ints) > 1:
            wide = max(ints, key=_wire.INTS.index)
            for d in ints:
                if _holds(wide, d) and by_dtype[d] * wide.itemsize <= widen:
                    into[d, reduction] = (wide, reduction)
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


