"""The backend boundary, in two halves.

* :class:`Transport`: what a collectives engine provides. Its facts:
  ``device``, ``world``, ``kernels``, ``lazy`` (collectives run at a sync),
  ``broadcast_sums``, ``replica_threads``, ``group_key`` and
  ``group_object``; ``rank`` and ``rank_name``. Its collectives, each on a
  1-d buffer: ``all_gather``, ``all_reduce``, ``reduce_scatter``,
  ``all_to_all``, ``broadcast``; started by ``flush`` where they are
  recorded, completed by ``wait`` (eager engines) or ``sync`` (lazy ones).
  Its transfers: ``upload``, ``upload_all``, ``to_host``, ``fetch``,
  ``sync_and_fetch``; ``exchange`` and ``gathered_alone`` (a small gather
  run on its own). What a call's leaves need: ``validate``,
  ``own_buffers``. The guard's verdicts of calls in flight on a lazy
  engine, held until a sync has run their calls: ``defer`` and ``ready``
  (:func:`xcoll._guard.verdict.settle` reads them). A replica that exits: ``say_left``,
  ``left``.
* :class:`Kernels`: how packed buffers are built and cut on the engine's
  device: ``pack``, ``join`` and ``unjoin`` (a move's one buffer),
  ``encode_reduce`` (packed and encoded) and ``decode_reduce`` (a
  reduce's), ``parts`` (a leaf cut into W parts along its dim: a scatter's),
  ``keep`` (the rows a mask keeps), ``split`` and ``bitcast``. The torch
  implementation here serves every device; the XLA backend has its own, made of
  XLA computations (one graph node each instead of a torch call per leaf), and a
  test checks that both give the same bits.

Nothing here knows a device type, and this module imports nothing above it.
"""

from __future__ import annotations

import functools
import itertools
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from typing import Protocol

import torch

from .._base.tree import Flat
from .._encode import pack as _pack
from .._encode import wire as _wire


class EngineError(RuntimeError):
    """The engine could not complete a collective (a timeout, a closed
    connection): the public call reports it in its own words."""


