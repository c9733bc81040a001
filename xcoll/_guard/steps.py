"""Step tags: which step of the program a call belongs to, in its fingerprint.

Collectives pair by order: a replica that skips a call (its own code raised
before it, the error was caught, the loop went on) pairs its next call with the
others' skipped one, and where the two calls have the same signature nothing
else can tell them apart. A tag names the call: ``tag=`` on the call itself,
and every :func:`step` block around it (per thread: on XLA a replica is a
thread), with the call's number within the innermost block on its process
group. The tag is part of the call's fingerprint, so it costs no collective,
and calls whose tags differ raise :class:`xcoll.CollectiveMismatchError` on
every replica, naming both tags.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

_local = threading.local()  # this thread's open step blocks, outermost first


@dataclass
class _Block:
    label: str
    #: calls entered so far in this block, per process group (Transport.group_key)
    calls: dict[Hashable, int] = field(default_factory=dict)


def check(tag: Any) -> str:
    """``tag`` (a str or an int) as it is written in a call's tag."""
    if isinstance(tag, bool) or not isinstance(tag, (str, int)):
        raise TypeError(f"a step or call tag must be a str or an int, got {type(tag).__qualname__}")
    return repr(tag)


class step:
    """Tags every xcoll call that this thread makes inside the block.

    A call's tag becomes ``step <tags of the open blocks, outermost first>,
    call <n>``, where ``n`` counts the calls on the call's process group
    since the innermost block opened (so a replica whose call raised on its
    own, before communicating, and that goes on, is named at its next call
    too). Every replica must open the same blocks around the same calls;
    where a replica's call meets a call with another tag, every replica
    raises :class:`xcoll.CollectiveMismatchError` naming both.

    Args:
        tag: the step's name, a str or an int (e.g. the batch index).

    Raises:
        TypeError: ``tag`` is neither a str nor an int.

    >>> import torch, xcoll
    >>> for batch in range(2):
    ...     with xcoll.step(batch):
    ...         total = xcoll.reduce(torch.tensor([1.0]))
    >>> total
    tensor([1.])
    """

    def __init__(self, tag: str | int):
        self.label = check(tag)

    def __enter__(self) -> None:
        blocks = _local.__dict__.setdefault("blocks", [])
        blocks.append(_Block(self.label))

    def __exit__(self, *exc: object) -> None:
        _local.blocks.pop()


def tag(group_key: Hashable, explicit: Any = None) -> str:
    """The tag of a call entered now on ``group_key``'s group (counted in the
    innermost open block), with its own ``explicit`` tag: "" for an untagged
    call outside any block."""
    blocks = getattr(_local, "blocks", None)
    parts = []
    if blocks:
        inner = blocks[-1]
        n = inner.calls.get(group_key, 0)
        inner.calls[group_key] = n + 1
        parts.append(f"step {'/'.join(b.label for b in blocks)}, call {n}")
    if explicit is not None:
        parts.append(f"tag={check(explicit)}")
    return "; ".join(parts)
