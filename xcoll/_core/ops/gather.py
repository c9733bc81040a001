"""The gather: every replica's leaves, stacked or concatenated along
``dim``, in one all-gather (:class:`Gather`); and the transposes of the
gather and of its dual, the reduce-scatter (:mod:`xcoll._core.ops.reduce_scatter`),
each the other's backward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..._backends.base import TORCH
from ..._base import tree as _tree
from ..._encode import wire as _wire
from ..._guard import check as _check
from .base import TRANSPOSES, Move, Transpose, laid_out
from .parts import check_dim
from .reduce_scatter import Means, ReduceScatter


def gather_params(dim: Any, stack: bool, uneven: bool, max_size: int | None) -> str:
    """A gather's parameters, even or uneven, as its call's head names them
    (:meth:`Op.head`: one text, so that the check compares the two kinds)."""
    return f"dim={dim} stack={stack} uneven={uneven} max_size={max_size}"


@dataclass(frozen=True)
class Gather(Move):
    """Every replica's leaves, stacked or concatenated along ``dim``: one
    all-gather; a Python scalar's output is the list of every replica's."""

    dim: int = 0
    stack: bool = False
    grad: bool = False
    name: str = "xcoll.gather"
    carries = "gathered"

    def head(self, sync, to_cpu):
        # (gather_params' text, written out: a call's head is made on every call)
        params = f"dim={self.dim} stack={self.stack} uneven=False max_size=None"
        return f"{params} {super().head(sync, to_cpu)}"

    def key(self, flat, world):
        if self.dim.__class__ is not int:  # (an int makes no call)
            check_dim(self.dim)
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
        return laid_out(flat, dtypes, dtypes, (world,), shape, _check.describe(flat), moved=moved)

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

    def rows(self, world):
        return world

    def scalar(self, value, dtype):
        return torch.tensor([value], dtype=dtype)

    def python(self, block, leaf):
        return [_tree.to_python(v, leaf) for v in block]

    def finish(self, r, leaf, t):
        """``(W, *shape)`` to ``(*shape[:d], W, *shape[d:])`` for a leaf whose
        replica axis moves to ``d``, concatenated unless it stacks."""
        d = r.moved.get(leaf)
        if not d:
            return t
        t = t.movedim(0, d)
        if self.stack:
            return t
        pre = t.shape
        return t.reshape(*pre[:d], r.world * pre[d + 1], *pre[d + 2 :])

    def send(self, transport, wire, k, r):
        return transport.all_gather(wire)

    def alone(self, transport, leaf):
        # (the leaf's bytes, which a gather only reads)
        return _wire.encode_move(leaf.contiguous().reshape(-1), TORCH.bitcast)


@dataclass(frozen=True)
class Moved(Transpose):
    """A gather's backward rule: each output gradient's replicas' axis moved
    first (:meth:`sent`), and back in this replica's own rows (:meth:`take`)."""

    #: Per travelling leaf, the output dim that holds the replicas (0 for a 0-d leaf).
    dims: tuple[int, ...] = ()

    def sent(self, grads):
        return [g.movedim(d, 0) if d else g for g, d in zip(grads, self.dims, strict=True)]

    def take(self, reduced, shapes, transport, sizes):
        """This replica's own rows of the summed gradient, its axis moved back."""
        return [
            (g.movedim(0, d) if d else g).reshape(shape)
            for g, d, shape in zip(reduced, self.dims, shapes, strict=True)
        ]


def _gather_transpose(op: Gather, flat: _tree.Flat, leaves: tuple[int, ...]) -> Transpose:
    """A reduce-scatter sum of the output gradients, each with its replicas'
    axis first: every replica's own rows of the summed gradient."""
    dims = tuple(op._dim(flat, i) if flat.leaves[i].dim() else 0 for i in leaves)
    return Moved(ReduceScatter("sum", dim=0, name=f"{op.name} backward"), dims=dims)


def _reduce_scatter_transpose(
    op: ReduceScatter, flat: _tree.Flat, leaves: tuple[int, ...]
) -> Transpose:
    """A gather of the output gradients along ``dim``: each replica's reduced
    part is every replica's sum (a mean's: divided by W) of the parts it was
    made from."""
    reductions = _tree.broadcast_prefix(op.reduction, flat, "op")
    means = tuple(reductions[i] == "mean" for i in leaves)
    return Means(Gather(op.dim, name=f"{op.name} backward"), means=means)


TRANSPOSES[Gather] = _gather_transpose
TRANSPOSES[ReduceScatter] = _reduce_scatter_transpose
