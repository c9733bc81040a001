"""The backend boundary: the few primitives a collectives engine must provide.

The pytree and packing code above this line never sees a device type. A backend
is chosen from the leaves themselves (as einops picks a backend from the tensor's
type) and its framework is imported only when such leaves are present:
``import xcoll`` works without torch_xla installed.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from .._tree import Flat


class Backend(ABC):
    """One replica's view of a collectives engine, for one call.

    Every collective takes a 1-d buffer that the backend may consume (it is a
    packed copy, never a caller's tensor) and returns a tensor on the buffer's
    device that holds the result once :meth:`wait` has returned. Lazy backends
    (XLA) trace it and run it at :meth:`sync`; eager ones start it asynchronously
    and finish every collective of the call in :meth:`wait`.
    """

    #: Device of the leaves; Python scalars are uploaded here.
    device: torch.device

    @abstractmethod
    def rank(self) -> int: ...

    @abstractmethod
    def world_size(self) -> int: ...

    def upload(self, cpu: torch.Tensor) -> torch.Tensor:
        return cpu.to(self.device)

    def concat(
        self, parts: Sequence[torch.Tensor], shapes: Sequence[tuple[int, ...]]
    ) -> torch.Tensor:
        """``parts`` (of ``shapes``) flattened and joined into one new 1-d tensor."""
        from .._pack import concat

        return concat(parts)

    def pack_moves(
        self, parts: Sequence[Sequence[torch.Tensor]], shapes: Sequence[Sequence[tuple[int, ...]]]
    ) -> list[torch.Tensor]:
        """For each bucket of a move (gather, broadcast): its ``parts`` (of
        ``shapes``, all of one dtype) flattened, joined and encoded for the wire
        (:func:`xcoll._wire.encode_move`), as one 1-d tensor. A backend may
        build all of them in one operation."""
        from .. import _wire

        return [_wire.encode_move(self.concat(p, s), self.bitcast) for p, s in zip(parts, shapes)]

    def unpack_moves(
        self,
        results: Sequence[torch.Tensor],
        dtypes: Sequence[torch.dtype],
        sizes: Sequence[Sequence[int]],
        world: int | None,
    ) -> list[torch.Tensor]:
        """Inverse of :meth:`pack_moves` on the collectives' results: each
        decoded to its bucket's dtype, 1-d. With ``world`` (a gather's
        ``(world * size,)`` results, slots of ``sizes``) each slot's
        ``(world, size)`` block is made contiguous (:func:`xcoll._pack.slot_major`)."""
        from .. import _pack, _wire

        out = []
        for r, dtype, n in zip(results, dtypes, sizes):
            r = _wire.decode_move(r, dtype, self.bitcast)
            out.append(_pack.slot_major(r.view(world, -1), n) if world else r)
        return out

    def split(
        self, flats: Sequence[torch.Tensor], shapes: Sequence[Sequence[tuple[int, ...]]]
    ) -> list[list[torch.Tensor]]:
        """Each 1-d tensor of ``flats`` cut into consecutive pieces of its ``shapes``."""
        from .._pack import split

        return [split(f, s) for f, s in zip(flats, shapes)]

    def bitcast(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Reinterprets the bits of ``t`` as ``dtype`` (same element size)."""
        return t.view(dtype)

    @abstractmethod
    def all_gather(self, buf: torch.Tensor) -> torch.Tensor:
        """``(n,)`` -> ``(W * n,)``: every replica's buffer, in rank order."""

    @abstractmethod
    def all_reduce(self, buf: torch.Tensor, op: str) -> torch.Tensor:
        """Elementwise ``op`` ("sum", "prod", "max", "min") over all replicas."""

    @abstractmethod
    def broadcast(self, buf: torch.Tensor, src: int) -> torch.Tensor:
        """Replica ``src``'s integer buffer, bit for bit, on every replica."""

    def validate(self, flat: Flat) -> None:
        """Refuses leaves this engine would change in transit (raises TypeError)."""

    def wait(self) -> None:
        """Waits for the collectives started so far (lazy backends: nothing to wait for)."""

    def sync(self) -> None:
        """Runs everything traced so far (no-op for eager backends)."""

    def to_host(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """CPU copies of ``tensors``, fetched together."""
        return [t.cpu() for t in tensors]

    def exchange(self, buf: torch.Tensor) -> torch.Tensor:
        """Every replica's 1-d ``buf`` as a ``(W, n)`` CPU tensor, run on its own:
        on lazy backends nothing else pending joins it (the caller's pending
        work may differ between replicas, as it does when their calls do)."""
        out = self.all_gather(buf)
        self.wait()
        self.sync()
        return self.to_host([out])[0].view(self.world_size(), -1)


class LocalBackend(Backend):
    """A single process with no collectives engine: world size 1."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def rank(self) -> int:
        return 0

    def world_size(self) -> int:
        return 1

    def all_gather(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.clone()

    def all_reduce(self, buf: torch.Tensor, op: str) -> torch.Tensor:
        return buf.clone()

    def broadcast(self, buf: torch.Tensor, src: int) -> torch.Tensor:
        return buf.clone()


def _xla_runtime_running() -> bool:
    # Only ask torch_xla if the user already imported it: never import it here.
    torch_xla = sys.modules.get("torch_xla")
    return torch_xla is not None and torch_xla._XLAC._xla_runtime_is_initialized()


def _dist_running(group: Any) -> bool:
    import torch.distributed as dist  # part of torch, imported with it

    return group is not None or (dist.is_available() and dist.is_initialized())


def current(group: Any = None) -> Backend:
    """The backend of this replica when the call has no tensor leaves to go by:
    ``group``'s if given, else XLA's if its runtime is running here, else the
    default process group's if initialised, else a world of one."""
    if group is None and _xla_runtime_running():
        from .xla import XlaBackend

        return XlaBackend(None)
    if _dist_running(group):
        from .dist import DistBackend

        return DistBackend(None, group)
    return LocalBackend()


def resolve(flat: Flat, group: Any = None) -> Backend:
    """The backend for the tensor leaves of ``flat`` (all on one device):

    XLA leaves -> XLA; other leaves -> torch.distributed if a process group is
    initialised (or ``group`` is given); otherwise a world of one.
    """
    if len(flat.devices) > 1:
        tensors = [i for i, leaf in enumerate(flat.leaves) if isinstance(leaf, torch.Tensor)]
        first = tensors[0]
        i = next(i for i in tensors if flat.leaves[i].device != flat.leaves[first].device)
        raise TypeError(
            f"leaves are on different devices: {flat.path(first)} on "
            f"{flat.leaves[first].device}, {flat.path(i)} on {flat.leaves[i].device}; "
            "one call communicates the leaves of one device"
        )
    first = next((i for i, s in enumerate(flat.signature) if isinstance(s, tuple)), None)
    if first is None:
        backend = current(group)
        backend.validate(flat)
        return backend
    device = flat.leaves[first].device
    if device.type == "xla":
        if group is not None:
            raise ValueError(
                "group= selects a torch.distributed process group; these leaves are on XLA"
            )
        from .xla import XlaBackend

        backend = XlaBackend(device)
        backend.validate(flat)
        return backend
    if _dist_running(group):
        from .dist import DistBackend

        return DistBackend(device, group)
    if _xla_runtime_running():
        # Treating them as a world of one would silently return W-times-smaller results.
        raise TypeError(
            f"{flat.path(first)} is on {device}, but this process runs XLA replicas; "
            "move the leaves to the replica's XLA device (torch_xla.device())"
        )
    return LocalBackend(device)
