"""A replica whose process exits says so, naming its last call on each of
its groups, so that the replicas still waiting for it name it and that
call, instead of only the engine's "connection closed by peer".

Each call's entry records its group's last call (:data:`last`: one dict
entry, no message made); at interpreter exit, :func:`_say_left` writes each
one's text where the engine keeps one (torch.distributed: the job's store),
before the engine's connections close. Where the process is killed, or its
default process group was destroyed first, nothing is written: the waiting
replicas then get the engine's own error (docs/reliability.md).
"""

from __future__ import annotations

import atexit
import time
from collections.abc import Hashable

from .._backends.base import Transport
from .header import Signature
from .verdict import summary

#: Each group's last call entered by this process: its transport and signature.
last: dict[Hashable, tuple[Transport, Signature]] = {}


def _say_left() -> None:
    for t, s in list(last.values()):
        try:
            t.say_left(f"its call {s.number + 1} on the group, {s.name} ({summary(s)})")
        except Exception:  # (an exit must not fail for a message: the store may be gone)
            pass


atexit.register(_say_left)


#: Seconds a replica whose collective failed waits for a peer's word that it
#: left: a clean exit closes the group's connections (destroy_process_group)
#: before the interpreter's exit hooks run, which say it.
PATIENCE = 3.0


def who_left(t: Transport) -> str:
    """The replicas of ``t``'s group that said they left, each with its last
    call ("" where none did within :data:`PATIENCE` seconds, or it cannot be
    read)."""
    deadline = time.monotonic() + PATIENCE
    while True:
        try:
            found = t.left()
        except Exception:  # (the store's host may be the one that left)
            return ""
        if found or time.monotonic() > deadline:
            break
        time.sleep(PATIENCE / 30)
    return "".join(f"{t.rank_name(r)} has left (its process exited) after {text}; " for r, text in found)
