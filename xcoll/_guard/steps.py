"""Step tags: which step of the program a call belongs to, and where in the
program it is made, in its fingerprint.

Collectives pair by order: a replica that skips a call (its own code raised
before it, the error was caught, the loop went on) pairs its next call with the
others' skipped one, and where the two calls have the same signature nothing
else can tell them apart. A tag names the call: ``tag=`` on the call itself,
or every :func:`step` block around it (per thread: on XLA a replica is a
thread), with the call's number within the innermost block on its process
group and its place in the program: the lines, from the call up to the
block's own line, that led to it. The tag is part of the call's fingerprint,
so it costs no collective, and calls whose tags differ raise
:class:`xcoll.CollectiveMismatchError` on every replica, naming both tags.

A call's place is read from the interpreter's frames: each frame's function
and line from the call up to the block's ``with`` line, leaving out
xcoll's and torch's frames, and naming no file (replicas that
run one program agree, however their files are named, whether a function
is compiled on one and not another, or a block is opened by the user's own
context manager), about a microsecond per call. A difference that places
cannot see (two calls on one line, a loop) is found at the block's end,
which compares the replicas' numbers of calls (:mod:`xcoll._step`). Two calls that are the same collective
on purpose but are made from different lines on different replicas (a branch
on the rank around the call) must say so with the same ``tag=``, which names
the call instead of its place.

A differentiable call's backward carries its forward's :class:`Identity` (the
forward's tag, or for an untagged forward its number among this thread's
calls on its group, which does not count a call that raised before
communicating: :func:`uncount`), not the blocks open when the backward runs: a backward pairs only with the backward of
the same forward call, whichever thread runs it.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
import threading
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import Any

_local = threading.local()  # this thread's open step blocks, outermost first; its call numbers

#: Frames of a call's place at most (the call's own line first): a step
#: opened far above the call is named by the lines nearest the call.
DEPTH = 8
#: Frames that opened a block, at most: the opener's caller (the ``with``
#: line's frame, or a context manager's generator) and those above it, up to
#: the ``with`` line of a block opened through two context managers.
OPENERS = 6
#: The longest tag text kept as it is; a longer one is cut, its rest hashed.
LONGEST = 80


@dataclass
class _Block:
    #: "step <the open blocks' tags, outermost first>"
    prefix: str
    #: The frames that opened the block (:func:`opening`): a call's place
    #: ends at the first of them it meets.
    stops: frozenset[FrameType]
    #: per process group (Transport.group_key), in the order of first use:
    #: its transport and the calls entered on it so far in this block
    groups: dict[Hashable, list[Any]] = field(default_factory=dict)
    #: whether a call inside the block raised CollectiveMismatchError (even
    #: one that the block's own code caught): the block's end raises too
    failed: bool = False


@dataclass(frozen=True)
class Identity:
    """A call's tag given whole (a backward's: its forward's), in place of
    the one its blocks and place would give."""

    text: str


def check(tag: Any) -> str:
    """``tag`` (a str or an int) as it is written in a call's tag: its
    ``repr``, cut to :data:`LONGEST` characters and a hash of the whole where
    it is longer (the hash keeps tags that differ apart)."""
    if isinstance(tag, bool) or not isinstance(tag, (str, int)):
        raise TypeError(f"a step or call tag must be a str or an int, got {type(tag).__qualname__}")
    text = repr(tag)
    if len(text) <= LONGEST:
        return text
    # (a repr escapes what UTF-8 cannot encode, a lone surrogate among them)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return f"{text[: LONGEST - 24]}... (sha256 {digest})"


def opened(label: str, frame: FrameType | None) -> None:
    """Opens a step block named ``label`` (:func:`check`'s text) on this
    thread, whose ``with`` line is in ``frame``."""
    blocks = _local.__dict__.setdefault("blocks", [])
    prefix = f"{blocks[-1].prefix}/{label}" if blocks else f"step {label}"
    blocks.append(_Block(prefix, opening(frame)))


def closed() -> _Block:
    """Closes this thread's innermost step block; returns it."""
    block: _Block = _local.blocks.pop()
    return block


def failed() -> None:
    """Marks this thread's open blocks: a call inside raised
    CollectiveMismatchError (each block's end raises too)."""
    for block in _local.__dict__.get("blocks", ()):
        block.failed = True


def tag(transport: Any, explicit: Any = None) -> tuple[str, int]:
    """The tag of a call entered now on ``transport``'s group, with its own
    ``explicit`` tag ("" for an untagged call outside any block; an
    :class:`Identity` is the tag), and its number among this thread's calls
    on that group (what a backward names its forward by)."""
    group_key = transport.group_key
    state = _local.__dict__  # (this thread's: its call numbers, its open blocks)
    numbers = state["numbers"] if "numbers" in state else state.setdefault("numbers", {})
    number = numbers[group_key] = numbers[group_key] + 1 if group_key in numbers else 0
    if explicit is not None and isinstance(explicit, Identity):
        return explicit.text, number
    blocks = state["blocks"] if "blocks" in state else None
    if not blocks and explicit is None:  # (an untagged call outside any block)
        return "", number
    parts = []
    if blocks:
        inner = blocks[-1]
        counted = inner.groups[group_key] if group_key in inner.groups else None
        if counted is None:
            counted = inner.groups[group_key] = [transport, 0]
        n = counted[1]
        counted[1] = n + 1
        where = "" if explicit is not None else f" at {place(inner)}"
        parts.append(f"{inner.prefix}, call {n}{where}")
    if explicit is not None:
        parts.append(f"tag={check(explicit)}")
    return "; ".join(parts), number


def uncount(group_key: Hashable) -> None:
    """Takes back the number that :func:`tag` gave this thread's last call
    on ``group_key``'s group: a call that raised before communicating
    paired with no other replica's call, and a backward is named by its
    forward's number, which must stay the same on every replica. (Its
    step's count keeps it: the step's next call is named apart, so that a
    replica whose call raised alone is found.)"""
    _local.numbers[group_key] -= 1


# The ids and lines of a place's frames -> its text, and the code objects
# (kept, so that no id is reused while it is a key); cleared when it grows
# past _SITES entries (code made at run time, by exec, is new each time).
# (ids, not code objects: a code object's hash reads its whole body)
_places: dict[tuple[int, ...], tuple[str, tuple[CodeType, ...]]] = {}
_SITES = 4096
#: Modules whose frames are not part of a place: xcoll's own, torch's and
#: torch_xla's (a compiled function's wrappers, autograd, launchers)
_PLUMBING = ("xcoll._", "torch.", "torch_xla.")
_plumbing: dict[str, bool] = {"torch": True, "torch_xla": True}
#: The name Dynamo gives the rest of a compiled function after a graph
#: break (``torch_dynamo_resume_in_<function>_at_<line>``)
_RESUMED = "torch_dynamo_resume_in_"
_R = len(_RESUMED)  # (a slice's comparison, not startswith: no call per frame)


def place(block: _Block) -> str:
    """Where the program made the call now being entered: its frames from
    the call up to the one that opened ``block`` (the first it shares with
    the block's opening), at most :data:`DEPTH` of them, innermost first,
    leaving out plumbing (:data:`_PLUMBING`), and each named by its
    function and line, not its file: replicas that run one program agree,
    whether a function was compiled by Dynamo on one and not another, a
    file reached under two names, or a notebook cell named per replica.

    A call that runs inside a graph compiled by torch.compile
    (:mod:`xcoll._core.traced`) has no frames of its own below the compiled
    function's: its :class:`Traced` place, read while Dynamo traced it, is
    taken for them."""
    f: FrameType | None = sys._getframe(1)
    stops = block.stops
    sites: list[tuple[CodeType, int]] = []
    key: list[int] = []
    traced: Traced | None = _local.traced if "traced" in _local.__dict__ else None
    while f is not None and len(sites) < DEPTH:
        if traced is not None and f.f_code.co_name != traced.root:
            f = f.f_back  # (the graph's own frames, below the compiled function's)
            continue
        g = f.f_globals
        module = g["__name__"] if "__name__" in g else ""
        if traced is not None or not (_plumbing[module] if module in _plumbing else _is_plumbing(module)):
            code, line = f.f_code, f.f_lineno
            if code.co_name[:_R] == _RESUMED:
                f, code = _resumed(f)
            if traced is not None:  # (the compiled function: at its line that Dynamo traced)
                line, traced = traced.line, None
                key.append(id(_local.traced))
            sites.append((code, line))
            key += (id(code), line)
        if f in stops:
            break
        f = f.f_back
    known = _places.get(tuple(key))
    if known is not None:
        return known[0]
    if len(_places) >= _SITES:
        _places.clear()
    inner = _local.traced.inner if "traced" in _local.__dict__ else ()
    text = " <- ".join((*inner, *(_named(code, line) for code, line in sites))[:DEPTH])
    _places[tuple(key)] = (text, tuple(code for code, _ in sites))
    return text


@dataclass(frozen=True)
class Traced:
    """The place of a call traced into a compiled graph, as Dynamo traced
    it: the frames below the compiled function, named (innermost first),
    and the compiled function's line."""

    inner: tuple[str, ...]
    #: The compiled function's name (of its code: a resume function's, past
    #: a graph break) and line.
    root: str
    line: int


@contextlib.contextmanager
def traced(where: Traced | None) -> Iterator[None]:
    """Within the block, this thread's calls were traced at ``where`` (None:
    where they are made)."""
    if where is None:
        yield
        return
    _local.traced = where
    try:
        yield
    finally:
        del _local.traced


def traced_place(frames: list[tuple[CodeType, int, str]]) -> Traced | None:
    """:class:`Traced` of a call whose frames, from the call up to the
    compiled function, are ``frames`` (code, line, module), as Dynamo
    traces them (None: none were read)."""
    if not frames:
        return None
    *inner, (root, line, _) = frames
    named = tuple(_named(code, n) for code, n, module in inner if not _is_plumbing(module))
    return Traced(named, root.co_name, line)


def _resumed(f: FrameType) -> tuple[FrameType, CodeType]:
    """Dynamo's resume function ``f`` (the rest of a compiled function past
    a graph break, at the source's lines) and the frames of that function
    above it, as the one frame an eager run has there: returns the last of
    them and the code that names them (the function's own)."""
    name = f.f_code.co_name[_R:].rpartition("_at_")[0]
    g = f.f_back
    while g is not None and g.f_code.co_name[:_R] == _RESUMED:
        g = g.f_back
    if g is None or g.f_code.co_name != name:  # (not as Dynamo makes them: named as it is)
        return f, f.f_code
    return g, g.f_code


def opening(frame: FrameType | None) -> frozenset[FrameType]:
    """The frames that opened a block: ``frame`` (the opener's caller) and
    the :data:`OPENERS` - 1 above it. A call's place ends at the first of
    them it meets: the frame of the ``with`` line, also where the block is
    opened by the user's own context manager (whose frames, and
    contextlib's, are not above the block's calls)."""
    chain: tuple[FrameType, ...] = ()
    for _ in range(OPENERS):  # (no call per frame: they are host work per step)
        if frame is None:
            break
        chain += (frame,)
        frame = frame.f_back
    return frozenset(chain)


def _is_plumbing(module: str) -> bool:
    _plumbing[module] = yes = module.startswith(_PLUMBING)
    return yes


def _named(code: CodeType, line: int) -> str:
    name = getattr(code, "co_qualname", code.co_name)  # (3.11+)
    return f"line {line} in {name}"
