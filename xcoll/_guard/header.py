"""The guard's header: every call's first collective carries a fingerprint of
the call, and every replica checks what arrived before it returns anything
(the verdict's error: :mod:`~xcoll._guard.verdict`).

The fingerprint is 64 bits of the SHA-256 of the call's signature (function,
parameters, every leaf's path, dtype, shape and reduction, the tree structure), the
same digest the full consistency check compares, so it costs nothing per call
once the plan is cached. It travels as a header at the front of the call's
first bucket, in that bucket's dtype, inside the collective the call makes
anyway: no extra collective, and on XLA no extra execution (the header is
uploaded once per signature, as data, so that every replica traces the same
program whatever its fingerprint).

The header's form makes the verdict the same on every replica: each one
compares the header part of the collective's result, which is the same on
every replica, with what it would be if every replica's fingerprint were its
own (bytes against bytes, computed once per signature). It is as short as the
collective's arithmetic allows (:func:`own_size`, :func:`alike_size`): small reduces stay small.

* gather, and broadcast on torch.distributed (a star from ``src``, where an
  all-reduce would cost 15x at W=4 on gloo: docs/reliability.md): the 8 bytes
  themselves, as two wire words. A gather's receives all W; they are W copies
  of its own only if every fingerprint is its own. The broadcast's receivers
  compare ``src``'s with their own; ``src`` learns nothing, and returns its
  own tree, which is its result whatever the others did. This is the one
  one-sided verdict (a small call on the host sums it instead, as XLA's
  broadcast does: :mod:`xcoll._backends.hosted`).
* an all-reduce sum (reduce, mean, and broadcast on XLA, an integer sum with
  zeros from every replica but ``src``): the 64 bits cut into values ``v`` of
  ``k`` bits, each followed later by ``v**2``. Every replica's ``v`` equal
  gives ``(W v, W v**2)``; a replica that gets that holds ``sum (v_i - v)**2 =
  sum v_i**2 - 2 v sum v_i + W v**2 = 0``, so every ``v_i`` is its ``v``.
  ``k`` is the most bits with ``W (2**k - 1)**2`` exact in the bucket's dtype;
  where that is ``k = 1``, ``v`` alone (a sum of bits is ``W b`` only if all
  are ``b``), and then 8-bit integers wrap at 256 without harm up to W = 255
  (above that, every call is also checked in full, :data:`EXACT_SUMS`).
* max and min: values ``v`` of ``k`` bits and ``c - v`` (``c = 2**k - 1``,
  ``k`` the most bits the dtype holds exactly): ``max v = v`` and ``max (c -
  v) = c - v`` only if ``min v = max v``; the same for min.
* prod: each bit ``b`` and ``1 - b``: ``prod`` of bits is their min.

Whatever reduction each replica asked for, a differing value gives no replica its
expected pattern (a reduction that differs is in the fingerprint too).

The header goes at the front: where an engine delivers part of a larger
buffer (gloo, when sizes differ), the front is what arrives.
"""

from __future__ import annotations

import dataclasses
import functools
import struct
from dataclasses import dataclass

import torch

from .._backends.base import TORCH, Transport
from .._base import memo as _memo
from .._base import tree as _tree
from .._encode import wire as _wire
from . import check as _check
from . import exchange as _exchange

BITS = 64
#: The most replicas whose header sums are exact in every dtype (8-bit integers
#: wrap at 256); above it every call is checked in full as well.
EXACT_SUMS = 255


