"""Cross-replica consistency check: a clear error on every replica instead of a
hang or silently wrong data when replicas make different calls.

Before a call communicates, every replica describes it (function, parameters,
tree structure, each leaf's path, dtype and shape (a reduce's: and its
reduction), or the local error that stopped it) and exchanges a 32-byte
SHA-256 of that description: the same size
on every replica, whatever their trees, so the exchange itself cannot hang on
mismatched input. It runs on its own (on XLA, a graph of just the exchange: the
caller's pending work differs between replicas exactly when their calls do). If
the digests differ, every replica exchanges the descriptions and raises
:class:`CollectiveMismatchError` naming the first difference.

A description's per-leaf part depends only on the tree's signature and is
built once per cached plan, so a checked call costs one 32-byte exchange.

When it runs (``XCOLL_CHECK`` or :func:`consistency_checks`): ``"guard"`` (the
default) on each replica's first call on each process group (or XLA world),
whichever thread makes it, so that a structure that differs from the start of
a run is named before any engine sees mismatched buffers, and after the guard
(``_guard``), which every call carries, has found a difference; ``"always"``
on every call (one more small collective per call: docs/reliability.md has its
measured cost); ``"never"`` turns both the check and the guard off.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._backends.base import Transport
from .._base import tree as _tree
from . import exchange as _exchange

MODES = ("guard", "always", "never")
_local = threading.local()  # the mode set by consistency_checks, per thread


class CollectiveMismatchError(RuntimeError):
    """Replicas made different collective calls; raised on every replica.

    The message names the call and the first difference, with what this
    replica and the first disagreeing one have, e.g. ``xcoll.gather: replicas
    made different calls; the first difference: this replica (rank 0) has
    tree['b']: float32 tensor of shape (2, 3); rank 1 has tree['b']: float32
    tensor of shape (2, 4)``. Where the replicas' leaf paths differ, it names
    first the paths each lacks (``replicas made different calls; their leaves
    differ: rank 1 lacks tree['acc']. The first difference: ...``). Every
    xcoll call raises it where the replicas' trees, parameters or tags
    differ; the replicas can go on with their next call (docs/reliability.md).
    """


CollectiveMismatchError.__module__ = "xcoll"  # where users import it from


@contextlib.contextmanager
def consistency_checks(mode: str) -> Iterator[None]:
    """Checks the calls that this thread makes inside the block in ``mode``,
    instead of ``XCOLL_CHECK``'s (default ``"guard"``).

    Args:
        mode: ``"guard"`` (a replica's first call on each process group is
            checked in full, and every call carries the guard), ``"always"``
            (every call is checked in full before it communicates: one small
            collective more per call, which names every difference before any
            engine sees a buffer) or ``"never"`` (neither). Every replica must
            use the same mode.

    Returns:
        A context manager; the previous mode is back when its block ends.

    Raises:
        ValueError: ``mode`` is not one of the three (on entering the block).

    >>> import torch, xcoll
    >>> with xcoll.consistency_checks("always"):
    ...     xcoll.reduce(torch.tensor([1.0]))
    tensor([1.])
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    previous = getattr(_local, "mode", None)
    _local.mode = mode
    try:
        yield
    finally:
        _local.mode = previous


# The groups this process has made a call on, by Transport.group_key: "guard"
# checks the first call of this process (of this replica, on XLA) on each group,
# whichever thread makes it, so that every member of a group agrees on which
# call is its first (a first call on a sub-group is not one on the world).
_called: set[Hashable] = set()
_called_lock = threading.Lock()


# ``XCOLL_CHECK``, read on every call as one lookup in os.environ's own dict
# (``os.environ.get`` makes five Python-level calls); the same value, which a
# program may change at any time.
_ENVIRON: dict[Any, Any] | None = getattr(os.environ, "_data", None)
_KEY = os.environ.encodekey("XCOLL_CHECK") if _ENVIRON is not None else None


