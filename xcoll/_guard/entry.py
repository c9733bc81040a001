"""A public call's entry (:class:`entered`), around everything it does: its
process group claimed for this thread (:func:`claim`, :func:`release`:
two threads' calls on one group are an error), its step tag, the watchdog,
the full check when due, and the engine's failure in xcoll's words."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Hashable
from types import TracebackType
from typing import Any

from .._backends.base import EngineError, Transport
from . import check as _check
from . import leaving as _leaving
from . import order as _order
from . import steps as _steps
from . import watchdog as _watchdog
from .header import EXACT_SUMS, Signature
from .verdict import diagnosis, settle


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
            # (the calls in flight on this group complete first, in order: the
            # one collective a completion may start, the exchange naming a
            # difference, is then the next on the group on every replica)
            if t.group_key in _order.in_flight:  # (a lookup: another group's completion is not waited for)
                _order.sync(t.group_key)
            if t.lazy:  # (an earlier sync=False call's verdict, where a sync has run it)
                settle(t)
            try:
                tag, number = _steps.tag(t, self.explicit)
            except TypeError as e:
                tag, number, error = "", 0, error or e
            d = self.description or _check.NO_TREE
            signature = Signature(self.name, self.head, d, tag, number)
            w = t.world
            if w > 1:
                _leaving.last[t.group_key] = t, signature  # (what an exit names)
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
                _steps.uncount(t.group_key)  # (it communicated nothing)
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
        if value is not None and isinstance(value, _check.CollectiveMismatchError):
            _steps.failed()  # (its steps raise at their ends, even where it is caught)
        if value is not None and isinstance(value, EngineError):
            raise engine_failure(self.transport, self.name, value) from value


def engine_failure(t: Transport, name: str, error: EngineError) -> RuntimeError:
    """The engine's failure to complete a collective of call ``name``, in
    xcoll's words, naming first the replicas that said they left."""
    return RuntimeError(
        f"{name}: a collective did not complete on {t.rank_name(t.rank())}: "
        f"{_leaving.who_left(t)}{error} "
        "(a replica that never arrived, or that the engine stopped. A replica whose code "
        "raised before this call, and that went on, is one call behind: tag the calls "
        "(tag=, xcoll.step) to name it. gloo kills a rank that receives a larger buffer "
        "than its own, as when replicas' calls differ: XCOLL_CHECK=always names such a "
        "difference)"
    )


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
