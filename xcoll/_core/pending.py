"""Calls in flight on an eager engine (torch.distributed): a call made with
``sync=False`` starts its collectives and returns at once; its outputs are
:class:`PendingTensor`\\ s, and the call completes (its collectives waited
for, its guard read, its outputs decoded) at the first of:

* :func:`xcoll.sync` (every call in flight of the process, or of the
  ``group=`` it is given);
* the first use of one of its outputs (any operation on it, ``print``,
  ``.item()``, ``.tolist()``, ``.numpy()``), as PyTorch's
  ``AsyncCollectiveTensor`` waits on first use.

Completing one call completes the earlier calls in flight on its group
first, whichever thread made them: a call's collectives after its first are started when it
completes (after its first one's guard header has been read, as a
blocking call does), so that they pair in the same order on every replica.

A call in flight (:class:`Call`) knows how to complete itself; this module
keeps them in order and waits on them.
"""

from __future__ import annotations

import functools
import threading
from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from .._guard import verdict as _verdict
from .._guard import watchdog as _watchdog


class Call(ABC):
    """One ``sync=False`` call in flight, in its order on its group."""

    def __init__(self, group: Hashable, name: str) -> None:
        self.group, self.name = group, name
        # (the earlier call in flight on its group: it completes first)
        self.earlier: Call | None = None
        self.outputs: list[Any] | None = None
        self.failed: str | None = None  # (why it could not complete)

    @abstractmethod
    def complete(self) -> list[Any]:
        """Waits for the call's collectives, reads its guard (raising
        :class:`~xcoll.CollectiveMismatchError` where the replicas' calls
        differ) and returns its output leaves."""

    def output(self, leaf: int) -> torch.Tensor:
        """Output leaf ``leaf``, completing the call (and the earlier ones
        on its group) first if it has not completed."""
        if self.outputs is None:
            completed(self)
        if self.outputs is None:
            raise RuntimeError(
                f"{self.name}: this output does not exist: the call made with sync=False "
                f"failed when it completed ({self.failed})"
            )
        return self.outputs[leaf]


_lock = threading.RLock()  # (an output may be used from another thread)
# {group: the latest call in flight on it}. Per group, not per thread: the
# collectives a completion starts must pair in the calls' order on their
# group on every replica, whichever thread made a call or completes it.
_latest: dict[Hashable, Call] = {}


def started(call: Call) -> None:
    """Puts ``call`` last in its group's order."""
    with _lock:
        call.earlier = _latest.get(call.group)
        _latest[call.group] = call


def completed(call: Call) -> None:
    """Completes ``call``, after the earlier calls on its group."""
    with _lock:
        chain = []
        c: Call | None = call
        while c is not None and c.outputs is None and c.failed is None:
            chain.append(c)
            c = c.earlier
        try:
            for c in reversed(chain):
                c.earlier = None
                try:
                    with _watchdog.watch(functools.partial(_waited, c.name)):
                        c.outputs = c.complete()
                except BaseException as e:
                    c.failed = f"{type(e).__name__}: {e}"
                    raise
        finally:
            # (a completed call is no longer in flight: kept here, its outputs
            # would live until the group's next call, whoever else holds them)
            if _latest.get(call.group) is call:
                del _latest[call.group]


def sync(group: Hashable | None = None) -> None:
    """Completes the process's calls in flight (on ``group``'s key only, if given)."""
    with _lock:
        latest = [_latest.pop(k) for k in list(_latest) if group is None or k == group]
    for call in latest:
        completed(call)


def _waited(name: str, seconds: float) -> str:
    return (
        f"xcoll: {name} made with sync=False has waited {seconds:.0f} s to complete: its "
        f"collectives wait for the other replicas. {_verdict.causes(False)}"
    )


class PendingTensor(torch.Tensor):
    """An output of a ``sync=False`` call in flight on an eager engine: its
    shape, dtype and device are the output's; any operation on it first
    completes the call (:mod:`xcoll._core.pending`), then runs on the value.
    Operations return plain tensors."""

    _call: Call
    _leaf: int
    __slots__ = ("_call", "_leaf")

    @staticmethod
    def __new__(cls, call: Call, leaf: int, like: torch.Tensor, device: torch.device) -> PendingTensor:
        t = torch.Tensor._make_wrapper_subclass(
            cls,
            like.shape,
            strides=like.stride(),
            storage_offset=like.storage_offset(),
            dtype=like.dtype,
            device=device,
            requires_grad=False,
        )
        t._call, t._leaf = call, leaf
        return t

    # (operations dispatch to the value; none returns a PendingTensor)
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        args, kwargs = tree_map_only(PendingTensor, PendingTensor.value, (args, kwargs or {}))
        return func(*args, **kwargs)

    def value(self) -> torch.Tensor:
        """The output, once the call has completed (completing it now if not)."""
        return self._call.output(self._leaf)

    def tolist(self) -> Any:
        return self.value().tolist()

    def numpy(self, *, force: bool = False) -> Any:
        return self.value().numpy(force=force)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return repr(self.value())

    # (a copy, a pickle, torch.save: of the value, a plain tensor)
    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        return self.value().clone()

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.value().__reduce_ex__(protocol)
