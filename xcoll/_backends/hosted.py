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
in rank order by the engine's reduction (an all-to-all and a
reduce-scatter take the same of each row's part addressed to the replica) (its buffers are in the encoded
form that makes that exact, :func:`xcoll._encode.wire.encode_reduce`); a
broadcast's ``src`` row, its guard header summed over every row (as the
engine's broadcast sums it).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from .._encode import pack as _pack
from .base import Transport

#: The engine's reductions, as the host folds a reduce's rows.
_FOLD: dict[str, Callable[..., torch.Tensor]] = {
    "sum": torch.add,
    "prod": torch.mul,
    "max": torch.maximum,
    "min": torch.minimum,
}


class Hosted(Transport):
    """``engine``'s collectives for one small call whose buffers are on the
    host: each collective is recorded, and :meth:`flush` (an eager engine's,
    as the call is made) or :meth:`wait` sends them all in one all-gather of
    :data:`~xcoll._encode.pack.SMALL` bytes."""

    lazy = False
    # (the header's rows are summed on the host, whatever the engine's broadcast does)
    broadcast_sums = True

    def __init__(self, engine: Transport, leaves: list[Any]):
        self.engine = engine
        self.device = torch.device("cpu")
        self.world = engine.world
        self._leaves = leaves
        #: The exchange's result, once :meth:`flush` has started it.
        self._rows: torch.Tensor | None = None
        #: Per collective: its buffer, its result (filled by wait), how it
        #: combines its rows (``combine``: "gather", "broadcast" or a reduce's
        #: reduction), src, guard, and whether each replica takes only its
        #: part of each row (an all-to-all's, a reduce-scatter's).
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

    def all_reduce(self, buf: torch.Tensor, reduction: str) -> torch.Tensor:
        return self._later(buf, torch.empty_like(buf), reduction)

    def reduce_scatter(self, buf: torch.Tensor, reduction: str) -> torch.Tensor:
        return self._later(buf, buf.new_empty(buf.numel() // self.world), reduction, scatter=True)

    def all_to_all(self, buf: torch.Tensor) -> torch.Tensor:
        return self._later(buf, torch.empty_like(buf), "gather", scatter=True)

    def broadcast(self, buf: torch.Tensor, src: int, guard: int = 0) -> torch.Tensor:
        return self._later(buf, torch.empty_like(buf), "broadcast", src, guard)

    def _later(self, buf, out, combine: str, src: int = 0, guard: int = 0, scatter: bool = False):
        self._sent.append((buf, out, combine, src, guard, scatter))
        return out

    def flush(self) -> None:
        """Starts the one all-gather of what was recorded, on an eager
        engine (a lazy engine's runs at :meth:`wait`, as a program of its
        own): the call's collectives are then all started."""
        # (an eager engine's hosted call is on the host: nothing to upload)
        if self._sent and self._rows is None and not self.engine.lazy:
            self._rows = self.engine.all_gather(self._joined(self._sent))

    def wait(self) -> None:
        """Sends every recorded buffer (unless :meth:`flush` has) in one
        all-gather of exactly :data:`~xcoll._encode.pack.SMALL` bytes (zeros
        after them), and makes each result from the rows."""
        sent, rows, self._sent, self._rows = self._sent, self._rows, [], None
        if not sent:
            return
        if rows is None:  # (a lazy engine's program of int32 words)
            rows = self.exchange(self._joined(sent).view(torch.int32)).view(torch.uint8)
        else:  # (on the host already)
            self.engine.wait()
        rows = rows.view(self.world, -1)
        at = 0
        for buf, out, combine, src, guard, scatter in sent:
            n = buf.nbytes
            got = rows[:, at : at + n].contiguous().view(buf.dtype)
            at += n
            if scatter:  # (each row's part addressed to this replica)
                got = got.view(self.world, self.world, -1)[:, self.rank()]
            if combine == "gather":
                out.copy_(got.reshape(-1))
            elif combine == "broadcast":
                out.copy_(got[src])
                if guard:
                    _fold(got[:, :guard], "sum", out[:guard])
            else:
                _fold(got, combine, out)

    @staticmethod
    def _joined(sent: list) -> torch.Tensor:
        """The recorded buffers' bytes, one after another, in
        :data:`~xcoll._encode.pack.SMALL` bytes."""
        padded = torch.zeros(_pack.SMALL, dtype=torch.uint8)
        at = 0
        for buf, *_ in sent:
            raw = _bytes(buf)
            n = raw.shape[0]
            padded[at : at + n] = raw
            at += n
        return padded

    # (copies, as a lazy engine's fetch makes: each output's storage its own,
    # not a view of the call's results; an eager engine's outputs are views
    # of its results, as its own collectives' are)
    def sync_and_fetch(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return self.to_host(tensors) if self.engine.lazy else list(tensors)

    def to_host(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [t.clone() for t in tensors]

    def exchange(self, cpu: torch.Tensor) -> torch.Tensor:
        return self.engine.exchange(cpu)


def _bytes(buf: torch.Tensor) -> torch.Tensor:
    """1-d ``buf``'s bytes (a one-element buffer may be an expanded leaf of
    stride 0, which a view as bytes refuses)."""
    if buf.stride() != (1,):
        buf = buf.clone(memory_format=torch.contiguous_format)
    return buf.view(torch.uint8)


def _fold(rows: torch.Tensor, reduction: str, out: torch.Tensor) -> None:
    """``out`` = ``reduction`` over ``rows`` (``(W, n)``), in rank order: the same
    on every replica, which all hold the same rows."""
    out.copy_(rows[0])
    fold = _FOLD[reduction]
    for k in range(1, rows.shape[0]):  # (indexed: a tensor's iterator is Python code)
        fold(out, rows[k], out=out)