@dataclass(frozen=True)
class Signature:
    """What a call's replicas must agree on: its function, tag, parameters and tree."""

    name: str
    head: str
    description: _check.Description
    #: The call's step tag (:mod:`xcoll._guard.steps`), "" for an untagged call.
    tag: str = ""
    #: The call's number among this thread's calls on its group (not in the
    #: fingerprint: a backward's tag names its forward by it).
    number: int = 0

    def fingerprint(self) -> bytes:
        key = (self.name, self.head, self.description.digest)
        base = _fingerprints.get(key, lambda: _exchange.sha256("\n".join(key[:2] + (key[2].hex(),))))
        # (not kept: a tagged fingerprint is made where its header is not, :meth:`header`)
        return _exchange.sha256(base.hex() + "\n" + self.tag) if self.tag else base

    def header(self, g: Guard, transport: Transport) -> Header:
        """The call's :class:`Header` under guard ``g``, its part on
        ``transport``'s device (uploaded as data, so that replicas with
        different headers trace the same program); kept per signature and
        device, and a tagged call's per tag, apart: a step of a fixed name
        repeats its calls' tags step after step, one named by its batch
        index makes new ones each step, which then fill their own cache only."""
        # (the guard's fields, not the guard: a dataclass's hash is a Python call)
        d, kind = self.description.digest, (g.carries, g.dtype, g.reduction, g.world)
        key = (self.name, self.head, d, *kind, transport.device, self.tag)
        kept = _tagged if self.tag else _headers
        return kept.hit(key) or kept.get(key, lambda: _on(transport, _build(self.fingerprint(), g)))


#: How a collective carries the header, one value per collective
#: (:attr:`xcoll._core.ops.Packed.carries`): "gathered", every replica's
#: int32 words, in rank order (a gather, an all-to-all); "broadcast",
#: ``src``'s int32 words, or their sum over every replica where the engine
#: sums a broadcast's header; "reduced", at the front of bucket 0, in its
#: dtype, combined by its all-reduce's reduction (a reduce, a reduce-scatter).
CARRIES = ("gathered", "broadcast", "reduced")


@dataclass(frozen=True)
class Guard:
    """A call's guard header, as its recipe lays it out: what the executor
    sends and reads (:mod:`xcoll._guard.verdict` reads it)."""

    #: How the collective carries it (:data:`CARRIES`).
    carries: str
    dtype: torch.dtype
    #: The reduction the collective combines it by (:func:`own_size`): the
    #: all-reduce's, "sum" for a broadcast that sums, "" where its bytes
    #: arrive as sent.
    reduction: str
    size: int
    #: When the verdict is read: "first" (eager engines: the first
    #: collective's header, downloaded before the others start), "last" (a
    #: receiver of a one-sided broadcast: after every collective, as src
    #: makes them), "outputs" (lazy engines: fetched with the outputs).
    when: str
    world: int

    @property
    def rows(self) -> int:
        """The rows of the first collective's result: W for a gathered
        header (every replica's row), else 1."""
        return self.world if self.carries == "gathered" else 1


def guard(carries: str, dtype: torch.dtype, reduction: str, sums: bool, world: int, lazy: bool) -> Guard:
    """The :class:`Guard` of a collective that carries its header as
    ``carries`` says, at ``world`` replicas, on a ``lazy`` engine or an eager
    one; ``dtype`` and ``reduction``: its bucket 0's dtype and its
    all-reduce's reduction (a "reduced" header's); ``sums``: whether the
    engine's broadcast sums its header.

    Raises:
        ValueError: ``carries`` is not one of :data:`CARRIES` (a collective
            whose header no verdict could read).
    """
    if carries not in CARRIES:
        raise ValueError(f"a collective carries its guard header as one of {CARRIES}, not {carries!r}")
    if carries == "reduced":
        size = alike_size(dtype, reduction, world)
    else:
        reduction = "sum" if carries == "broadcast" and sums else ""
        dtype, size = torch.int32, own_size(torch.int32, reduction, world)
    one_sided = carries == "broadcast" and not reduction  # (only the receivers learn it)
    when = "outputs" if lazy else "last" if one_sided else "first"
    return Guard(carries, dtype, reduction, size, when, world)


_fingerprints: _memo.Memo[bytes] = _memo.Memo()


@functools.cache
def own_size(dtype: torch.dtype, reduction: str, world: int) -> int:
    """The number of header values (:func:`_values`) in a bucket of ``dtype``
    combined by ``reduction`` at ``world`` replicas."""
    return len(_values(_ZERO, dtype, reduction, world))


@functools.cache
def alike_size(dtype: torch.dtype, reduction: str, world: int) -> int:
    """A reduce's header size: it depends on the dtype's width alone, except
    for prod, so that replicas whose dtypes of one width or whose reductions
    (prod aside) differ still make collectives of one size, which the verdict
    names, instead of the engine's failure."""
    if reduction == "prod":
        return own_size(dtype, reduction, world)
    alike = [d for d in _tree.SUPPORTED_DTYPES if d.itemsize == dtype.itemsize]
    return max(own_size(d, r, world) for d in alike for r in _ALIKE)


