"""A small call on a lazy engine: packed and cut on the host, around one
program that is the same for every such call on every replica.

On XLA a call's pack, collectives and cut are one traced program, and
replicas whose calls differ in their buffers' sizes (a metrics dict without
a key, a leaf in float64 against float32) compile different programs, which
XLA cannot pair: it aborts the process. A call whose buffers fit in
:data:`xcoll._encode.pack.SMALL` bytes runs on the host instead (the torch
kernels, as on an eager engine), and its collectives are one all-gather of
exactly that many bytes: one program per world size, compiled once. Replicas
whose calls differ then still meet, and the guard's header names the
difference on every replica.

Each collective's result is made from the gathered rows on the host, as the
engine would make it: a gather's rows in rank order; a reduce's rows folded
in rank order by the engine's elementwise op (an all-to-all and a
reduce-scatter take the same of each row's part addressed to the replica) (its buffers are in the encoded
form that makes that exact, :func:`xcoll._encode.wire.encode_reduce`); a
broadcast's ``src`` row, its guard header summed over every row (as the
engine's broadcast sums it).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch

from .._encode import pack as _pack
from .base import Transport

#: The engine's all-reduce ops, as the host folds a reduce's rows.
_FOLD: dict[str, Callable[..., torch.Tensor]] = {
    "sum": torch.add,
    "prod": torch.mul,
    "max": torch.maximum,
    "min": torch.minimum,
}


class Hosted(Transport):
    """``engine``'s collectives for one small call whose buffers are on the
    host: each collective is recorded, and :meth:`wait` sends them all in one
    all-gather of :data:`~xcoll._encode.pack.SMALL` bytes."""

    lazy = False

    def __init__(self, engine: Transport, leaves: Sequence[object]):
        self.engine = engine
        self.device = torch.device("cpu")
        self.world = engine.world
        self.broadcast_sums = engine.broadcast_sums
        self._leaves = list(leaves)
        #: Per collective: its buffer, its result (filled by wait), how it
        #: combines ("gather", "broadcast" or a reduce's op), src, guard, and
        #: whether each replica takes only its part of each row (an
        #: all-to-all's, a reduce-scatter's).
        self._sent: list[tuple[torch.Tensor, torch.Tensor, str, int, int, bool]] = []

    @property
    def group_key(self) -> Hashable:
        return self.engine.group_key

    @property
    def group_object(self) -> object:
        return self.engine.group_object

    def rank(self) -> int:
        return self.engine.rank()

    def rank_name(self, rank: int) -> str:
        return self.engine.rank_name(rank)

    def upload(self, cpu: torch.Tensor) -> torch.Tensor:
        return cpu

    def own_buffers(self, flat) -> list:
        return self._leaves

    def all_gather(self, buf: torch.Tensor) -> torch.Tensor:
        return self._later(buf, buf.new_empty(self.world * buf.numel()), "gather")

    def all_reduce(self, buf: torch.Tensor, op: str) -> torch.Tensor:
        return self._later(buf, torch.empty_like(buf), op)

    def reduce_scatter(self, buf: torch.Tensor, op: str) -> torch.Tensor:
        return self._later(buf, buf.new_empty(buf.numel() // self.world), op, scatter=True)

    def all_to_all(self, buf: torch.Tensor) -> torch.Tensor:
        return self._later(buf, torch.empty_like(buf), "gather", scatter=True)

    def broadcast(self, buf: torch.Tensor, src: int, guard: int = 0) -> torch.Tensor:
        return self._later(buf, torch.empty_like(buf), "broadcast", src, guard)

    def _later(self, buf, out, how: str, src: int = 0, guard: int = 0, scatter: bool = False):
        self._sent.append((buf, out, how, src, guard, scatter))
        return out

    def wait(self) -> None:
        """Sends every recorded buffer in one all-gather of exactly
        :data:`~xcoll._encode.pack.SMALL` bytes (zeros after them), run on
        its own, and makes each result from the rows."""
        sent, self._sent = self._sent, []
        if not sent:
            return
        raw = [buf.contiguous().view(torch.uint8) for buf, *_ in sent]
        padded = torch.zeros(_pack.SMALL, dtype=torch.uint8)
        torch.cat(raw, out=padded[: sum(r.numel() for r in raw)])
        rows = self.exchange(padded.view(torch.int32)).view(torch.uint8)
        at = 0
        for r, (buf, out, how, src, guard, scatter) in zip(raw, sent, strict=True):
            got = rows[:, at : at + r.numel()].contiguous().view(buf.dtype)
            at += r.numel()
            if scatter:  # (each row's part addressed to this replica)
                got = got.view(self.world, self.world, -1)[:, self.rank()]
            if how == "gather":
                out.copy_(got.reshape(-1))
            elif how == "broadcast":
                out.copy_(got[src])
                if guard:
                    _fold(got[:, :guard], "sum", out[:guard])
            else:
                _fold(got, how, out)

    # (copies, as a fetch makes: each output's storage its own, not a view
    # of the call's rows, which hold every dtype of the call)
    def sync_and_fetch(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return self.to_host(tensors)

    def to_host(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [t.clone() for t in tensors]

    def exchange(self, buf: torch.Tensor) -> torch.Tensor:
        return self.engine.exchange(self.engine.upload(buf))


def _fold(rows: torch.Tensor, op: str, out: torch.Tensor) -> None:
    """``out`` = ``op`` over ``rows`` (``(W, n)``), in rank order: the same
    on every replica, which all hold the same rows."""
    out.copy_(rows[0])
    for row in rows[1:]:
        _FOLD[op](out, row, out=out)
