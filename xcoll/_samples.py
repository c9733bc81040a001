"""Samples in dataset order, each once: a pure function of gathered data.

A distributed sampler pads the dataset so that every replica gets the same number
of samples, so a gather of every replica's predictions holds some samples twice
and is in rank order, not dataset order. Gathering each sample's dataset index
with its data makes both fixable without any hidden state.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from ._base import tree as _tree


def by_index(tree: Any, index: torch.Tensor, *, dim: int = 0, length: int | None = None) -> Any:
    """Every sample of ``tree`` once, ordered by its dataset ``index``.

    A pure function of gathered data: gather each sample's dataset index with
    its data (``DistributedSampler`` repeats samples to even out the replicas,
    and a gather is in rank order), then put them back in dataset order. Where
    an index repeats, its first sample is kept.

    Args:
        tree: a pytree whose tensor leaves hold one sample per entry of
            ``index`` along ``dim``; Python scalar leaves are returned as they are.
        index: a 1-d integer tensor, each sample's index in the dataset.
        dim: the dimension of the tensor leaves along which the samples lie.
        length: the dataset's length, if known: the indices must then be
            exactly ``0 .. length - 1``.

    Returns:
        A tree of ``tree``'s structure whose tensor leaves hold each index's
        first sample, in increasing index order.

    Raises:
        TypeError: ``index`` is not a 1-d integer tensor; an unsupported leaf
            (as in :func:`xcoll.gather`).
        ValueError: ``length`` is not None or a non-negative int (a bool
            or a float included); with ``length``, the indices are not exactly
            ``0 .. length - 1`` (naming what is missing or outside); a tensor
            leaf without one sample per index along ``dim``, naming its path.

    >>> import torch
    >>> from xcoll import by_index
    >>> gathered = {"pred": torch.tensor([10, 30, 20, 10]), "index": torch.tensor([0, 2, 1, 0])}
    >>> by_index(gathered, gathered["index"], length=3)
    {'pred': tensor([10, 20, 30]), 'index': tensor([0, 1, 2])}
    """
    if not isinstance(index, torch.Tensor):
        raise TypeError(f"index must be a 1-d integer tensor, got {type(index).__qualname__}")
    if index.dim() != 1 or index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
        raise TypeError(
            f"index must be a 1-d integer tensor, got {index.dtype} of shape {tuple(index.shape)}"
        )
    length = _length(length)
    flat = _tree.flatten(tree)
    unique, inverse = torch.unique(index, return_inverse=True)
    positions = torch.arange(len(index), device=index.device)
    first = torch.full_like(unique, len(index)).scatter_reduce(0, inverse, positions, reduce="amin")
    if length is not None and not torch.equal(unique.cpu(), torch.arange(length)):
        present = set(unique.tolist())
        missing = [i for i in range(length) if i not in present][:10]
        extra = [i for i in present if not 0 <= i < length][:10]
        raise ValueError(
            f"index does not cover 0..{length - 1} exactly: missing {missing}, outside {extra}"
        )
    out = []
    for i, leaf in enumerate(flat.leaves):
        if not isinstance(leaf, torch.Tensor):
            out.append(leaf)
            continue
        d = dim % max(leaf.dim(), 1)
        if leaf.dim() == 0 or leaf.shape[d] != len(index):
            raise ValueError(
                f"{flat.path(i)}: has shape {tuple(leaf.shape)}, not {len(index)} samples along dim {dim}"
            )
        out.append(leaf.index_select(d, first.to(leaf.device)))
    return flat.unflatten(out)


def _length(length: Any) -> int | None:
    """``length`` as an int: what an index takes (an int, a NumPy int, an
    integer tensor of one element), but not a bool, which counts as 0 or 1
    (before, -1 and 2.0 failed inside torch.arange and True was 1)."""
    if length is None:
        return None
    n = -1
    if not isinstance(length, bool) and getattr(length, "dtype", None) != torch.bool:
        try:
            n = operator.index(length)
        except TypeError:
            pass
    if n < 0:
        raise ValueError(f"length must be None or a non-negative int, got {length!r:.80}")
    return n