def mode() -> str:
    """This thread's mode: :func:`consistency_checks`, else ``XCOLL_CHECK``."""
    # (lookups, not calls: this runs on every call's path)
    state = _local.__dict__
    m = state["mode"] if "mode" in state else None
    if m is None:
        if _ENVIRON is not None:
            try:  # (one lookup: another thread may unset the variable meanwhile)
                raw = _ENVIRON[_KEY]
            except KeyError:
                raw = None
        else:
            raw = os.environ.get("XCOLL_CHECK")
        m = "guard" if raw is None else raw if raw.__class__ is str else os.environ.decodevalue(raw)
        if not m:  # (an empty variable is unset, as tools treat it)
            m = "guard"
    if m not in MODES:
        raise ValueError(f"XCOLL_CHECK must be one of {MODES}, got {m!r}")
    return m


def due(transport: Transport, m: str) -> bool:
    """Whether this public call, on ``transport``'s group, in mode ``m``, is
    checked before it communicates; counts it, unless the mode is "never"
    (such a call checks nothing, so the group's first checked call is still
    to come)."""
    if m == "never":
        return False
    if transport.group_key in _called:  # (a group's first call has been counted)
        return m == "always"
    with _called_lock:
        first = transport.group_key not in _called
        _called.add(transport.group_key)
    return m == "always" or first


@dataclass(frozen=True)
class Description:
    """What a call's replicas must agree on, one line per item; compared by
    its SHA-256, which is computed once."""

    lines: tuple[str, ...]

    @functools.cached_property
    def digest(self) -> bytes:
        return _exchange.sha256("\n".join(self.lines))


#: The description of a call without a tree (a barrier, a step's end, an
#: object's or an RNG state's call): one object, whose digest is made once.
NO_TREE = Description(())


def describe(
    flat: _tree.Flat,
    uneven_dims: dict[int, int] | None = None,
    reductions: Sequence[str] | None = None,
) -> Description:
    """One line per leaf (path, dtype and shape, an uneven leaf's growing dim
    as *, a reduce's leaf's reduction, shown as ``op=``, the public argument's
    name), then the tree's structure. Object addresses (a function as
    a dict key, a defaultdict's factory) differ between processes and are
    left out."""
    lines = []
    for i, (path, leaf) in enumerate(zip(flat.paths, flat.leaves, strict=True)):
        if isinstance(leaf, torch.Tensor):
            shape: list[int | str] = list(leaf.shape)
            if uneven_dims and i in uneven_dims:
                shape[uneven_dims[i]] = "*"
            what = f"{str(leaf.dtype).removeprefix('torch.')} tensor of shape ({', '.join(map(str, shape))})"
        else:
            what = f"Python {type(leaf).__name__}"
        lines.append(f"{path}: {what}" + (f" op={reductions[i]}" if reductions else ""))
    lines.append(f"structure: {flat.treespec}")
    return Description(tuple(_tree.ADDRESS.sub("", line) for line in lines))


def verify(
    transport: Transport,
    name: str,
    head: str,
    body: Description | None = None,
    error: Exception | None = None,
    *,
    tag: str,
) -> None:
    """Compares this replica's call (``name``, its step ``tag``, ``head``: its
    parameters, ``body``: its tree, or the local ``error`` that stopped it)
    with every replica's. Raises on every replica if any differs:
    :class:`CollectiveMismatchError`, or the local error (extended with the
    first difference) where there was one."""
    lines = [f"call {name}", f"tag: {tag or '(none)'}", f"parameters: {head or '(none)'}"]
    if error is not None:  # named first: it is what the other replicas should see
        lines.insert(1, f"error: {type(error).__name__}: {error}")
        body = NO_TREE
    assert body is not None
    digest = _exchange.sha256("\n".join([*lines, body.digest.hex()]))
    differ = _exchange.differing(transport, digest)
    if not differ:
        return
    other = differ[0]
    text = "\n".join([*lines, *body.lines])
    every = _exchange.gather_bytes(transport, text.encode("utf-8", "surrogatepass"))
    assert every is not None
    # (mine split as theirs is: a tag with a newline is two lines on both sides)
    mine = text.split("\n")
    theirs = (every[other] or b"").decode("utf-8", "surrogatepass").split("\n")
    message = f"{name}: {_difference(transport, mine, theirs, other)}"
    if error is None:
        raise CollectiveMismatchError(message)
    raise type(error)(f"{error} [{message}]") from error


