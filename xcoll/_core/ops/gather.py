"""The gather and its dual, the reduce-scatter, each the other's backward:
every replica's leaves, stacked or concatenated along ``dim``, in one
all-gather (:class:`Gather`); and on replica ``r`` the reduction of every
replica's part ``r`` of each leaf, a reduce sent as W segments
(:class:`ReduceScatter`, :mod:`xcoll._core.ops.parts`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..._backends.base import TORCH
from ..._base import tree as _tree
from ..._encode import wire as _wire
from ..._guard import check as _check
from .base import Move, laid_out
from .parts import cut, parts
from .reduce import Reduce


def gather_params(dim: Any, stack: bool, uneven: bool, max_size: int | None) -> str:
    """A gather's parameters, even or uneven, as its call's head names them
    (:meth:`Op.head`: one text, so that the check compares the two kinds)."""
    return f"dim={dim} stack={stack} uneven={uneven} max_size={max_size}"


def check_dim(dim: Any) -> None:
    """Refuses a ``dim`` that is not an int (checked on every call, where a
    plan is looked up: True would find dim=1's plan)."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {dim!r}")


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

    def backward(self, flat, leaves):
        """A reduce-scatter sum of the output gradients, each with its
        replicas' axis first (:meth:`sent`): every replica's own rows of the
        summed gradient."""
        return ReduceScatter("sum", dim=0, name=f"{self.name} backward")

    def backward_dims(self, flat, leaves):
        """Per leaf, the output dim that holds the replicas (0 for a 0-d leaf)."""
        return tuple(self._dim(flat, i) if flat.leaves[i].dim() else 0 for i in leaves)

    def sent(self, grads, dims):
        return [g.movedim(d, 0) if d else g for g, d in zip(grads, dims, strict=True)]

    def take(self, reduced, dims, shapes, transport, sizes):
        """This replica's own rows of the summed gradient, its axis moved back."""
        return [
            (g.movedim(0, d) if d else g).reshape(shape)
            for g, d, shape in zip(reduced, dims, shapes, strict=True)
        ]


@dataclass(frozen=True)
class ReduceScatter(Reduce):
    """On replica ``r``, the elementwise reduction by ``op`` of every
    replica's part ``r`` of each leaf (cut along ``dim``): one reduce-scatter
    per (dtype, op) bucket, encoded as a reduce's (:class:`Reduce`)."""

    op: Any = "sum"
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
        ops = _tree.broadcast_prefix(self.op, flat, "op")
        # (the leaves as the caller passed them; each one's dim, where not 0)
        dims = {i: self.dim % leaf.dim() for i, leaf in enumerate(flat.leaves)}
        return dataclasses.replace(
            plan,
            description=_check.describe(flat, ops=ops),
            moved={i: d for i, d in dims.items() if d},
        )

    def send(self, transport, wire, k, r):
        return transport.reduce_scatter(wire, r.ops[k])

    def backward(self, flat, leaves):
        """A gather of the output gradients along ``dim``: each replica's
        reduced part is every replica's sum (a mean's: divided by W, in
        :meth:`take`) of the parts it was made from."""
        return Gather(self.dim, name=f"{self.name} backward")

    def backward_dims(self, flat, leaves):
        """Per leaf, whether its op is the mean."""
        ops = _tree.broadcast_prefix(self.op, flat, "op")
        return tuple(ops[i] == "mean" for i in leaves)

    def take(self, reduced, dims, shapes, transport, sizes):
        return [g / transport.world if mean else g for g, mean in zip(reduced, dims, strict=True)]

    def wires(self, r, transport, parts, head):
        own = head[0] if head else []
        segments = cut(r, transport.kernels, parts)
        buckets = [
            [t for seg in segments for t in (own if k == 0 else []) + seg[k]]
            for k in range(len(parts))
        ]
        shapes = tuple(s * r.world for s in r.part_shapes)
        return transport.kernels.encode_reduce(buckets, shapes, r.dtypes, r.ops)
