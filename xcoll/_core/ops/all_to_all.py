"""The all-to-all: on replica ``r``, every replica's part ``r`` of each
leaf, in rank order: a gather of the parts, sent as W segments
(:mod:`xcoll._core.ops.parts`; its rules: :class:`AllToAll`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..._base import tree as _tree
from ..._guard import check as _check
from .base import TRANSPOSES, Op, Transpose
from .gather import Gather
from .parts import check_dim, cut, parts


@dataclass(frozen=True)
class AllToAll(Gather):
    """On replica ``r``, every replica's part ``r`` of each leaf (cut along
    ``dim``), concatenated along ``dim`` in rank order: one all-to-all, whose
    result is a gather's of the parts (:class:`Gather`)."""

    dim: int = 0
    stack: bool = False
    grad: bool = False
    name: str = "xcoll.all_to_all"
    scatters = True

    def head(self, sync, to_cpu):
        return f"dim={self.dim} {Op.head(self, sync, to_cpu)}"

    def key(self, flat, world):
        if self.dim.__class__ is not int:  # (an int makes no call)
            check_dim(self.dim)
        return ("all_to_all", self.dim, world, flat.key)

    def plan(self, flat, world):
        plan = super().plan(parts(flat, self.dim, world, self.name), world)
        return dataclasses.replace(plan, description=_check.describe(flat))

    def send(self, transport, wire, k, r):
        return transport.all_to_all(wire)

    def wires(self, r, transport, parts, head):
        join, order = transport.kernels.join, r.joined.order
        segments = cut(r, transport.kernels, parts)
        return [torch.cat([join(head + [seg[j] for j in order], r.joined) for seg in segments])]


def _all_to_all_transpose(op: AllToAll, flat: _tree.Flat, leaves: tuple[int, ...]) -> Transpose:
    """The same all-to-all of the output gradients: it is its own inverse
    (replica ``r``'s part ``s`` came from replica ``s``'s part ``r``)."""
    return Transpose(AllToAll(op.dim, name=f"{op.name} backward"))


TRANSPOSES[AllToAll] = _all_to_all_transpose
