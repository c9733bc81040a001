"""The guard: every call's first collective carries a fingerprint of the call,
and every replica checks what arrived before it returns anything.

The fingerprint is 64 bits of the SHA-256 of the call's signature (function,
parameters, every leaf's path, dtype, shape and op, the tree structure), the
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
  one-sided verdict.
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

Whatever op each replica asked for, a differing value gives no replica its
expected pattern (an op that differs is in the fingerprint too).

The header goes at the front: where an engine delivers part of a larger
buffer (gloo, when sizes differ), the front is what arrives.
"""

from __future__ import annotations

import dataclasses
import functools
import struct
import threading
import weakref
from collections.abc import Hashable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NoReturn, Protocol

import torch

from .._backends.base import EngineError, Transport
from .._base import memo as _memo
from .._base import tree as _tree
from . import check as _check
from . import exchange as _exchange
from . import steps as _steps
from . import watchdog as _watchdog

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
        # (a tag changes from call to call: its fingerprint is not kept)
        return _exchange.sha256(base.hex() + "\n" + self.tag) if self.tag else base

    def header(
        self, dtype: torch.dtype, op: Rules, how: str, world: int, transport: Transport
    ) -> Header:
        """The call's :class:`Header` for collective ``op``, its part on
        ``transport``'s device (uploaded as data, so that replicas with
        different headers trace the same program); kept per signature and
        device, unless tagged."""
        if self.tag:  # (a tagged call's fingerprint is a digest made per call)
            return _on(transport, _build(self.fingerprint(), dtype, op, how, world))
        d = self.description.digest
        key = (self.name, self.head, d, dtype, op.__class__, how, world, transport.device)
        return _headers.hit(key) or _headers.get(
            key, lambda: _on(transport, _build(self.fingerprint(), dtype, op, how, world))
        )


