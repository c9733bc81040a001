"""Cross-replica consistency check: a clear error on every replica instead of a
hang or silently wrong data when replicas make different calls.

Before a call communicates, every replica describes it (function, op, src,
tree structure, each leaf's path, dtype and shape, or the local error that
stopped it) and exchanges a 32-byte SHA-256 of that description: the same size
on every replica, whatever their trees, so the exchange itself cannot hang on
mismatched input. It runs on its own (on XLA, a graph of just the exchange: the
caller's pending work differs between replicas exactly when their calls do). If
the digests differ, every replica exchanges the descriptions and raises
:class:`CollectiveMismatchError` naming the first difference.

When it runs (``XCOLL_CHECK`` or :func:`consistency_checks`): ``"first"`` (the
default) checks the first call of each replica, which catches a structure that
differs from the start of a run; ``"always"`` checks every call (one more small
collective per call: see docs/reliability.md for its measured cost);
``"never"`` turns it off.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import _tree

MODES = ("first", "always", "never")
_local = threading.local()  # per replica main thread (XLA:CPU runs one thread per replica)


class CollectiveMismatchError(RuntimeError):
    """Replicas made different collective calls; raised on every replica."""


@contextlib.contextmanager
def consistency_checks(mode: str) -> Iterator[None]:
    """Checks calls made in this block (on this thread) in ``mode``:
    ``"first"``, ``"always"`` or ``"never"``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    previous = getattr(_local, "mode", None)
    _local.mode = mode
    try:
        yield
    finally:
        _local.mode = previous


def _mode() -> str:
    mode = getattr(_local, "mode", None) or os.environ.get("XCOLL_CHECK", "first")
    if mode not in MODES:
        raise ValueError(f"XCOLL_CHECK must be one of {MODES}, got {mode!r}")
    return mode


def describe_tree(flat: _tree.Flat, uneven_dims: dict[int, int] | None = None) -> list[str]:
    """One line per leaf: path, dtype and shape (an uneven leaf's growing dim as *)."""
    lines = []
    for i, leaf in enumerate(flat.leaves):
        if isinstance(leaf, torch.Tensor):
            shape = list(leaf.shape)
            if uneven_dims and i in uneven_dims:
                shape[uneven_dims[i]] = "*"
            what = f"{str(leaf.dtype).removeprefix('torch.')} tensor of shape ({', '.join(map(str, shape))})"
        else:
            what = f"Python {type(leaf).__name__}"
        lines.append(f"{flat.path(i)}: {what}")
    return lines


def describe_structure(flat: _tree.Flat) -> str:
    """The tree's structure, as every replica prints it: object addresses in
    node data (a defaultdict's lambda factory) differ between processes and
    are left out."""
    return _ADDRESS.sub("", str(flat.treespec))


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


@contextlib.contextmanager
def outermost() -> Iterator[bool]:
    """True in the outermost xcoll call of this thread: only it is checked (the
    calls it makes inside are part of it)."""
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    try:
        yield depth == 0
    finally:
        _local.depth = depth


def check(name: str, describe: Callable[[], list[str]], *, group: Any = None) -> None:
    """When the mode says so, runs ``describe()`` (the call's local validation:
    it may raise) and compares the description with every replica's. A local
    error is shared too, so that every replica raises instead of the others
    waiting for it."""
    calls = getattr(_local, "calls", 0)
    _local.calls = calls + 1
    mode = _mode()
    if mode == "never" or (mode == "first" and calls > 0):
        return  # the call's own validation still raises its local errors
    try:
        lines, error = [name, *describe()], None
    except (TypeError, ValueError) as e:
        lines, error = [name, f"error: {type(e).__name__}: {e}"], e
    _compare(name, lines, error, group)
    if error is not None:
        raise error


def _compare(name: str, lines: list[str], error: Exception | None, group: Any) -> None:
    from . import _backends, _objects

    backend = _backends.current(group)
    digest = hashlib.sha256("\n".join(lines).encode("utf-8", "surrogatepass")).digest()
    every = backend.exchange(backend.upload(torch.frombuffer(bytearray(digest), dtype=torch.uint8)))
    me = backend.rank()
    differ = [r for r in range(every.shape[0]) if not torch.equal(every[r], every[me])]
    if not differ:
        return
    other = differ[0]
    mine, theirs = lines, _objects._gather_object(lines, group)[other]  # every replica is here
    at = next(
        (k for k, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs))
    )
    here = mine[at] if at < len(mine) else "(no more leaves)"
    there = theirs[at] if at < len(theirs) else "(no more leaves)"
    message = (
        f"{name}: replicas disagree (first difference, item {at}): "
        f"this replica (rank {me}) has {here}; rank {other} has {there}"
    )
    if error is None:
        raise CollectiveMismatchError(message)
    raise type(error)(f"{error} [{message}]") from error
