"""The outputs of a call in flight on an eager engine (torch.distributed):
a call made with ``sync=False`` starts its collectives and returns at once;
its outputs are :class:`PendingTensor`\\ s, and the call completes (its
collectives waited for, its guard read, its outputs decoded) at the first
of:

* :func:`xcoll.sync` (every call in flight of the process, or of the
  ``group=`` it is given), or the group's next call;
* the first use of one of its outputs (any operation on it, ``print``,
  ``.item()``, ``.tolist()``, ``.numpy()``, ``data_ptr()``, DLPack), as
  PyTorch's ``AsyncCollectiveTensor`` waits on first use.

Calls complete in their order on their group (:mod:`xcoll._guard.order`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from .._guard import order as _order


class PendingTensor(torch.Tensor):
    """An output of a ``sync=False`` call in flight on an eager engine: its
    shape, dtype and device are the output's; any operation on it first
    completes the call (:mod:`xcoll._core.pending`), then runs on the value.
    Operations return plain tensors."""

    _call: _order.Call
    _leaf: int
    __slots__ = ("_call", "_leaf")

    @staticmethod
    def __new__(cls, call: _order.Call, leaf: int, like: torch.Tensor, device: torch.device) -> PendingTensor:
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

    # (what reads the storage itself, which a wrapper has none of, bypassing
    # the dispatch: of the value; ``share_memory_`` and ``is_shared`` read
    # ``untyped_storage``, so they share and read the value's)
    def data_ptr(self) -> int:
        return self.value().data_ptr()

    # (newer torch's: const_data_ptr gave 0 there, as data_ptr did)
    def const_data_ptr(self) -> int:
        return self.value().const_data_ptr()  # type: ignore[attr-defined, no-any-return, unused-ignore]

    def untyped_storage(self) -> torch.UntypedStorage:
        return self.value().untyped_storage()

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        return self.value().__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> Any:
        return self.value().__dlpack_device__()

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