class Rules(Protocol):
    """What the guard reads of a collective (:class:`xcoll._core.ops.Packed`):
    its header's size and value under the collective's arithmetic."""

    def header_size(self, dtype: torch.dtype, how: str, world: int) -> int: ...

    def header_parts(
        self, values: list[int], dtype: torch.dtype, how: str, world: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


_fingerprints: _memo.Memo[bytes] = _memo.Memo()


@functools.cache
def own_size(dtype: torch.dtype, how: str, world: int) -> int:
    """The number of header values (:func:`_values`) in a bucket of ``dtype``
    combined by ``how`` at ``world`` replicas."""
    return len(_values(_ZERO, dtype, how, world))


@functools.cache
def alike_size(dtype: torch.dtype, how: str, world: int) -> int:
    """A reduce's header size: it depends on the dtype's width alone, except
    for prod, so that replicas whose dtypes of one width or whose ops (prod
    aside) differ still make collectives of one size, which the verdict
    names, instead of the engine's failure."""
    if how == "prod":
        return own_size(dtype, how, world)
    alike = [d for d in _tree.SUPPORTED_DTYPES if d.itemsize == dtype.itemsize]
    return max(own_size(d, h, world) for d in alike for h in _OPS)


_ZERO = bytes(BITS // 8)
_OPS = ("sum", "max", "min")


def _width(dtype: torch.dtype, how: str, world: int) -> int:
    """The bits of the fingerprint per header value of a reduce (:func:`_values`)."""
    exact = (  # the largest integer up to which dtype holds every integer
        2 * round(1 / torch.finfo(dtype).eps)
        if dtype.is_floating_point
        else 1
        if dtype == torch.bool
        else torch.iinfo(dtype).max
    )
    if how in ("max", "min"):
        return min(BITS, (exact + 1).bit_length() - 1)
    k = 1
    while k < BITS and world * ((1 << (k + 1)) - 1) ** 2 <= exact:
        k += 1
    return k


def _values(fingerprint: bytes, dtype: torch.dtype, how: str, world: int) -> list[int]:
    """The header's values for ``fingerprint`` (see the module's docstring)."""
    if how == "":  # (a gather's, and a one-sided broadcast's) its bytes, as two int32 words
        return list(struct.unpack("<2i", fingerprint[: BITS // 8]))
    n = int.from_bytes(fingerprint[: BITS // 8], "little")
    if how == "prod":
        bits = [(n >> j) & 1 for j in range(BITS)]
        return [*bits, *(1 - b for b in bits)]
    k = _width(dtype, how, world)
    chunks = [(n >> j) & ((1 << k) - 1) for j in range(0, BITS, k)]
    if how == "sum":
        return chunks if k == 1 else [*chunks, *(v * v for v in chunks)]
    return [*chunks, *((1 << k) - 1 - v for v in chunks)]


@dataclass(frozen=True)
class Header:
    """One call kind's header for one fingerprint, bucket dtype, op and W."""

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


def _build(fingerprint: bytes, dtype: torch.dtype, op: Rules, how: str, world: int) -> Header:
    """The :class:`Header` of collective ``op``, combined by ``how`` (the
    all-reduce's op, "sum" for a broadcast that sums, "" for a move whose
    bytes arrive as sent), as the module's docstring says (on the host)."""
    values = _values(fingerprint, dtype, how, world)
    values += [0] * (op.header_size(dtype, how, world) - len(values))  # (0 under every op)
    part, wire, decoded = op.header_parts(values, dtype, how, world)
    return Header(part, as_bytes(wire), as_bytes(decoded))


def _on(transport: Transport, h: Header) -> Header:
    """``h`` with its part on ``transport``'s device."""
    if h.part.device == transport.device:
        return h
    return dataclasses.replace(h, part=transport.upload(h.part))


def as_bytes(t: torch.Tensor) -> bytes:
    """The bytes of host tensor ``t``."""
    # (numpy has no bfloat16; ``tobytes`` copies in C order, whatever the strides)
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


def fire(
    transport: Transport,
    signature: Signature | None,
    src: int | None = None,
) -> NoReturn:
    """Raises :class:`CollectiveMismatchError` for a call whose header says the
    replicas' calls differ. Every replica gets the same verdict, so they all
    exchange their descriptions, and the error names the first difference and
    both ranks. ``src``: a one-sided verdict (a receiver of ``src``'s
    broadcast), which exchanges nothing (``src`` has returned)."""
    s = signature
    rank = transport.rank_name(transport.rank())
    if s is None:  # this replica runs in mode "never", others do not
        raise _check.CollectiveMismatchError(
            f"{rank}: the replicas' calls differ, or their XCOLL_CHECK modes do (this "
            "replica's is \"never\"; every replica must use the same mode)"
        )
    if src is not None:
        raise _check.CollectiveMismatchError(
            f"{s.name}: this replica's call ({rank}: {_summary(s)}) differs from the call of "
            f"src, {transport.rank_name(src)}; run with XCOLL_CHECK=always to name the difference"
        )
    try:
        _check.verify(transport, s.name, s.head, s.description, tag=s.tag)
    except RuntimeError as e:
        if isinstance(e, _check.CollectiveMismatchError):
            raise
        # a replica that the engine stopped (gloo aborts a rank whose buffer
        # is smaller than the one it receives) cannot take part
        raise _check.CollectiveMismatchError(
            f"{s.name}: the replicas' calls differ (the guard's fingerprints disagree on "
            f"{rank}: {_summary(s)}); naming the difference failed: {e}"
        ) from e
    raise _check.CollectiveMismatchError(
        f"{s.name}: the guard's fingerprints disagree on {rank}, but the replicas' "
        "descriptions agree: their XCOLL_CHECK modes differ, a call overlapped another on "
        "this process group, or a header changed in transit"
    )


def _summary(s: Signature) -> str:
    """The call in a line: its tag, parameters and its description's first
    three lines ("..." where there are more)."""
    lines = s.description.lines  # (each leaf's, then the structure's)
    n = len(lines) - 1
    leaves = (
        f"{n} {'leaf' if n == 1 else 'leaves'}: "
        + "; ".join(lines[:3])
        + ("; ..." if len(lines) > 3 else "")
        if n > 0
        else "no leaves"
    )
    return f"tag: {s.tag or '(none)'}; parameters: {s.head or '(none)'}; {leaves}"


def diagnosis(rank: str, signature: Signature, seconds: float, lazy: bool = False) -> str:
    """What the watchdog prints when a call has waited ``seconds`` for the
    other replicas (``rank``: named on the replica's thread; on XLA the rank
    is per thread; ``lazy``: on XLA, whose own causes it names too)."""
    return (
        f"xcoll: {signature.name} on {rank} has waited {seconds:.0f} s for the other replicas. "
        f"This replica's call: {_summary(signature)}; description "
        f"{signature.description.digest.hex()[:16]}. {causes(lazy)}"
    )


def causes(lazy: bool) -> str:
    """What can make a replica wait in a collective, as far as xcoll can tell
    from here: the causes on every engine, and on XLA (``lazy``) the
    programs."""
    found = [
        "a replica has not reached this call (its code raised before it and went on, or it "
        "is still in an earlier call; tag the calls, tag= or xcoll.step, to name a skipped one)",
        "a replica made a different call whose buffers differ in size (XCOLL_CHECK=always "
        "names it)",
    ]
    if lazy:
        found.append(
            "the replicas' programs differ: work pending before the call traced from a "
            "per-replica Python value (a factor 0 or 1, as in x * rank, is a constant on that "
            "replica alone), a data-dependent shape, pending tensors that only a reference "
            "cycle keeps alive (a dropped metric object) on replicas whose garbage collector "
            "has not run yet, or a torch_xla.sync() or .item() of "
            "pending collectives outside xcoll.sync() (README, 'On XLA: one program on every "
            "replica')"
        )
    listed = "; ".join(f"({k}) {c}" for k, c in enumerate(found, 1))
    return (
        f"Causes that fit this wait: {listed}. The engine then times out, or XLA aborts the "
        "process."
    )


class ConcurrentCallError(_check.CollectiveMismatchError):
    """Two threads of one process called xcoll on one process group at once.

    Collectives pair by order, and two threads' calls on one group cannot be
    ordered the same on every replica: the group is unusable on this process
    from then on (every later call on it raises this at once, without
    communicating), so that the other replicas fail (time out) instead of
    pairing their calls with the wrong ones. A subclass of
    :class:`CollectiveMismatchError`.
    """


ConcurrentCallError.__module__ = "xcoll"


class entered:
    """A public call's entry, around everything it does: its group claimed
    (:func:`claim`), its step tag (:mod:`xcoll._guard.steps`), the watchdog, the full
    check when due (raising the call's local ``error``, shared with every
    replica), and, on the way out, the engine's failure to complete a
    collective in xcoll's words. The block's value is the call's
    :class:`Signature` for its guard (None in mode "never" and in a world of
    one)."""

    def __init__(
        self,
        transport: Transport,
        name: str,
        head: str,
        description: _check.Description | None,
        error: Exception | None = None,
        *,
        tag: Any = None,
    ):
        self.transport, self.name, self.head = transport, name, head
        self.description, self.error = description, error
        self.explicit = tag
        self.claimed: list[Any] | None = None
        self.watch: _watchdog.watch | None = None

    def __enter__(self) -> Signature | None:
        mode = _check.mode()
        t, error, self.error = self.transport, self.error, None  # (see the finally below)
        self.claimed = claim(t, self.name)
        try:
            if t.lazy:  # (an earlier sync=False call's verdict, where a sync has run it)
                t.settle()
            try:
                tag, number = _steps.tag(t.group_key, self.explicit)
            except TypeError as e:
                tag, number, error = "", 0, error or e
            d = self.description or _check.Description(())
            signature = Signature(self.name, self.head, d, tag, number)
            w = t.world
            if w > 1:
                # (this thread's transport: on XLA the rank is per thread)
                self.watch = _watchdog.watch(
                    lambda seconds: diagnosis(t.rank_name(t.rank()), signature, seconds, t.lazy)
                )
            # (beyond EXACT_SUMS replicas a guard header summed in 8-bit
            # integers could wrap: every call is then checked in full too)
            full = w > EXACT_SUMS
            if _check.due(t, mode) or (full and mode != "never"):
                _check.verify(t, self.name, self.head, self.description, error, tag=tag)
            if error is not None:
                raise error
        except BaseException as e:
            self.__exit__(type(e), e, None)
            raise
        finally:
            # the error's traceback holds this frame: without this, the frame
            # would hold the error (a cycle), and with it the call's tensors
            error = None  # noqa: F841
        # (a world of one has no other replica to disagree with: no header)
        return None if mode == "never" or w == 1 else signature

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self.watch is not None:
            self.watch.__exit__()
            self.watch = None
        claimed, self.claimed = self.claimed, None
        if claimed is not None:
            release(self.transport, claimed, self.name, failed=value is not None)
        if value is not None and isinstance(value, EngineError):
            t = self.transport
            raise RuntimeError(
                f"{self.name}: a collective did not complete on {t.rank_name(t.rank())}: {value} "
                "(a replica that never arrived, or that the engine stopped. A replica whose code "
                "raised before this call, and that went on, is one call behind: tag the calls "
                "(tag=, xcoll.step) to name it. gloo kills a rank that receives a larger buffer "
                "than its own, as when replicas' calls differ: XCOLL_CHECK=always names such a "
                "difference)"
            ) from value


# group_key -> [the calling thread's ident, whether another call overlapped it]
_busy: dict[Hashable, list[Any]] = {}
_busy_lock = threading.Lock()
# The groups on which two threads' calls overlapped: unusable from then on, on
# this process (:func:`claim`). torch.distributed groups by the group
# object, weakly (a new group, even one with the same name, is usable); other
# engines' groups by key, for the life of the process.
_unusable_groups: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_unusable_keys: dict[Hashable, str] = {}
_marked = False  # whether a group was ever marked unusable in this process


def claim(transport: Transport, name: str) -> list[Any] | None:
    """Marks ``transport``'s group busy for one public call (``name``) of this
    thread; returns the mark, for :func:`release` (None: nothing to release,
    in a world of one or within this thread's own call). A call that starts
    while another thread's is in flight on the same group raises
    :class:`ConcurrentCallError` at once, without communicating, and so does
    the call it overlapped, when it ends (collectives are paired by order on
    each process, and two threads' order is not defined).

    From then on this process makes no collective on that group: every call
    raises :class:`ConcurrentCallError` at once. On the other replicas, whose
    threads may have called one after the other, the calls that follow wait
    for this one and fail with the engine's timeout, instead of pairing with
    the wrong call; only a call already paired when the overlap was seen may
    have met the other thread's call here (tag each thread's calls, and the
    guard names that too). A world of one has nothing to pair."""
    t = transport
    if t.world == 1:
        return None
    key, me = t.group_key, threading.get_ident()
    with _busy_lock:
        why = _unusable(t) if _marked else None
        if why:
            raise ConcurrentCallError(
                f"{name}: {t.rank_name(t.rank())} made no collective: this process "
                f"group is unusable since {why}; the other replicas' calls may have been "
                "paired differently. Make a new process group (on XLA, restart the "
                "replicas), and call from one thread at a time"
            )
        entry = _busy[key] if key in _busy else None
        if entry is not None and entry[0] == me:  # a call within this thread's own call
            return None
        if entry is not None:
            entry[1] = True
            _mark_unusable(t, f"two threads' calls overlapped on {t.rank_name(t.rank())}")
            raise ConcurrentCallError(
                f"{name}: called on {t.rank_name(t.rank())} from thread "
                f"{threading.current_thread().name!r} while another thread has a call in "
                "flight on the same process group; calls on one group must come from one "
                "thread at a time, in the same order on every replica. The group is "
                "unusable from now on: make a new one (on XLA, restart the replicas)"
            )
        entry = _busy[key] = [me, False]
    return entry


def release(transport: Transport, entry: list[Any], name: str, failed: bool) -> None:
    """Ends :func:`claim`'s mark ``entry``; raises :class:`ConcurrentCallError`
    where another thread's call overlapped this one (unless this one
    ``failed``: its own error is the one to report)."""
    with _busy_lock:
        del _busy[transport.group_key]
    if entry[1] and not failed:
        raise ConcurrentCallError(
            f"{name}: another thread called xcoll on the same process group while "
            f"this call ({transport.rank_name(transport.rank())}, thread "
            f"{threading.current_thread().name!r}) was in flight; its result may be paired "
            "with that call's on other replicas. The group is unusable from now on"
        )


def _unusable(t: Transport) -> str | None:
    group = t.group_object
    if group is not None:
        return _unusable_groups.get(group)
    return _unusable_keys.get(t.group_key)


def _mark_unusable(t: Transport, why: str) -> None:
    global _marked
    _marked = True
    group = t.group_object
    if group is not None:
        _unusable_groups[group] = why
    else:
        _unusable_keys[t.group_key] = why
