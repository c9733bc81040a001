"""The broadcast: ``src``'s leaves on every replica, in one collective (its
rules: :class:`Broadcast`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..._backends.base import TORCH, Transport
from ..._base import memo as _memo
from ..._base import tree as _tree
from ..._encode import wire as _wire
from ..._guard import check as _check
from .base import TRANSPOSES, Move, Transpose, laid_out, leaf_shape
from .reduce import summed


@dataclass(frozen=True)
class Broadcast(Move):
    """``src``'s leaves, on every replica: one broadcast (on XLA, an integer
    all-reduce sum with zeros from every replica but ``src``)."""

    src: int = 0
    grad: bool = False
    name: str = "xcoll.broadcast"
    carries = "broadcast"

    def head(self, sync, to_cpu):
        return f"src={self.src} {super().head(sync, to_cpu)}"

    def validate(self, flat, transport, sync, to_cpu):
        w = transport.world
        src = self.src
        if src.__class__ is not int and (isinstance(src, bool) or not isinstance(src, int)):
            raise ValueError(f"src={src!r} is not a replica rank: world size is {w}")
        if not 0 <= src < w:
            raise ValueError(f"src={self.src!r} is not a replica rank: world size is {w}")

    def key(self, flat, world):
        return ("broadcast", flat.key)

    def plan(self, flat, world):
        dtypes = [_tree.dtype_of(leaf) for leaf in flat.leaves]
        return laid_out(flat, dtypes, dtypes, (), leaf_shape(flat), _check.describe(flat))

    def send(self, transport, wire, k, r):
        return transport.broadcast(wire, self.src, r.guard.size if r.guard and k == 0 else 0)

    def alone(self, transport, leaf):
        # (written in place: src's own copy, as its output must not alias its
        # input; a receiver's empty buffer)
        if transport.rank() == self.src:
            own = leaf.clone(memory_format=torch.contiguous_format)
        else:
            own = torch.empty(leaf.shape, dtype=leaf.dtype, device=leaf.device)
        return _wire.encode_move(own.reshape(-1), TORCH.bitcast)  # (a view: contiguous)


@dataclass(frozen=True)
class Kept(Transpose):
    """A broadcast's backward rule: the summed gradient on ``src``, zeros elsewhere."""

    src: int = 0

    def take(self, reduced, shapes, transport, sizes):
        mask = _mask(transport, transport.rank() == self.src)
        return [transport.kernels.keep(g, mask) for g in reduced]


def _broadcast_transpose(op: Broadcast, flat: _tree.Flat, leaves: tuple[int, ...]) -> Transpose:
    """An all-reduce sum of the output gradients, kept on ``src``."""
    return Kept(summed(op, flat, leaves), src=op.src)


TRANSPOSES[Broadcast] = _broadcast_transpose


# (device, whether it is src) -> the backward's (1,) mask: uploaded data, 1-d
# (torch_xla shares 0-d uploads with equal values), so that on XLA every
# replica traces one program.
_uploads: _memo.Memo[torch.Tensor] = _memo.Memo(locked=True)


def _mask(transport: Transport, keep: bool) -> torch.Tensor:
    key = (str(transport.device), keep)
    return _uploads.get(key, lambda: transport.upload(torch.tensor([keep])))
