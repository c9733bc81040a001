"""Bounded caches of things built once per key (checked trees, plans, compiled
XLA computations).

Keys are made of shapes, dtypes and tree structures; shapes that change from
step to step (a growing sequence length) must not grow a cache without end, so
each is cleared when full. A key that cannot be hashed (a treespec holding an
unhashable object) is not cached: its value is built for the call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class Memo(Generic[V]):
    """``get(key, build, *args)``: the value for ``key``, built by
    ``build(*args)`` on first use. A build that raises stores nothing. With
    ``locked``, one replica thread builds a key while the others wait for it
    (for values worth building once)."""

    def __init__(self, limit: int = 1024, *, locked: bool = False):
        self._values: dict[Hashable, V] = {}
        self._limit = limit
        self._lock = threading.Lock() if locked else None
        #: ``hit(key)``: the value for a hashable ``key`` if built, else None
        #: (the dict's own lookup, for a call's path: a hit makes no Python call).
        self.hit: Callable[[Hashable], V | None] = self._values.get

    def get(self, key: Hashable, build: Callable[..., V], *args: object) -> V:
        try:
            value = self._values.get(key)
        except TypeError:  # unhashable
            return build(*args)
        if value is None:
            if self._lock is None:
                value = self._store(key, build(*args))
            else:
                with self._lock:
                    value = self._values.get(key)
                    if value is None:
                        value = self._store(key, build(*args))
        return value

    def _store(self, key: Hashable, value: V) -> V:
        if len(self._values) >= self._limit:
            self._values.clear()
        self._values[key] = value
        return value
