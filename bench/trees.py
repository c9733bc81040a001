"""The trees every method of the benchmark moves: ``n`` leaves of mixed dtypes and
shapes, nested eight to a group, different on every rank."""

from __future__ import annotations

import torch

DTYPES = (torch.float32, torch.int64, torch.float16)
SHAPES = ((16, 8), (64,), (4, 4, 4), (8, 2))


def make(n: int, rank: int, device: torch.device | str = "cpu", uneven: bool = False) -> dict:
    """``{"g000": {"leaf0": t, ...}, ...}``: leaf ``i`` has ``DTYPES[i % 3]`` and
    ``SHAPES[i % 4]``; with ``uneven`` its first dim is ``1 + (rank + i) % 8``
    instead, so ranks hold different numbers of rows."""
    g = torch.Generator().manual_seed(1000 + rank)
    tree: dict[str, dict[str, torch.Tensor]] = {}
    for i in range(n):
        shape = SHAPES[i % len(SHAPES)]
        if uneven:
            shape = (1 + (rank + i) % 8, *shape[1:])
        t = (100 * torch.randn(shape, generator=g)).to(DTYPES[i % len(DTYPES)])
        tree.setdefault(f"g{i // 8:03d}", {})[f"leaf{i % 8}"] = t.to(device)
    return tree


def nbytes(tree: dict) -> int:
    return sum(t.numel() * t.element_size() for group in tree.values() for t in group.values())