def _difference(transport: Transport, mine: list[str], theirs: list[str], other: int) -> str:
    """The first line where two replicas' descriptions differ, as a sentence
    (after the paths each lacks, where their leaves differ: :func:`_lacks`)."""
    at = next(
        (k for k, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b),
        min(len(mine), len(theirs)),
    )
    here = mine[at] if at < len(mine) else "no more leaves"
    there = theirs[at] if at < len(theirs) else "no more leaves"
    me, them = transport.rank_name(transport.rank()), transport.rank_name(other)
    if there.startswith("error: "):
        return f"{them} raised before communicating ({there.removeprefix('error: ')})"
    if here.startswith("error: "):
        return f"this replica ({me}) raised before communicating; {them} did not"
    first = f"first difference: this replica ({me}) has {here}; {them} has {there}{_fix(mine, here, there)}"
    lacks = _lacks(mine, theirs, me, them)
    if lacks:
        return f"replicas made different calls; {lacks}. The {first}"
    return f"replicas made different calls; the {first}"


def _fix(mine: list[str], here: str, there: str) -> str:
    """The fix, where the difference is the one users make most: a gather
    (not uneven, not stacked) of a leaf whose size along the gathered dim
    alone differs between replicas (the last batch of an epoch, a shard of
    its own length)."""
    params = f" {mine[2] if len(mine) > 2 else ''} "
    found = re.search(r" dim=(-?\d+) stack=False uneven=False ", params)
    a, b = here.rpartition(" of shape "), there.rpartition(" of shape ")
    if mine[0] != "call xcoll.gather" or found is None or not (a[1] and b[1] and a[0] == b[0]):
        return ""
    mine_shape, their_shape = _shape(a[2]), _shape(b[2])
    if not mine_shape or len(mine_shape) != len(their_shape):
        return ""
    differ = [k for k, (m, t) in enumerate(zip(mine_shape, their_shape, strict=True)) if m != t]
    if differ != [int(found.group(1)) % len(mine_shape)]:
        return ""
    return " (a leaf whose size along dim differs between replicas: gather it with uneven=True)"


def _shape(text: str) -> tuple[int, ...]:
    """A description's shape, ``(2, 3)``, as ints (empty where it is not one)."""
    inner = text.strip().removeprefix("(").removesuffix(")")
    parts = [p.strip() for p in inner.split(",") if p.strip()]
    return tuple(int(p) for p in parts) if all(p.isdigit() for p in parts) else ()


#: The paths each side's list of lacking leaves names, before a count of the rest.
_LISTED = 3


def _lacks(mine: list[str], theirs: list[str], me: str, them: str) -> str:
    """Which leaf paths each replica lacks, where two calls with the same
    header (call, tag, parameters) differ in their sets of paths: read line
    by line, a missing key looks like a renamed one. Empty otherwise."""
    (head, paths), (their_head, their_paths) = _parts(mine), _parts(theirs)
    if head != their_head or paths.keys() == their_paths.keys():
        return ""
    mine_lacks = [p for p in their_paths if p not in paths]
    they_lack = [p for p in paths if p not in their_paths]
    sides = [f"this replica ({me}) lacks {_listing(mine_lacks)}"] if mine_lacks else []
    sides += [f"{them} lacks {_listing(they_lack)}"] if they_lack else []
    return "their leaves differ: " + "; ".join(sides)


def _parts(lines: list[str]) -> tuple[list[str], dict[str, None]]:
    """A description's header lines (before its first leaf) and its leaves'
    paths, in order. A leaf's line is ``path: what``: ``what`` (a dtype and
    shape, a Python type, a reduction) holds no ": ", its path may."""
    leaves = [k for k, line in enumerate(lines) if line.startswith("tree")]
    end = leaves[0] if leaves else len(lines) - 1
    return lines[:end], {lines[k].rsplit(": ", 1)[0]: None for k in leaves}


def _listing(paths: list[str]) -> str:
    shown = ", ".join(paths[:_LISTED])
    return shown if len(paths) <= _LISTED else f"{shown} and {len(paths) - _LISTED} more"
