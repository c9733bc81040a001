"""Cutting leaves into the replicas' parts, for the collectives that
address each replica its own part: every tensor leaf's ``dim`` is cut into
W equal parts, and part ``r`` goes to replica ``r``. A reduce-scatter
returns, on replica ``r``, the reduction of every replica's part ``r``
(:class:`~xcoll._core.ops.reduce_scatter.ReduceScatter`: a reduce whose buckets
are sent as W segments); an all-to-all returns every replica's part ``r``,
concatenated along ``dim`` in rank order
(:class:`~xcoll._core.ops.all_to_all.AllToAll`: a gather of the parts, sent
as W segments).

Each is planned as its base collective on the tree of one part's shapes
(:func:`parts`), so what arrives is what that collective's result would be,
and is cut and decoded by its rules: the wire is the base collective's, once
per replica, each segment made of the leaves' parts addressed to that
replica (the guard's header leads each segment, so every replica receives
it)::

    leaf (W * n along dim):   [ part 0 | part 1 | ... | part W-1 ]
    wire (W segments):        [ header, each leaf's part 0 | header, ... part 1 | ... ]
    replica r receives:       reduce-scatter: segment r, reduced over replicas
                              all-to-all: every replica's segment r, in rank order
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..._backends.base import Kernels
from ..._base import tree as _tree
from ..recipe import Recipe


def check_dim(dim: Any) -> None:
    """Refuses a ``dim`` that is not an int (checked on every call, where a
    plan is looked up: True would find dim=1's plan)."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {dim!r}")


def parts(flat: _tree.Flat, dim: int, world: int, name: str) -> _tree.Flat:
    """``flat`` with each tensor leaf replaced by a meta tensor of one of its
    ``world`` parts' shape (cut along ``dim``), for planning.

    Raises:
        TypeError: a Python scalar leaf (it has no dim to cut).
        ValueError: a 0-d leaf, ``dim`` out of range, or a leaf whose
            ``dim`` is not a multiple of ``world``; naming the leaf's path.
    """
    leaves = []
    for i, leaf in enumerate(flat.leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{flat.path(i)}: a Python scalar has no dim to cut into the replicas' parts; "
                f"{name} takes tensor leaves (reduce or gather scalars with xcoll.reduce, xcoll.gather)"
            )
        n = leaf.dim()
        if n == 0:
            raise ValueError(
                f"{flat.path(i)}: a 0-d tensor has no dim to cut into the {world} replicas' "
                f"parts; {name} takes tensors of at least one dim"
            )
        if not -n <= dim < n:
            raise ValueError(
                f"{flat.path(i)}: dim={dim} is out of range for a leaf of shape {tuple(leaf.shape)}"
            )
        shape = list(leaf.shape)
        d = dim % n
        if shape[d] % world:
            raise ValueError(
                f"{flat.path(i)}: dim {d} of shape {tuple(shape)} has {shape[d]} elements, "
                f"which the {world} replicas cannot share equally"
            )
        shape[d] //= world
        leaves.append(torch.empty(shape, dtype=leaf.dtype, device="meta"))
    return dataclasses.replace(flat, leaves=leaves)


def cut(r: Recipe, kernels: Kernels, parts: list[list[torch.Tensor]]) -> list[list[list[torch.Tensor]]]:
    """Per replica ``q``, each live bucket's tensors addressed to it: each
    leaf's ``q``-th part along its dim (one kernel call per leaf, bit for bit)."""
    cuts = [
        [kernels.parts(p, r.moved.get(leaf, 0), r.world) for p, leaf in zip(ps, b.tensor_leaves, strict=True)]
        for b, ps in zip(r.buckets, parts, strict=True)
    ]
    return [[[leaf[q] for leaf in bucket] for bucket in cuts] for q in range(r.world)]
