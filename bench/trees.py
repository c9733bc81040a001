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


#: Small calls, the ones users make most: op -> its tree's number of leaves.
SMALL = {"small gather": 1, "small reduce": 1, "metrics reduce": 3}


def small(op: str, rank: int, device: torch.device | str = "cpu") -> dict:
    """The tree of a small call: one leaf of 8 float32 (``"small gather"``,
    ``"small reduce"``), or an eval loop's metrics, three 0-d leaves
    (``"metrics reduce"``: loss, correct, count), different on every rank."""
    if op == "metrics reduce":
        return {
            "loss": torch.tensor(0.25 * rank + 1.5).to(device),
            "correct": torch.tensor(3 + rank).to(device),
            "count": torch.tensor(8).to(device),
        }
    return {"x": (torch.arange(8, dtype=torch.float32) + rank).to(device)}
