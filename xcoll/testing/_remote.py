"""What the pools and their workers share: a task, how a replica runs it, how a
failure is reported, and how one call's per-rank results are collected.

Standard library only, and no import of the other modules of this package, so
:mod:`xcoll.testing._workers` and :mod:`xcoll.testing._pools` both import it
without an import cycle.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RemoteFailure:
    """What a replica raised (or that it never returned), as
    :class:`ReplicaError` holds it and ``run(..., return_exceptions=True)``
    returns it in the replica's place.

    Attributes:
        rank: the replica's rank.
        type_name: the exception type's qualified name, e.g.
            ``"builtins.TypeError"`` (``"xcoll.testing.DidNotReturn"`` for a
            replica that did not return after another one raised).
        message: ``str()`` of the exception.
        traceback: the replica's formatted traceback ("" if it did not return).
    """

    rank: int
    type_name: str  # qualified name of the exception type, e.g. "builtins.TypeError"
    message: str
    traceback: str

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.type_name}: {self.message}"


def _failure(rank: int, e: BaseException) -> RemoteFailure:
    """``e``, which rank ``rank`` is handling now, as a :class:`RemoteFailure`."""
    t = type(e)
    return RemoteFailure(rank, f"{t.__module__}.{t.__qualname__}", str(e), traceback.format_exc())


#: What one replica runs: the function, whether it takes an argument, the argument.
Task = tuple[Callable[..., Any], bool, Any]


def _task(fn: Callable[..., Any], per_rank_args: Sequence[Any] | None, rank: int) -> Task:
    """What one replica runs: ``fn(per_rank_args[rank])``, or ``fn()``."""
    return (fn, per_rank_args is not None, None if per_rank_args is None else per_rank_args[rank])


def _call(rank: int, task: Task) -> tuple[int, bool, Any]:
    """Runs a task on this replica: ``(rank, True, result)`` or ``(rank, False, failure)``."""
    fn, has_arg, arg = task
    try:
        return rank, True, fn(arg) if has_arg else fn()
    except BaseException as e:  # noqa: BLE001 - reported to the caller
        return rank, False, _failure(rank, e)


class _Results:
    """One call's per-rank results. After the first failure the others get
    ``grace`` seconds: they may be waiting forever in a collective that the
    failed rank never reached, so they are reported instead of waited for.

    Used where the replicas' results arrive: by :class:`~xcoll.testing.GlooPool`
    in the calling process and by the XLA pool's worker process."""

    def __init__(self, world_size: int, grace: float):
        self.world_size, self.grace = world_size, grace
        self.by_rank: dict[int, tuple[bool, Any]] = {}
        self.grace_ends: float | None = None

    def add(self, rank: int, ok: bool, value: Any) -> None:
        self.by_rank[rank] = (ok, value)
        if not ok and self.grace_ends is None:
            self.grace_ends = time.monotonic() + self.grace

    def done(self) -> bool:
        return len(self.by_rank) == self.world_size or (
            self.grace_ends is not None and time.monotonic() >= self.grace_ends
        )

    def wait_time(self, deadline: float | None = None) -> float | None:
        ends = [t for t in (deadline, self.grace_ends) if t is not None]
        return max(0.0, min(ends) - time.monotonic()) if ends else None

    def finish(self) -> tuple[bool, list[tuple[bool, Any]]]:
        """(whether every rank returned, ``[(ok, value)]`` in rank order)."""
        complete = len(self.by_rank) == self.world_size
        failed = sorted(r for r, (ok, _) in self.by_rank.items() if not ok)
        for r in range(self.world_size):
            if r not in self.by_rank:
                why = (
                    f"did not return within {self.grace:.0f} s after rank(s) {failed} failed "
                    "(probably waiting in a collective they never reached)"
                )
                self.by_rank[r] = (False, RemoteFailure(r, "xcoll.testing.DidNotReturn", why, ""))
        return complete, [self.by_rank[r] for r in range(self.world_size)]
