"""A watchdog that prints a diagnosis when a call's collectives wait too long.

Where replicas make different calls, some engines neither return nor raise:
XLA's replicas compile different programs, wait in different rendezvous and
XLA aborts the process after 10 s; gloo waits for its timeout. The watchdog
prints xcoll's own account of the call to stderr first (after
:data:`AFTER` seconds), so the log says which call it was.

One daemon thread serves every call: watching a call costs a dict entry,
not a thread nor a lock (the thread polls the entries, :data:`POLLS` times
per :data:`AFTER`: a diagnosis comes at most ``AFTER / POLLS`` seconds late).
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Callable

#: Seconds a call waits before its diagnosis is printed (XLA aborts at 10).
AFTER = 5.0

#: How often the watchdog thread looks at the calls, per :data:`AFTER`.
POLLS = 10

_start = threading.Lock()  # (taken once, to start the thread)
# Each call watched: its deadline, and its message. (Entered and left without
# a lock: one dict operation each, atomic under the GIL; the thread reads a
# copy of the items.)
_watched: dict[int, tuple[float, Callable[[float], str]]] = {}
_ids = itertools.count()
_thread: threading.Thread | None = None


def _loop() -> None:
    while True:
        time.sleep(AFTER / POLLS)
        now = time.monotonic()
        for k, (deadline, message) in list(_watched.items()):
            if deadline <= now and _watched.pop(k, None) is not None:
                try:
                    text = message(AFTER)
                except Exception as e:  # a diagnosis must never kill the watchdog
                    text = f"xcoll: a call has waited {AFTER:.0f} s ({e!r})"
                print(text, file=sys.stderr, flush=True)


def _started() -> None:
    global _thread
    with _start:
        if _thread is None:
            _thread = threading.Thread(target=_loop, name="xcoll-watchdog", daemon=True)
            _thread.start()


class watch:
    """Prints ``message(seconds)`` to stderr if :meth:`__exit__` does not come
    within :data:`AFTER` seconds of the watch's making; a ``with`` block's
    body is watched (a class, not a generator: it is on every call's path)."""

    def __init__(self, message: Callable[[float], str]):
        self.key = next(_ids)
        _watched[self.key] = (time.monotonic() + AFTER, message)
        if _thread is None:
            _started()

    def __enter__(self) -> watch:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            del _watched[self.key]
        except KeyError:  # (the thread printed its diagnosis)
            pass