_ZERO = bytes(BITS // 8)
#: The reductions whose headers are sized alike (prod's is its own).
_ALIKE = ("sum", "max", "min")


def _width(dtype: torch.dtype, reduction: str, world: int) -> int:
    """The bits of the fingerprint per header value of a reduce (:func:`_values`)."""
    exact = (  # the largest integer up to which dtype holds every integer
        2 * round(1 / torch.finfo(dtype).eps)
        if dtype.is_floating_point
        else 1
        if dtype == torch.bool
        else torch.iinfo(dtype).max
    )
    if reduction in ("max", "min"):
        return min(BITS, (exact + 1).bit_length() - 1)
    k = 1
    while k < BITS and world * ((1 << (k + 1)) - 1) ** 2 <= exact:
        k += 1
    return k


def _values(fingerprint: bytes, dtype: torch.dtype, reduction: str, world: int) -> list[int]:
    """The header's values for ``fingerprint`` (see the module's docstring)."""
    if reduction == "":  # (a gather's, and a one-sided broadcast's) its bytes, as two int32 words
        return list(struct.unpack("<2i", fingerprint[: BITS // 8]))
    n = int.from_bytes(fingerprint[: BITS // 8], "little")
    if reduction == "prod":
        bits = [(n >> j) & 1 for j in range(BITS)]
        return [*bits, *(1 - b for b in bits)]
    k = _width(dtype, reduction, world)
    chunks = [(n >> j) & ((1 << k) - 1) for j in range(0, BITS, k)]
    if reduction == "sum":
        return chunks if k == 1 else [*chunks, *(v * v for v in chunks)]
    return [*chunks, *((1 << k) - 1 - v for v in chunks)]


@dataclass(frozen=True)
class Header:
    """One call kind's header for one fingerprint, bucket dtype, reduction and W."""

    #: What this replica sends, in the bucket's dtype (a part of its bucket),
    #: on the transport's device.
    part: torch.Tensor
    #: The bytes of the collective's result where the header lies, in wire
    #: form (eager engines: read before the call's other collectives start)
    #: and as the bucket's dtype (lazy ones: read with the outputs), when every
    #: replica's fingerprint is this one's.
    wire: bytes
    decoded: bytes


_headers: _memo.Memo[Header] = _memo.Memo(locked=True)
_tagged: _memo.Memo[Header] = _memo.Memo(256, locked=True)


def _build(fingerprint: bytes, g: Guard) -> Header:
    """The :class:`Header` of ``fingerprint`` under guard ``g``, as the
    module's docstring says (on the host)."""
    values = _values(fingerprint, g.dtype, g.reduction, g.world)
    values += [0] * (g.size - len(values))  # (0 under every reduction)
    part, wire, decoded = _parts(values, g)
    return Header(part, as_bytes(wire), as_bytes(decoded))


def _parts(values: list[int], g: Guard) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The header's part (what this replica sends), and the collective's
    result where the header lies when every replica sends the same part,
    in wire form and decoded (a move's: its int32 wire words)."""
    part = torch.tensor(values, dtype=g.dtype)
    if g.carries == "reduced":
        wire = _wire.encode_reduce(part.clone(), g.reduction, TORCH.bitcast)
        if g.reduction == "sum":
            wire = wire * g.world
        return part, wire, _wire.decode_reduce(wire.clone(), g.dtype, g.reduction, TORCH.bitcast)
    if g.carries == "gathered":
        wire = part.expand(g.world, -1)  # (every replica's, in rank order)
    else:
        wire = part * g.world if g.reduction == "sum" else part
    return part, wire, wire


def _on(transport: Transport, h: Header) -> Header:
    """``h`` with its part on ``transport``'s device."""
    if h.part.device == transport.device:
        return h
    return dataclasses.replace(h, part=transport.upload(h.part))


def as_bytes(t: torch.Tensor) -> bytes:
    """The bytes of host tensor ``t``."""
    # (numpy has no bfloat16; ``tobytes`` copies in C order, whatever the strides)
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
