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

#: Python scalar leaves travel as these dtypes and come back as Python values.
SCALAR_DTYPES: dict[type, torch.dtype] = {bool: torch.bool, int: torch.int64, float: torch.float64}

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
    """A flattened tree: ``leaves[i]`` is a tensor or a Python scalar."""

    tree: Any
    leaves: list[Any]
    treespec: optree.PyTreeSpec

    def path(self, i: int) -> str:
        """The Python expression that reaches leaf ``i``, e.g. ``tree['preds'][2]``."""
        return self.treespec.accessors()[i].codify("tree")

    def unflatten(self, leaves: list[Any]) -> Any:
        return optree.tree_unflatten(self.treespec, leaves)


def flatten(tree: Any) -> Flat:
    """Flattens ``tree`` and checks every leaf, before anything is communicated.

    Raises:
        TypeError: a leaf is not a tensor, bool, int or float, or has an
            unsupported dtype; the message names the leaf's path.
        ValueError: a Python int does not fit in int64.
    """
    leaves, treespec = optree.tree_flatten(tree, none_is_leaf=False)
    flat = Flat(tree, leaves, treespec)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            if leaf.dtype not in SUPPORTED_DTYPES:
                raise TypeError(
                    f"{flat.path(i)}: dtype {leaf.dtype} is not supported; xcoll moves "
                    f"{', '.join(sorted(str(d) for d in SUPPORTED_DTYPES))}"
                )
            if leaf.is_sparse or leaf.layout != torch.strided:
                raise TypeError(f"{flat.path(i)}: only strided (dense) tensors are supported")
        elif isinstance(leaf, (bool, float)):
            pass
        elif isinstance(leaf, int):
            if not _INT64_MIN <= leaf <= _INT64_MAX:
                raise ValueError(f"{flat.path(i)}: Python int {leaf} does not fit in int64")
        else:
            raise TypeError(
                f"{flat.path(i)}: unsupported leaf of type {type(leaf).__qualname__}; "
                "xcoll communicates tensors and Python bool/int/float (None is structure)"
            )
    return flat


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
