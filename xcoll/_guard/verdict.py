"""The guard's verdict: what arrived read (:func:`arrived`) and checked
(:func:`check`), at once or, for a ``sync=False`` call on a lazy engine,
once a sync has run it (:class:`Deferred`); what a replica says when the
header disagrees (:func:`fire`: the same error on every replica, naming the
first difference); and what the watchdog says when a call waits
(:func:`diagnosis`, :func:`causes`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn, cast

import torch

from .._backends.base import Transport
from . import check as _check
from . import watchdog as _watchdog
from .header import Guard, Signature, as_bytes


def arrived(g: Guard, transport: Transport, result: torch.Tensor) -> bytes:
    """The header part of a collective's ``result`` under guard ``g``
    (eager engines), downloaded alone."""
    first = result[: g.size] if g.rows == 1 else result.view(g.rows, -1)[:, : g.size]
    return as_bytes(transport.to_host([first])[0])


def settle(transport: Transport) -> None:
    """Reads the verdicts of ``sync=False`` calls that a sync has run (:class:`Deferred`,
    which the engine held: :meth:`Transport.ready`); each raises where the
    replicas' calls differ, on every replica. Called at each call's entry
    and after each of xcoll's syncs on a lazy engine, never inside a
    caller's own sync or lock (the read waits for the execution, and so for
    every replica)."""
    # (what the engine holds is what :meth:`Deferred.of` made: it reads only the header)
    ready = cast("list[Deferred]", transport.ready())
    if not ready:
        return
    for verdict in ready:  # (every one, before any raises)
        verdict.read()
    for verdict, host in zip(ready, transport.to_host([v.header for v in ready]), strict=True):
        verdict.check(host)


def synced(transport: Transport, tensors: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
    """``tensors`` on the host after one sync of what is pending (the
    caller's work too) and one fetch: :meth:`Transport.sync_and_fetch`, or
    :meth:`Transport.sync` where there is nothing to fetch (a no-op on an
    eager engine). Then, on a lazy engine, the verdicts of the earlier
    ``sync=False`` calls that the sync ran (:func:`settle`). Every sync that
    xcoll's calls make goes through here; one that a transport makes inside
    a step of its own (a small call's fetch of a pending leaf, the full
    check's exchange) is read at the next call's entry."""
    if tensors:
        out = transport.sync_and_fetch(tensors)
    else:
        out = []
        transport.sync()
    if transport.lazy:
        settle(transport)
    return out


def check(transport: Transport, signature: Signature | None, got: bytes, expected: bytes) -> None:
    """The verdict: the header that arrived is the same on every replica, so
    is the verdict; raises (:func:`fire`) where it is not ``expected``."""
    if got != expected:
        fire(transport, signature)


def fire(
    transport: Transport,
    signature: Signature | None,
    src: int | None = None,
) -> NoReturn:
    """Raises :class:`CollectiveMismatchError` for a call whose header says the
    replicas' calls differ. Every replica gets the same verdict, so they all
    exchange their descriptions, and the error names the first difference and
    both ranks. ``src``: a one-sided verdict (a receiver of ``src``'s
    broadcast), which exchanges nothing (``src`` has returned)."""
    s = signature
    rank = transport.rank_name(transport.rank())
    if s is None:  # this replica runs in mode "never", others do not
        raise _check.CollectiveMismatchError(
            f"{rank}: the replicas' calls differ, or their XCOLL_CHECK modes do (this "
            "replica's is \"never\"; every replica must use the same mode)"
        )
    if src is not None:
        raise _check.CollectiveMismatchError(
            f"{s.name}: this replica's call ({rank}: {summary(s)}) differs from the call of "
            f"src, {transport.rank_name(src)}; run with XCOLL_CHECK=always to name the difference"
        )
    try:
        _check.verify(transport, s.name, s.head, s.description, tag=s.tag)
    except RuntimeError as e:
        if isinstance(e, _check.CollectiveMismatchError):
            raise
        # a replica that the engine stopped (gloo aborts a rank whose buffer
        # is smaller than the one it receives) cannot take part
        raise _check.CollectiveMismatchError(
            f"{s.name}: the replicas' calls differ (the guard's fingerprints disagree on "
            f"{rank}: {summary(s)}); naming the difference failed: {e}"
        ) from e
    raise _check.CollectiveMismatchError(
        f"{s.name}: the guard's fingerprints disagree on {rank}, but the replicas' "
        "descriptions agree: their XCOLL_CHECK modes differ, a call overlapped another on "
        "this process group, or a header changed in transit"
    )


def summary(s: Signature) -> str:
    """The call in a line: its tag, parameters and its description's first
    three lines ("..." where there are more)."""
    lines = s.description.lines  # (each leaf's, then the structure's)
    n = len(lines) - 1
    leaves = (
        f"{n} {'leaf' if n == 1 else 'leaves'}: "
        + "; ".join(lines[:3])
        + ("; ..." if len(lines) > 3 else "")
        if n > 0
        else "no leaves"
    )
    return f"tag: {s.tag or '(none)'}; parameters: {s.head or '(none)'}; {leaves}"


def diagnosis(rank: str, signature: Signature, seconds: float, lazy: bool = False) -> str:
    """What the watchdog prints when a call has waited ``seconds`` for the
    other replicas (``rank``: named on the replica's thread; on XLA the rank
    is per thread; ``lazy``: on XLA, whose own causes it names too)."""
    return (
        f"xcoll: {signature.name} on {rank} has waited {seconds:.0f} s for the other replicas. "
        f"This replica's call: {summary(signature)}; description "
        f"{signature.description.digest.hex()[:16]}. {causes(lazy)}"
    )


def causes(lazy: bool) -> str:
    """What can make a replica wait in a collective, as far as xcoll can tell
    from here: the causes on every engine, and on XLA (``lazy``) the
    programs."""
    found = [
        "a replica has not reached this call (its code raised before it and went on, or it "
        "is still in an earlier call; tag the calls, tag= or xcoll.step, to name a skipped one)",
        "a replica made a different call whose buffers differ in size (XCOLL_CHECK=always "
        "names it)",
    ]
    if lazy:
        found.append(
            "the replicas' programs differ: work pending before the call traced from a "
            "per-replica Python value (a factor 0 or 1, as in x * rank, is a constant on that "
            "replica alone), a data-dependent shape, pending tensors that only a reference "
            "cycle keeps alive (a dropped metric object) on replicas whose garbage collector "
            "has not run yet, or a torch_xla.sync() or .item() of "
            "pending collectives outside xcoll.sync() (README, 'On XLA: one program on every "
            "replica')"
        )
    listed = "; ".join(f"({k}) {c}" for k, c in enumerate(found, 1))
    return (
        f"Causes that fit this wait: {listed}. The engine then times out, or XLA aborts the "
        "process."
    )


@dataclass(frozen=True)
class Deferred:
    """The verdict of a call made with ``sync=False`` on a lazy engine, read
    once a sync has run the call (:func:`settle`, at the device's
    next xcoll call or sync): ``header`` is then data, and reading it is a
    transfer, not an execution. A verdict that disagrees raises there, on
    every replica."""

    transport: Transport
    signature: Signature
    #: The header's piece of the call's result, on the device.
    header: torch.Tensor
    expected: bytes
    #: Where the replicas are threads, the watchdog's hint until it is read.
    watch: _watchdog.watch | None

    @classmethod
    def of(
        cls, transport: Transport, signature: Signature, header: torch.Tensor, expected: bytes
    ) -> Deferred:
        """A new verdict, watched where the replicas are threads: a replica
        that reads an output before any sync has run the call (``.item()``,
        ``.cpu()``, ``print``) runs its graph alone, compiled apart from the
        other replicas', and XLA aborts the process; the hint comes first."""
        watch = None
        if transport.replica_threads:
            rank = transport.rank_name(transport.rank())
            watch = _watchdog.watch(functools.partial(_unread, signature.name, rank))
        return cls(transport, signature, header, expected, watch)

    def read(self) -> None:
        """Ends the watch: a sync has run the call."""
        if self.watch is not None:
            self.watch.__exit__()

    def check(self, header: torch.Tensor) -> None:
        """Raises where ``header`` (:attr:`header`, fetched) is not :attr:`expected`."""
        check(self.transport, self.signature, as_bytes(header), self.expected)


def _unread(name: str, rank: str, seconds: float) -> str:
    return (
        f"xcoll: {name} on {rank}, made with sync=False {seconds:.0f} s ago, has not been "
        "run by a sync yet (xcoll.sync(), torch_xla.sync(), or a later xcoll call). If this "
        "replica waits in an .item(), .cpu() or print of a tensor computed from its "
        "outputs: on XLA:CPU replica threads, that graph is compiled once per replica, "
        "their collectives never meet, and XLA aborts the process; call xcoll.sync() "
        "before reading the outputs (docs/launchers.md)."
    )
