"""The gather: every replica's leaves, stacked or concatenated along
``dim``, in one all-gather (its rules: :class:`Gather`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..._backends.base import TORCH, Transport
from ..._base import memo as _memo
from ..._base import tree as _tree
from ..._encode import wire as _wire
from ..._guard import check as _check
from .base import Move, laid_out


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
    name = "xcoll.gather"

    def head(self, sync, to_cpu):
        return f"{gather_params(self.dim, self.stack, False, None)} {super().head(sync, to_cpu)}"

    def key(self, flat, world):
        # (checked here, on every call: True would find dim=1's plan)
        dim = self.dim
        if dim.__class__ is not int and (isinstance(dim, bool) or not isinstance(dim, int)):
            raise TypeError(f"dim must be an int, got {dim!r}")
        return ("gather", dim, self.stack, world, flat.key)

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

    def header_parts(self, values, dtype, how, world):
        part, wire, _ = super().header_parts(values, dtype, how, world)
        wire = wire.expand(world, -1)  # (every replica's, in rank order)
        return part, wire, wire

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

    def backward_dims(self, flat, leaves):
        """Per leaf, the output dim that holds the replicas and the leaf's
        extent along it (1 where it stacks, or is 0-d)."""
        out = []
        for i in leaves:
            leaf = flat.leaves[i]
            d = self._dim(flat, i) if leaf.dim() else 0
            out.append((d, 1 if self.stack or not leaf.dim() else leaf.shape[d]))
        return tuple(out)

    def take(self, reduced, dims, shapes, transport, sizes):
        """This replica's own rows of the summed gradient (a reduce-scatter)."""
        return [
            g.index_select(d, _own_rows(transport, n)).reshape(shape)
            for g, (d, n), shape in zip(reduced, dims, shapes, strict=True)
        ]


# (device, rank, n) -> this replica's rows of a gathered leaf of n rows, for the backward's
# take: uploaded data, 1-d (torch_xla shares 0-d uploads with equal values),
# so that on XLA every replica traces one program.
_uploads: _memo.Memo[torch.Tensor] = _memo.Memo(locked=True)


def _own_rows(transport: Transport, n: int) -> torch.Tensor:
    r = transport.rank()
    key = (str(transport.device), r, n)
    return _uploads.get(key, lambda: transport.upload(torch.arange(r * n, (r + 1) * n)))
