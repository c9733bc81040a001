"""torch.distributed backend (gloo, nccl, ...): eager collectives, started
asynchronously and waited for once per call.

Gloo has no int16 collectives (and so none for the bits of float16/bfloat16):
moves send int16 buffers as their bytes, reductions widen them to int32, which
keeps sums and products exact modulo 2**16, as the dtype wraps.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .base import EngineError, Transport

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "prod": dist.ReduceOp.PRODUCT,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}
_WIDER = {torch.int16: torch.int32}
_CPU = torch.device("cpu")


def _all_gather_single() -> Callable[..., Any]:
    """torch.distributed's all-gather into one tensor: ``all_gather_single``
    where torch has it (newer torch deprecates the old name with a
    FutureWarning), else ``all_gather_into_tensor`` (torch 2.9). Looked up at
    each call, as tests wrap it there."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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


# process group -> its _Group (weakly: a group destroyed is forgotten)
_groups: weakref.WeakKeyDictionary[Any, _Group] = weakref.WeakKeyDictionary()


def _group(pg: Any) -> _Group:
    """``pg``'s :class:`_Group`, read now and kept."""
    g = _groups[pg] = _Group(
        ("dist", pg.group_name),
        dist.get_world_size(pg),
        dist.get_rank(pg),
        dist.get_backend(pg) == "nccl",
    )
    return g


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
        g = _groups.get(pg) or _group(pg)
        self.group_key, self._world, self._rank = g.key, g.world, g.rank
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

    def world_size(self) -> int:
        return self._world

    def all_gather(self, buf: torch.Tensor) -> torch.Tensor:
        if buf.dtype in _WIDER:
            return self.all_gather(buf.view(torch.uint8)).view(buf.dtype)
        out = buf.new_empty(self.world_size() * buf.numel())
        try:
            work = _all_gather_single()(out, buf, group=self.group, async_op=True)
        except (RuntimeError, NotImplementedError):
            # A backend without it: the list form, writing into views of ``out``.
            self._start(dist.all_gather, list(out.chunk(self.world_size())), buf)
            return out
        self._pending.append(work)
        return out

    def all_reduce(self, buf: torch.Tensor, op: str) -> torch.Tensor:
        if buf.dtype in _WIDER:
            wide = buf.to(_WIDER[buf.dtype])
            self.all_reduce(wide, op)
            self._after.append(lambda: buf.copy_(wide))  # int32 -> int16 wraps like int16
            return buf
        self._start(dist.all_reduce, buf, _OPS[op])
        return buf

    # A star from src: at W=4 on 2 cores gloo's broadcast takes 0.3 ms, its
    # all-reduce 5 ms, so the guard header arrives from src (one-sided).
    broadcast_sums = False

    def broadcast(self, buf: torch.Tensor, src: int, guard: int = 0) -> torch.Tensor:
        if buf.dtype in _WIDER:
            return self.broadcast(buf.view(torch.uint8), src).view(buf.dtype)
        root = src if self.group is None else dist.get_global_rank(self.group, src)
        self._start(dist.broadcast, buf, root)
        return buf

    def _start(self, collective: Callable[..., Any], *args: Any) -> None:
        try:
            self._pending.append(collective(*args, group=self.group, async_op=True))
        except RuntimeError as e:  # a connection closed by an earlier timeout
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
