"""A step block (:class:`step`): its calls tagged (:mod:`xcoll._guard.steps`),
and its end checked, so that no result of a block whose replicas made
different calls inside it leaves the block quietly.

A replica that skips a call inside a block (its own code raised before it,
and the block's code caught that and went on) pairs its next call with the
others' skipped one; where both come from one line (a loop over a dict's
keys), their tags agree, and nothing at that call can tell them apart. The
block's end can: on each process group the block used, the replicas exchange
its number of calls there, in a small guarded call of its own ("xcoll.step",
whose guard carries the count: an exchange of a small call's size, so that
it meets any other small call, whatever its kind; on XLA, an execution of
its own, of the program every small call runs). It is the group's next
call: the block's ``sync=False`` calls complete before it. A replica one
call behind meets another's
last call with its end instead, and both raise, naming both calls; replicas
whose counts differ raise naming both counts. A block inside which an xcoll
call raised :class:`CollectiveMismatchError`, even one its own code caught,
raises at its end without communicating (its replicas' later calls may have
paired with other ones).
"""

from __future__ import annotations

import sys
from types import TracebackType

from ._backends.base import Transport
from ._encode import pack as _pack
from ._guard import check as _check
from ._guard import exchange as _exchange
from ._guard import steps as _steps
from ._guard import verdict as _verdict
from ._guard.entry import entered


class step:
    """Tags every xcoll call that this thread makes inside the block, and
    checks at the block's end that every replica made the same calls in it.

    A call's tag becomes ``step <tags of the open blocks, outermost first>,
    call <n> at <place>``, where ``n`` counts the calls on the call's process
    group since the innermost block opened, and ``place`` is where the
    program made the call: ``line <n> in <function>`` for each frame from
    the call up to the block's ``with`` line (at most 8), leaving out
    xcoll's and torch's own frames, and naming no file (so
    replicas agree whatever their files are called, where one compiles a
    function that another runs eagerly, or where the block is opened by a
    context manager of the user's). So a replica whose own code raised before a call (caught inside
    the block) and that goes on to the step's next call is named at that
    call. At the block's end, the replicas compare their numbers of calls in
    it on each process group it used (one small collective per group, on XLA
    one execution; none with ``XCOLL_CHECK=never`` or in a world of one;
    the block's ``sync=False`` calls complete first): where a replica
    skipped a call of a loop (the others' calls from the same line carry the
    same tag), every replica raises :class:`xcoll.CollectiveMismatchError`
    by the block's end, naming both calls or both counts, and a block inside
    which a call raised it (even where the block's code caught it) raises it
    again at its end. Every replica must open the same blocks around the
    same calls. A call with ``tag=`` inside a block is named by the blocks
    and that tag, not by its place: give one ``tag=`` to a call that
    different replicas make from different lines (``if rank == 0:
    xcoll.broadcast(x) else: xcoll.broadcast(y)``).

    Args:
        tag: the step's name, a str or an int (e.g. the batch index).

    Raises:
        TypeError: ``tag`` is neither a str nor an int.
        xcoll.CollectiveMismatchError: at the block's end, as above.

    >>> import torch, xcoll
    >>> for batch in range(2):
    ...     with xcoll.step(batch):
    ...         total = xcoll.reduce(torch.tensor([1.0]))
    >>> total
    tensor([1.])
    """

    def __init__(self, tag: str | int):
        self.label = _steps.check(tag)

    def __enter__(self) -> None:
        _steps.opened(self.label, sys._getframe(1))

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        block = _steps.closed()
        if value is not None:  # (its own error leaves the block: nothing more to check)
            return
        if block.failed:
            raise _check.CollectiveMismatchError(
                f"xcoll.step({self.label}): a call inside this step raised "
                "CollectiveMismatchError (caught inside the step): the replicas' calls in it "
                "differ, and its results may be other calls'"
            )
        if _check.mode() == "never":
            return
        for transport, count in block.groups.values():
            if transport.world > 1:
                _ended(transport, block.prefix, count)


def _ended(t: Transport, prefix: str, count: int) -> None:
    """The block's end on ``t``'s group: a small guarded exchange whose guard
    carries the block's number of calls there (as :func:`xcoll.barrier`'s:
    one all-gather of a small call's size, which meets any small call)."""
    head = f"calls={count}"
    with entered(t, "xcoll.step", head, _check.NO_TREE, tag=_steps.Identity(prefix)) as signature:
        if signature is None:  # (this replica's mode is "never": the others' verdict names it)
            return
        sent = _exchange.sha256(signature.fingerprint().hex())
        # (built in the size class, which the exchange would pad it to)
        every = t.exchange(_exchange.bytes_tensor(sent, _pack.SMALL))
        if not bool((every == every[t.rank()]).all()):
            _verdict.fire(t, signature)
