"""Pytree handling: flattening, leaf kinds, and the paths that errors name.

Leaves are flattened with optree's deterministic order (dict keys sorted), so
replicas that built the same dict in different insertion orders send their leaves
in the same order. ``None`` is structure, not a leaf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import optree
import torch

from . import _memo

#: Tensor dtypes every backend can move exactly. (Complex and the unsigned
#: 16/32/64-bit types are refused rather than half supported.)
SUPPORTED_DTYPES = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    }
)

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class Flat:
    """A flattened tree: ``leaves[i]`` is a tensor or a Python scalar.

    ``signature`` holds what a call's plan depends on, one entry per leaf: a
    tensor's ``(dtype, shape, device, layout)``, a Python scalar's type.
    ``devices`` are the distinct devices of the tensor leaves, in order of
    appearance; ``scalars`` the indices of the Python scalar leaves.
    """

    tree: Any
    leaves: list[Any]
    treespec: optree.PyTreeSpec
    signature: tuple
    devices: tuple[torch.device, ...]
    scalars: tuple[int, ...]

    @property
    def key(self) -> tuple:
        """Equal for trees of the same structure, leaf types, dtypes, shapes and
        devices. (It cannot be hashed if the treespec holds an unhashable
        object: then caches keyed by it build per call.)"""
        return (self.treespec, self.signature)

    def path(self, i: int) -> str:
        """The Python expression that reaches leaf ``i``, e.g. ``tree['preds'][2]``."""
        return self.treespec.accessors()[i].codify("tree")

    def unflatten(self, leaves: list[Any]) -> Any:
        return optree.tree_unflatten(self.treespec, leaves)


# (treespec, signature) of trees already checked -> (the indices of their Python
# int leaves, whose range is checked on every call; their tensor devices; the
# indices of their Python scalars).
_checked: _memo.Memo[tuple[list[int], tuple[torch.device, ...], tuple[int, ...]]] = _memo.Memo()


def flatten(tree: Any) -> Flat:
    """Flattens ``tree`` and checks every leaf, before anything is communicated.

    A tree whose structure and leaf signatures were checked before is only
    checked again for the values of its Python ints.

    Raises:
        TypeError: a leaf is not a tensor, bool, int or float, or has an
            unsupported dtype; the message names the leaf's path.
        ValueError: a Python int does not fit in int64.
    """
    leaves, treespec = optree.tree_flatten(tree, none_is_leaf=False)
    signature = tuple(
        [
            (leaf.dtype, leaf.shape, leaf.device, leaf.layout)
            if isinstance(leaf, torch.Tensor)
            else type(leaf)
            for leaf in leaves
        ]
    )

    def check() -> tuple[list[int], tuple[torch.device, ...], tuple[int, ...]]:
        _check(leaves, treespec)
        scalars = tuple(i for i, s in enumerate(signature) if not isinstance(s, tuple))
        ints = [i for i in scalars if issubclass(signature[i], int) and signature[i] is not bool]
        devices = tuple(dict.fromkeys(s[2] for s in signature if isinstance(s, tuple)))
        return ints, devices, scalars

    known = _checked.get((treespec, signature), check)
    flat = Flat(tree, leaves, treespec, signature, known[1], known[2])
    for i in known[0]:
        if not _INT64_MIN <= leaves[i] <= _INT64_MAX:
            raise ValueError(f"{flat.path(i)}: Python int {leaves[i]} does not fit in int64")
    return flat


def _check(leaves: list[Any], treespec: optree.PyTreeSpec) -> None:
    def path(i: int) -> str:
        return treespec.accessors()[i].codify("tree")

    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            if leaf.dtype not in SUPPORTED_DTYPES:
                raise TypeError(
                    f"{path(i)}: dtype {leaf.dtype} is not supported; xcoll moves "
                    f"{', '.join(sorted(str(d) for d in SUPPORTED_DTYPES))}"
                )
            if leaf.is_sparse or leaf.layout != torch.strided:
                raise TypeError(f"{path(i)}: only strided (dense) tensors are supported")
        elif not isinstance(leaf, (bool, int, float)):
            raise TypeError(
                f"{path(i)}: unsupported leaf of type {type(leaf).__qualname__}; "
                "xcoll communicates tensors and Python bool/int/float (None is structure)"
            )


def scalar_dtype(value: bool | int | float) -> torch.dtype:
    if isinstance(value, bool):
        return torch.bool
    if isinstance(value, int):
        return torch.int64
    return torch.float64


def to_python(value: torch.Tensor, like: bool | int | float) -> bool | int | float:
    """A 0-d CPU tensor back to the Python type of ``like``."""
    if isinstance(like, bool):
        return bool(value.item())
    if isinstance(like, int):
        return int(value.item())
    return float(value.item())


def broadcast_prefix(prefix: Any, flat: Flat, what: str) -> list[Any]:
    """Expands a prefix tree (e.g. of op names) to one entry per leaf of ``flat``."""
    if isinstance(prefix, str):
        return [prefix] * len(flat.leaves)
    try:
        full = optree.tree_broadcast_prefix(prefix, flat.tree, none_is_leaf=False)
    except ValueError as e:
        raise ValueError(f"{what} must be a str or a prefix tree of the data tree: {e}") from None
    entries = optree.tree_leaves(full, none_is_leaf=False)
    assert len(entries) == len(flat.leaves)
    return entries