class Kernels:
    """Packing kernels in torch ops that every device lowers.

    ``parts`` are a bucket's tensors (any shape; a reduce's merged bucket
    mixes dtypes, :func:`xcoll._core.ops.merged`), ``shapes`` their shapes,
    ``sizes`` a bucket's slot sizes (:attr:`xcoll._encode.pack.Bucket.sizes`).
    """

    def bitcast(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Reinterprets the bits of ``t`` as ``dtype`` (same element size)."""
        return t.view(dtype)

    def parts(self, t: torch.Tensor, dim: int, world: int) -> list[torch.Tensor]:
        """``t`` cut into ``world`` equal parts along ``dim``, bit for bit
        (views here)."""
        return list(t.tensor_split(world, dim))

    def pack(
        self,
        parts: Sequence[Sequence[torch.Tensor]],
        shapes: Sequence[Sequence[tuple[int, ...]]],
        dtypes: Sequence[torch.dtype],
    ) -> list[torch.Tensor]:
        """For each bucket, its ``parts`` (of ``shapes``) flattened and joined
        into one new 1-d tensor of its dtype (``dtypes``; a part of another
        dtype is converted exactly: it is narrower)."""
        return list(map(_pack.concat, parts, dtypes))

    def join(self, segments: Sequence[Sequence[torch.Tensor]], joined: _pack.Joined) -> torch.Tensor:
        """A move's segments (the header's part, then each live bucket's parts,
        in ``joined``'s order) as the bytes of one new int32 buffer of
        ``joined.words`` words (:class:`xcoll._encode.pack.Joined`). The bytes are
        copied as they are, so every dtype moves bit for bit."""
        if joined.words * 4 <= _pack.CAT_GRAIN:  # (one copy of each segment, on one thread)
            return _pack.cat_bytes(segments, joined.nbytes, joined.padded).view(torch.int32)
        out = torch.empty(joined.words, dtype=torch.int32, device=segments[0][0].device)
        raw = out.view(torch.uint8)
        at = 0
        for parts, dtype, n, padded in zip(
            segments, joined.dtypes, joined.nbytes, joined.padded, strict=True
        ):
            _pack.fill(raw[at : at + n].view(dtype), parts)
            raw[at + n : at + padded].zero_()
            at += padded
        return out

    def unjoin(
        self,
        result: torch.Tensor,
        joined: _pack.Joined,
        world: int | None,
        wire: bool = False,
        skip: int = 0,
    ) -> list[torch.Tensor]:
        """Inverse of :meth:`join` on the collective's result: each segment
        1-d, as its dtype (with ``wire``, as its integer wire form, for
        :func:`xcoll._encode.wire.decode_move` after a download). With ``world`` (a
        gather's ``(world * words,)`` result) each slot's ``(world, size)``
        block is contiguous, in slot order (:func:`xcoll._encode.pack.slot_major`):
        a gathered leaf is then one reshape away. The first ``skip`` segments
        (a header read already) are left out."""
        raw = result.view(torch.uint8)
        w = world or 1
        rows = raw.view(w, -1) if w > 1 else raw
        out = []
        layout = zip(joined.dtypes[skip:], joined.segments[skip:], strict=True)
        for dtype, (at, n, spans) in layout:
            # (each segment cut alone, its padding left behind: one copy of
            # each run of equal slots, none for a replica's own bytes)
            if w == 1:
                seg = raw[at : at + n]
            elif spans[1:] or spans[0][1] > 1:
                seg = _pack.slot_major(rows[:, at : at + n], spans)
            else:  # (one slot: its rows, one after another)
                seg = rows[:, at : at + n].reshape(-1)
            if wire:
                out += [seg.view(_wire.wire_dtype(dtype))]
            else:  # (a view of the bytes as the dtype is the torch bitcast)
                out += [seg != 0 if dtype == torch.bool else seg.view(dtype)]
        return out

    def encode_reduce(
        self,
        parts: Sequence[Sequence[torch.Tensor]],
        shapes: Sequence[Sequence[tuple[int, ...]]],
        dtypes: Sequence[torch.dtype],
        reductions: Sequence[str],
    ) -> list[torch.Tensor]:
        """Each bucket's ``parts`` packed (:meth:`pack`) in the form whose
        all-reduce by its reduction (``reductions``) gives the result
        (:func:`xcoll._encode.wire.encode_reduce`)."""
        packed = self.pack(parts, shapes, dtypes)
        return list(map(_wire.encode_reduce, packed, reductions, itertools.repeat(self.bitcast)))

    def decode_reduce(
        self,
        outs: Sequence[torch.Tensor],
        dtypes: Sequence[torch.dtype],
        reductions: Sequence[str],
        means: Sequence[Sequence[tuple[int, int]]],
        world: int,
    ) -> list[torch.Tensor]:
        """Inverse of :meth:`encode_reduce` on the all-reduced buffers, means
        divided by ``world`` (:func:`xcoll._encode.wire.decode_reduce`)."""
        bitcast, worlds = itertools.repeat(self.bitcast), itertools.repeat(world)
        return list(map(_wire.decode_reduce, outs, dtypes, reductions, bitcast, means, worlds))

    def keep(self, t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """A new tensor: ``t`` where the ``(1,)`` bool ``mask`` is true, zeros
        where it is false (NaN and infinities included)."""
        return torch.where(mask, t.reshape(-1), torch.zeros_like(t).reshape(-1)).reshape(t.shape)

    def split(
        self,
        flats: Sequence[torch.Tensor],
        shapes: Sequence[Sequence[tuple[int, ...]]],
        casts: Sequence[Sequence[torch.dtype | None]] | None = None,
    ) -> list[list[torch.Tensor]]:
        """Each 1-d tensor of ``flats`` cut into consecutive pieces of its
        ``shapes``, each piece cast to its dtype in ``casts`` (None: not cast)."""
        out = []
        for k, (flat, bucket_shapes) in enumerate(zip(flats, shapes, strict=True)):
            if not casts or not any(casts[k]):
                out += [_pack.split(flat, bucket_shapes)]
                continue
            pieces, at = [], 0  # (one cast per run of pieces of one dtype)
            for dtype, run in itertools.groupby(
                zip(bucket_shapes, casts[k], strict=True), lambda x: x[1]
            ):
                run_shapes = [shape for shape, _ in run]
                n = sum(map(_pack.numel, run_shapes))
                seg = flat[at : at + n]
                pieces += _pack.split(seg if dtype is None else _wire.cast_back(seg, dtype), run_shapes)
                at += n
            out.append(pieces)
        return out


#: The torch kernels (also what host buffers are cut with).
TORCH = Kernels()


class Deferred(Protocol):
    """The guard's verdict of a ``sync=False`` call on a lazy engine, which
    the engine holds until a sync has run the call (:meth:`Transport.defer`):
    all that the engine reads of it (:class:`xcoll._guard.verdict.Deferred`)."""

    @property
    def header(self) -> torch.Tensor:
        """The header's piece of the call's result, on the device."""


class Transport(ABC):
    """One replica's view of a collectives engine, for one call.

    Every collective takes a 1-d buffer that the transport may consume (it is
    a packed copy, never a caller's tensor) and returns a tensor on the
    buffer's device that holds the result once :meth:`wait` has returned. Lazy
    engines (XLA) trace it and run it at :meth:`sync`; eager ones start it
    asynchronously and finish every collective of the call in :meth:`wait`.
    """

    #: Device of the leaves; Python scalars are uploaded here.
    device: torch.device
    #: How this engine's device packs and cuts buffers.
    kernels: Kernels = TORCH
    #: Whether collectives are traced and run at :meth:`sync` (results are
    #: known only then) rather than run eagerly.
    lazy = False
    #: Whether :meth:`broadcast` sums its guard header over every replica
    #: (an all-reduce), rather than delivering ``src``'s.
    broadcast_sums = True
    #: Whether the replicas are threads of this process that compile their
    #: programs apart (XLA:CPU): a graph synced by one of them alone (an
    #: ``.item()`` of a pending output) aborts there.
    replica_threads = False

    @functools.cached_property
    def group_key(self) -> Hashable:
        """Names this replica's group of replicas within the process (what
        "a replica's first call on a group" is counted by)."""
        return (type(self).__name__, str(self.device))

    @property
    def group_object(self) -> object:
        """The object whose lifetime is the group's, where the engine has one
        (a torch.distributed process group); None: :attr:`group_key` names it
        for the life of the process."""
        return None

    @abstractmethod
    def rank(self) -> int: ...

    def rank_name(self, rank: int) -> str:
        """``rank`` (of this group) as messages name it."""
        return f"rank {rank}"

    #: The number of replicas in the group (fixed for the transport's life).
    world: int

    def upload(self, cpu: torch.Tensor) -> torch.Tensor:
        return cpu.to(self.device)

    def upload_all(self, cpus: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """:meth:`upload` of each of ``cpus`` (in one call where the engine can)."""
        return [self.upload(t) for t in cpus]

    @abstractmethod
    def all_gather(self, buf: torch.Tensor) -> torch.Tensor:
        """``(n,)`` -> ``(W * n,)``: every replica's buffer, in rank order."""

    @abstractmethod
    def all_reduce(self, buf: torch.Tensor, reduction: str) -> torch.Tensor:
        """Elementwise ``reduction`` ("sum", "prod", "max", "min") over all replicas."""

    @abstractmethod
    def reduce_scatter(self, buf: torch.Tensor, reduction: str) -> torch.Tensor:
        """``(W * n,)`` -> ``(n,)``: on replica ``r``, elementwise ``reduction``
        over every replica's ``r``-th ``n`` elements."""

    @abstractmethod
    def all_to_all(self, buf: torch.Tensor) -> torch.Tensor:
        """``(W * n,)`` -> ``(W * n,)``: on replica ``r``, every replica's
        ``r``-th ``n`` elements, in rank order."""

    @abstractmethod
    def broadcast(self, buf: torch.Tensor, src: int, guard: int = 0) -> torch.Tensor:
        """Replica ``src``'s integer buffer, bit for bit, on every replica;
        except its first ``guard`` elements: their sum over every replica if
        :attr:`broadcast_sums`, else ``src``'s too."""

    def validate(self, flat: Flat) -> None:
        """Refuses leaves this engine would change in transit (raises TypeError)."""

    def own_buffers(self, flat: Flat) -> list:
        """``flat.leaves``, with any leaf whose buffer a traced program would
        share with another value replaced by an equal tensor of its own (lazy
        engines only: eager ones run no program)."""
        return flat.leaves

    def wait(self) -> None:
        """Waits for the collectives started so far (lazy engines: nothing to wait for)."""

    def flush(self) -> None:
        """Sends the collectives recorded so far, where they are recorded
        (:class:`~xcoll._backends.hosted.Hosted`); an engine starts each as
        it is made."""

    def sync(self) -> None:
        """Runs everything traced so far (no-op for eager engines)."""

    def defer(self, verdict: Deferred) -> None:
        """Holds ``verdict`` (the guard of a ``sync=False`` call) until a
        sync has run its call (:meth:`ready`; lazy engines)."""
        raise NotImplementedError(f"{type(self).__name__} runs no graph: nothing waits for a sync")

    def say_left(self, text: str) -> None:
        """Tells the other replicas, where the engine keeps a place for it,
        that this process exits after ``text`` (its last call on the group:
        :mod:`xcoll._guard.leaving`). Replicas that exit together (XLA's
        threads) say nothing."""

    def left(self) -> list[tuple[int, str]]:
        """The ranks of this group that said they left (:meth:`say_left`),
        with their text."""
        return []

    def ready(self) -> list[Deferred]:
        """The deferred verdicts of this device whose calls a sync has run
        (their headers are data), taken, in the order of their calls; the
        others stay held. Eager engines defer nothing."""
        return []

    def to_host(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """CPU copies of ``tensors``, fetched together."""
        return list(map(torch.Tensor.cpu, tensors))

    def fetch(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """:meth:`sync_and_fetch` of ``tensors`` that are the caller's (a lazy
        engine syncs only where one of them is pending)."""
        return self.sync_and_fetch(tensors)

    def sync_and_fetch(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """:meth:`sync`, then :meth:`to_host` of ``tensors`` (outputs of what
        ran: the fetch is what waits for it to finish)."""
        self.sync()
        return self.to_host(tensors)

    def exchange(self, cpu: torch.Tensor) -> torch.Tensor:
        """Every replica's 1-d CPU ``cpu`` as a ``(W, n)`` CPU tensor, run on
        its own (:meth:`gathered_alone`). A buffer of fewer than
        :data:`~xcoll._encode.pack.SMALL` bytes is sent in that many, padded
        on the host, as the int32 words every small call sends
        (:class:`~xcoll._backends.hosted.Hosted`): one collective (on XLA one
        program) for them all, so replicas whose exchanges or calls differ
        still meet, and each reads what differs."""
        n = cpu.numel()
        if n * cpu.element_size() < _pack.SMALL:  # (every element size divides SMALL)
            small = cpu.new_zeros(_pack.SMALL // cpu.element_size())
            small[:n] = cpu
            cpu = small
        return self.gathered_alone(cpu)[:, :n]

    def gathered_alone(self, cpu: torch.Tensor) -> torch.Tensor:
        """Every replica's 1-d CPU ``cpu`` as a ``(W, n)`` CPU tensor, its
        all-gather run on its own: on lazy engines nothing else pending joins
        it (the caller's pending work may differ between replicas, as it does
        when their calls do)."""
        out = self.all_gather(self.upload(cpu))
        self.wait()
        self.sync()
        return self.to_host([out])[0].view(self.world, -1)


class LocalTransport(Transport):
    """A single process with no collectives engine: world size 1."""

    world = 1

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def rank(self) -> int:
        return 0

    def all_gather(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.clone()

    def all_reduce(self, buf: torch.Tensor, reduction: str) -> torch.Tensor:
        return buf.clone()

    def reduce_scatter(self, buf: torch.Tensor, reduction: str) -> torch.Tensor:
        return buf.clone()

    def all_to_all(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.clone()

    def broadcast(self, buf: torch.Tensor, src: int, guard: int = 0) -> torch.Tensor:
        return buf.clone()
