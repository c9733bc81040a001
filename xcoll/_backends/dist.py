"""torch.distributed backend (gloo, nccl, ...): eager collectives, started
asynchronously and waited for once per call.

Each collective is the process group's own method (``pg.allreduce``,
``pg._allgather_base``, ``pg.broadcast``, ``pg._reduce_scatter_base``,
``pg.alltoall_base``), as ``dist.all_reduce`` and its
peers call it after their checks: those checks hold for every xcoll buffer
(one dense, non-complex tensor, on a group of which this process is a
member), and their wrappers (logging, torch-function dispatch, checks) made
most of a small call's host work. So a ``TorchFunctionMode`` that intercepts
``dist`` calls does not see xcoll's, and inside ``dist._coalescing_manager``
xcoll's collectives run at once (they are not queued).

Gloo has no int16 collectives (and so none for the bits of float16/bfloat16):
moves send int16 buffers as their bytes, reductions widen them to int32, which
keeps sums and products exact modulo 2**16, as the dtype wraps.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d  # (the options of the group's calls)

from .base import EngineError, Transport

#: Each reduction's torch.distributed ReduceOp.
_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "prod": dist.ReduceOp.PRODUCT,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}
_WIDER = {torch.int16: torch.int32}
_CPU = torch.device("cpu")


def _options(cls: Any, **fields: Any) -> Any:
    """A collective's options, as ``dist``'s own calls make them (async: the
    call waits for its collectives once, in :meth:`DistTransport.wait`)."""
    options = cls()
    options.asyncOp = True
    for name, value in fields.items():
        setattr(options, name, value)
    return options


# (made once: the process group reads them and keeps nothing)
_REDUCE = {r: _options(_c10d.AllreduceOptions, reduceOp=o) for r, o in _REDUCE_OPS.items()}
_GATHER = _options(_c10d.AllgatherOptions)
_SCATTER = {r: _options(_c10d.ReduceScatterOptions, reduceOp=o) for r, o in _REDUCE_OPS.items()}
_ALL_TO_ALL = _options(_c10d.AllToAllOptions)


@functools.cache
def _broadcast_from(src: int) -> Any:
    """A broadcast's options from ``src`` (a rank of the group)."""
    return _options(_c10d.BroadcastOptions, rootRank=src, rootTensor=0)


def _not_a_member(group: Any) -> bool:
    # dist.new_group returns this int to the ranks it leaves out, on which
    # every use of it as a group would fail deep inside (no group_name).
    return isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER


@dataclass(frozen=True)
class _Group:
    """What a call reads of its process group, fixed for the group's life
    (read once per group: torch's getters walk its registry on every call)."""

    #: The group's name (one member per process, whatever the device), the
    #: same on every member. Not the group object: held in a module-level
    #: set, it outlived destroy_process_group, and its destructor at
    #: interpreter exit aborted gloo processes ("terminate called without an
    #: active exception": 5 runs in 12, 0 without it).
    key: tuple[str, str]
    world: int
    rank: int
    nccl: bool
    #: The job's store, where a replica whose process exits says so
    #: (:meth:`DistTransport.say_left`): kept, as destroy_process_group
    #: (which a clean exit calls first) forgets it.
    store: Any


# process group -> its _Group (weakly: a group destroyed is forgotten)
_groups: weakref.WeakKeyDictionary[Any, _Group] = weakref.WeakKeyDictionary()


def _group(pg: Any) -> _Group:
    """``pg``'s :class:`_Group`, read now and kept."""
    g = _groups[pg] = _Group(
        ("dist", pg.group_name),
        dist.get_world_size(pg),
        dist.get_rank(pg),
        dist.get_backend(pg) == "nccl",
        dist.distributed_c10d._get_default_store(),
    )
    return g


def _left_key(group_key: Hashable, rank: int) -> str:
    """Where rank ``rank`` of a group says it left, in the job's store."""
    return f"xcoll/left/{group_key[1]}/{rank}"  # type: ignore[index]


