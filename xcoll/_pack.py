"""Buckets and packed buffers: the leaves of one bucket travel as one flat buffer.

This module knows nothing about devices or backends. It uses only torch ops that
every device lowers (reshape, cat, slicing), so the same plan serves XLA,
torch.distributed and a single process.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Slot:
    """Where leaf ``leaf`` lives in its bucket's flat buffer."""

    leaf: int
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class Bucket:
    """Leaves that share one collective. Tensor leaves come first, then Python
    scalars as one block (they are uploaded together, as one 1-d tensor)."""

    key: Hashable
    dtype: torch.dtype
    tensors: list[Slot] = field(default_factory=list)
    scalars: list[Slot] = field(default_factory=list)
    size: int = 0

    def _add(self, slots: list[Slot], leaf: int, shape: tuple[int, ...]) -> None:
        slot = Slot(leaf, self.size, shape)
        slots.append(slot)
        self.size += slot.numel

    @property
    def slots(self) -> list[Slot]:
        return self.tensors + self.scalars


def plan(
    leaves: Sequence[object], keys: Sequence[Hashable], dtypes: Sequence[torch.dtype]
) -> list[Bucket]:
    """Groups leaf ``i`` into the bucket ``keys[i]``, in order of first appearance.

    Tensor leaves keep their shape; Python scalars get shape ``()`` and are laid out
    after the tensors of their bucket.
    """
    buckets: dict[Hashable, Bucket] = {}
    scalar_leaves: list[int] = []
    for i, leaf in enumerate(leaves):
        bucket = buckets.get(keys[i])
        if bucket is None:
            bucket = buckets[keys[i]] = Bucket(keys[i], dtypes[i])
        if isinstance(leaf, torch.Tensor):
            bucket._add(bucket.tensors, i, tuple(leaf.shape))
        else:
            scalar_leaves.append(i)
    for i in scalar_leaves:
        bucket = buckets[keys[i]]
        bucket._add(bucket.scalars, i, ())
    return list(buckets.values())


def concat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``parts`` flattened and concatenated into one new 1-d tensor."""
    return torch.cat([p.reshape(-1) for p in parts])


def pack(
    bucket: Bucket,
    leaves: Sequence[object],
    upload: Callable[[torch.Tensor], torch.Tensor],
    concat: Callable[[Sequence[torch.Tensor]], torch.Tensor] = concat,
) -> torch.Tensor:
    """The bucket's leaves as one 1-d buffer of ``bucket.size`` elements.

    ``upload`` moves the CPU tensor of Python scalars to the leaves' device; it is
    called at most once per bucket. ``concat`` flattens and joins the parts (a
    backend may do it in one operation).
    """
    parts = [leaves[s.leaf] for s in bucket.tensors]
    if bucket.scalars:
        values = [leaves[s.leaf] for s in bucket.scalars]
        parts.append(upload(torch.tensor(values, dtype=bucket.dtype)))
    return concat(parts)


def unpack(buf: torch.Tensor, slots: Sequence[Slot]) -> list[tuple[Slot, torch.Tensor]]:
    """Slices ``buf`` of shape ``(*lead, bucket.size)`` into each of ``slots``'
    ``(*lead, *slot.shape)`` tensor, a view wherever the layout allows."""
    lead = tuple(buf.shape[:-1])
    return [(s, buf[..., s.offset : s.offset + s.numel].reshape(lead + s.shape)) for s in slots]
