"""The lock that thread-per-device XLA replicas step under, held only until
the step's graph is compiled.

Replica threads (XLA:CPU, older TPUs) that reach a step together with a
graph not yet compiled each compile their own executable, whose collectives
never meet (XLA:CPU keys a rendezvous by the compiled module), and XLA aborts
the process. Under this lock the first thread compiles and the others find
the executable in torch_xla's cache.

A holder counts as gone once its graph is in that cache, before its step has
returned: what follows inside the step may block. With XLA:CPU's asynchronous
client (torch_xla's default there) a step that drops the last reference to
one of its graph's input buffers (a parameter an optimizer replaced) waits
until the execution that reads it has ended, and that execution waits at a
rendezvous for the replicas queued behind the lock (measured: a training loop
at W=4 aborted within 5 steps, every run). torch_xla counts both ways a step
finds its executable, and counts them before it dispatches it: a compile
adds it to the cache (whose size it reports), a cache hit counts
``CachedCompile``. Both are process-wide counts read under torch_xla's own
locks; a tensor's state is not (another thread's step rewrites it). Waiters
check them first after :data:`POLL` seconds, then at twice the interval each
time, up to :data:`POLL_MAX` (a compile takes seconds, and a check takes the
GIL from it). A count changed by a step made outside the lock (a caller's
``.item()``) lets a waiter go on early, as a plain lock never saw that step
either.
"""

from __future__ import annotations

import threading

from . import _xlac

#: Seconds before a waiter's first check of whether the holder's graph is compiled.
POLL = 0.001
#: The longest interval between its checks.
POLL_MAX = 0.02


class CompileLock:
    """One replica thread steps at a time, until its graph is compiled."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)
        self._holder: object | None = None
        self._waiting = 0

    def hold(self) -> object:
        """Waits until no holder is compiling, then holds the lock; returns
        the hold, for :meth:`release`. A waiter takes the compile counts when
        it first sees a holder, and goes on once they change (that holder's
        graph is in the cache) or the holder releases: counts that changed
        before it looked leave it waiting for the release, as a plain lock
        would. An uncontended hold reads no counts."""
        held = object()
        with self._mutex:
            if self._holder is not None:
                self._waiting += 1
                try:
                    self._wait()
                finally:
                    self._waiting -= 1
            self._holder = held
        return held

    def _wait(self) -> None:
        """Waits (the mutex held) until there is no holder, or the holder's
        graph is compiled."""
        seen = counts = None
        wait = POLL
        while self._holder is not None:
            if self._holder is not seen:  # (a new holder: counted from now)
                seen, counts = self._holder, _xlac.compile_counts()
            elif _xlac.compile_counts() != counts:
                return
            self._cond.wait(wait)
            wait = min(2 * wait, POLL_MAX)

    def release(self, held: object) -> None:
        """Ends ``held`` (a no-op where a waiter has taken over)."""
        with self._mutex:
            if self._holder is held:
                self._holder = None
                if self._waiting:
                    self._cond.notify_all()
