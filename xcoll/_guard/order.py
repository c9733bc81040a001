"""The order of calls in flight on a group: collectives pair by order, so
every replica must make them in the order of its calls, whatever it reads
first or when.

A call made with ``sync=False`` on an eager engine starts every one of its
collectives before it returns (:mod:`xcoll._core.execute`), and is its
group's call in flight here (:func:`started`). It completes (its collectives
waited for, its guard read, its outputs decoded) at the first of: the first
use of an output, :func:`sync`, or the group's next call of any kind
(:func:`sync` at its entry, :mod:`xcoll._guard.entry`), whichever thread
made it. So a group has at most one call in flight (a group serves one call
at a time, and each call's entry completes the one in flight first), and
the only collective a completion may start, the exchange that names a
difference where the guard disagrees, is the next collective on the group
on every replica: each replica completes the call before its next call on
the group, as the first of them reads an output or not.
"""

from __future__ import annotations

import functools
import threading
from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import Any

from . import verdict as _verdict
from . import watchdog as _watchdog


class Call(ABC):
    """One ``sync=False`` call in flight, in its order on its group."""

    def __init__(self, group: Hashable, name: str) -> None:
        self.group, self.name = group, name
        self.outputs: list[Any] | None = None
        self.failed: str | None = None  # (why it could not complete)

    @abstractmethod
    def complete(self) -> list[Any]:
        """Waits for the call's collectives, reads its guard (raising
        :class:`~xcoll.CollectiveMismatchError` where the replicas' calls
        differ) and returns its output leaves."""

    def output(self, leaf: int) -> Any:
        """Output leaf ``leaf``, completing the call first if it has not
        completed."""
        if self.outputs is None:
            completed(self)
        if self.outputs is None:
            raise RuntimeError(
                f"{self.name}: this output does not exist: the call made with sync=False "
                f"failed when it completed ({self.failed})"
            )
        return self.outputs[leaf]


_lock = threading.RLock()  # (an output may be used from another thread)
# {group: its call in flight} (read at every call's entry: a
# call finds it empty, but where calls in flight are). Per group, not per thread: the
# calls on a group complete in their order on every replica, whichever thread
# made a call or completes it.
in_flight: dict[Hashable, Call] = {}


def started(call: Call) -> None:
    """Puts ``call`` in flight on its group (whose call in flight, if any,
    its entry has completed)."""
    with _lock:
        in_flight[call.group] = call


def completed(call: Call) -> None:
    """Completes ``call``, unless it has completed or failed."""
    with _lock:
        if call.outputs is not None or call.failed is not None:
            return
        try:
            with _watchdog.watch(functools.partial(_waited, call.name)):
                call.outputs = call.complete()
        except BaseException as e:
            call.failed = f"{type(e).__name__}: {e}"
            raise
        finally:
            # (a completed call is no longer in flight: kept here, its outputs
            # would live until the group's next call, whoever else holds them)
            if in_flight.get(call.group) is call:
                del in_flight[call.group]


def sync(group: Hashable | None = None) -> None:
    """Completes the process's calls in flight (on ``group``'s key only, if
    given)."""
    with _lock:
        latest = [c for k, c in in_flight.items() if group is None or k == group]
    for call in latest:
        completed(call)


def _waited(name: str, seconds: float) -> str:
    return (
        f"xcoll: {name} made with sync=False has waited {seconds:.0f} s to complete: its "
        f"collectives wait for the other replicas. {_verdict.causes(False)}"
    )
