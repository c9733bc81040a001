"""The reduce-scatter: on replica ``r`` the reduction of every replica's
part ``r`` of each leaf, a reduce sent as W segments (:class:`ReduceScatter`,
:mod:`xcoll._core.ops.parts`). Its transpose, a gather, is declared beside
the gather (:mod:`xcoll._core.ops.gather`), whose own it is."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..._base import tree as _tree
from ..._guard import check as _check
from .base import Transpose
from .parts import check_dim, cut, parts
from .reduce import Reduce


@dataclass(frozen=True)
class ReduceScatter(Reduce):
    """On replica ``r``, the elementwise reduction by ``reduction`` of every
    replica's part ``r`` of each leaf (cut along ``dim``): one reduce-scatter
    per (dtype, reduction) bucket, encoded as a reduce's (:class:`Reduce`)."""

    reduction: Any = "sum"
    dim: int = 0
    grad: bool = False
    name: str = "xcoll.reduce_scatter"
    scatters = True

    def head(self, sync, to_cpu):
        return f"dim={self.dim} {super().head(sync, to_cpu)}"

    def key(self, flat, world):
        if self.dim.__class__ is not int:  # (an int makes no call)
            check_dim(self.dim)
        return ("reduce_scatter", self.dim, *super().key(flat, world))

    def plan(self, flat, world):
        plan = super().plan(parts(flat, self.dim, world, self.name), world)
        reductions = _tree.broadcast_prefix(self.reduction, flat, "op")
        # (the leaves as the caller passed them; each one's dim, where not 0)
        dims = {i: self.dim % leaf.dim() for i, leaf in enumerate(flat.leaves)}
        return dataclasses.replace(
            plan,
            description=_check.describe(flat, reductions=reductions),
            moved={i: d for i, d in dims.items() if d},
        )

    def send(self, transport, wire, k, r):
        return transport.reduce_scatter(wire, r.reductions[k])

    def wires(self, r, transport, parts, head):
        own = head[0] if head else []
        segments = cut(r, transport.kernels, parts)
        buckets = [
            [t for seg in segments for t in (own if k == 0 else []) + seg[k]]
            for k in range(len(parts))
        ]
        shapes = tuple(s * r.world for s in r.part_shapes)
        return transport.kernels.encode_reduce(buckets, shapes, r.dtypes, r.reductions)


@dataclass(frozen=True)
class Means(Transpose):
    """A reduce-scatter's backward rule: the gathered gradient of a leaf
    reduced by mean divided by W."""

    #: Per travelling leaf, whether its reduction is the mean.
    means: tuple[bool, ...] = ()

    def take(self, reduced, shapes, transport, sizes):
        return [g / transport.world if m else g for g, m in zip(reduced, self.means, strict=True)]
