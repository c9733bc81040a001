"""xcoll's side of every benchmark cell, on any backend: ``prepare(tree) -> call``
as in :mod:`bench.xla` and :mod:`bench.gloo`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Call = Callable[[], Any]


def gather_to_cpu(tree: dict) -> Call:
    import xcoll

    return lambda: xcoll.gather(tree, to_cpu=True)


def gather(tree: dict) -> Call:
    import xcoll

    return lambda: xcoll.gather(tree)


def gather_uneven(tree: dict) -> Call:
    import xcoll

    return lambda: xcoll.gather(tree, uneven=True)


def reduce(tree: dict) -> Call:
    import xcoll

    return lambda: xcoll.reduce(tree, "sum")


def reduce_to_cpu(tree: dict) -> Call:
    import xcoll

    return lambda: xcoll.reduce(tree, "sum", to_cpu=True)


def broadcast(tree: dict) -> Call:
    import xcoll

    return lambda: xcoll.broadcast(tree, src=0)