class DistTransport(Transport):
    def __init__(self, device: torch.device | None, group: Any, pg: Any):
        """A transport on process group ``pg``: ``group`` (None: the default
        group, ``pg``), whose tensor leaves are on ``device`` (None: none)."""
        if group is not None and _not_a_member(group):
            raise ValueError(
                f"group={group!r} is GroupMember.NON_GROUP_MEMBER, what dist.new_group returns "
                f"to the processes it leaves out: this process (global rank {dist.get_rank()}) "
                "is not a member of that group, and only its members may call on it"
            )
        self.group = group
        # (weakly: a transport kept in a traceback or an autograd graph must
        # not keep the default group alive past destroy_process_group, see
        # _Group; a group passed as ``group`` is the caller's, held anyway)
        self._pg = weakref.ref(pg)
        g = _groups.get(pg) or _group(pg)
        self.group_key, self.world, self._rank, self._store = g.key, g.world, g.rank, g.store
        if device is None:  # no tensor leaves: scalars go where this group's backend works
            device = torch.device("cuda", torch.cuda.current_device()) if g.nccl else _CPU
        self.device = device
        self._pending: list[Any] = []
        self._after: list[Callable[[], Any]] = []

    @property
    def group_object(self) -> Any:
        # (not kept: a transport that outlived destroy_process_group, in a
        # traceback or an autograd graph, would keep the group alive until the
        # interpreter exits, where its destructor aborts gloo processes)
        return self.group if self.group is not None else dist.group.WORLD

    def rank(self) -> int:
        return self._rank

    def rank_name(self, rank: int) -> str:
        if self.group is None:
            return f"rank {rank}"
        return f"rank {rank} of the group (global rank {dist.get_global_rank(self.group, rank)})"

    def say_left(self, text: str) -> None:
        self._store.set(_left_key(self.group_key, self._rank), text)

    def left(self) -> list[tuple[int, str]]:
        keys = {r: _left_key(self.group_key, r) for r in range(self.world) if r != self._rank}
        return [(r, self._store.get(k).decode()) for r, k in keys.items() if self._store.check([k])]

    def all_gather(self, buf: torch.Tensor) -> torch.Tensor:
        if buf.dtype in _WIDER:
            return self.all_gather(buf.view(torch.uint8)).view(buf.dtype)
        out = buf.new_empty(self.world * buf.shape[0])  # (buffers are 1-d)
        self._start(self._group()._allgather_base, out, buf, _GATHER)
        return out

    def all_reduce(self, buf: torch.Tensor, reduction: str) -> torch.Tensor:
        if buf.dtype in _WIDER:
            wide = buf.to(_WIDER[buf.dtype])
            self.all_reduce(wide, reduction)
            self._after.append(lambda: buf.copy_(wide))  # int32 -> int16 wraps like int16
            return buf
        self._start(self._group().allreduce, [buf], _REDUCE[reduction])
        return buf

    def reduce_scatter(self, buf: torch.Tensor, reduction: str) -> torch.Tensor:
        if buf.dtype in _WIDER:
            wide = self.reduce_scatter(buf.to(_WIDER[buf.dtype]), reduction)
            out = buf.new_empty(wide.shape)
            self._after.append(lambda: out.copy_(wide))  # (wraps as the narrow dtype does)
            return out
        out = buf.new_empty(buf.shape[0] // self.world)
        self._start(self._group()._reduce_scatter_base, out, buf, _SCATTER[reduction])
        return out

    def all_to_all(self, buf: torch.Tensor) -> torch.Tensor:
        # (never int16, which gloo refuses as it starts: an all-to-all's wire is
        # one joined int32 buffer)
        out = torch.empty_like(buf)
        self._start(self._group().alltoall_base, out, buf, [], [], _ALL_TO_ALL)
        return out

    # A star from src: at W=4 on 2 cores gloo's broadcast takes 0.3 ms, its
    # all-reduce 5 ms, so the guard header arrives from src (one-sided).
    broadcast_sums = False

    def broadcast(self, buf: torch.Tensor, src: int, guard: int = 0) -> torch.Tensor:
        if buf.dtype in _WIDER:
            return self.broadcast(buf.view(torch.uint8), src).view(buf.dtype)
        self._start(self._group().broadcast, [buf], _broadcast_from(src))
        return buf

    def _group(self) -> Any:
        pg = self._pg()
        if pg is None:
            raise EngineError("the process group was destroyed (dist.destroy_process_group)")
        return pg

    def _start(self, collective: Callable[..., Any], *args: Any) -> None:
        try:
            self._pending += [collective(*args)]
        except RuntimeError as e:  # the engine refused to start it (gloo checks its arguments)
            raise EngineError(str(e)) from e

    def wait(self) -> None:
        pending, self._pending = self._pending, []
        after, self._after = self._after, []
        try:
            for work in pending:
                work.wait()
        except RuntimeError as e:  # gloo's timeout, a peer that closed its connection
            raise EngineError(str(e)) from e
        for fix in after:
            fix()
