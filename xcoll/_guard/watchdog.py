"""A watchdog that prints a diagnosis when a call's collectives wait too long.

Where replicas make different calls, some engines neither return nor raise:
XLA's replicas compile different programs, wait in different rendezvous and
XLA aborts the process after 10 s; gloo waits for its timeout. The watchdog
prints xcoll's own account of the call to stderr first (after
:data:`AFTER` seconds), so the log says which call it was.

One daemon thread serves every call: watching a call costs a lock and a dict
entry, not a thread.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Callable

#: Seconds a call waits before its diagnosis is printed (XLA aborts at 10).
AFTER = 5.0

# (a plain lock, entered in C by every call; the watchdog thread waits on its condition)
_lock = threading.Lock()
_wakeup = threading.Condition(_lock)
_watched: dict[int, tuple[float, Callable[[float], str]]] = {}
_ids = itertools.count()
_thread: threading.Thread | None = None
_wake = 0.0  # when the watchdog thread wakes next (a later deadline need not wake it)


def _loop() -> None:
    global _wake
    with _lock:
        while True:
            now = time.monotonic()
            for k, (deadline, message) in list(_watched.items()):
                if deadline <= now:
                    del _watched[k]
                    try:
                        text = message(AFTER)
                    except Exception as e:  # a diagnosis must never kill the watchdog
                        text = f"xcoll: a call has waited {AFTER:.0f} s ({e!r})"
                    print(text, file=sys.stderr, flush=True)
            _wake = min((d for d, _ in _watched.values()), default=now + 3600)
            _wakeup.wait(_wake - now)


class watch:
    """Prints ``message(seconds)`` to stderr if the block runs longer than
    :data:`AFTER` (a class, not a generator: it is on every call's path)."""

    def __init__(self, message: Callable[[float], str]):
        self.message = message

    def __enter__(self) -> None:
        global _thread
        self.key = next(_ids)
        with _lock:
            if _thread is None:
                _thread = threading.Thread(target=_loop, name="xcoll-watchdog", daemon=True)
                _thread.start()
            deadline = time.monotonic() + AFTER
            _watched[self.key] = (deadline, self.message)
            if deadline < _wake:
                _wakeup.notify()

    def __exit__(self, *exc: object) -> None:
        with _lock:
            _watched.pop(self.key, None)
