"""Uneven gathers: leaves whose size along ``dim`` differs between replicas.

Collectives need the same shapes on every replica, and on XLA every distinct
shape is a new compilation. So the leaves are padded to a shared size bucket (the
next power of two of the largest size, or ``max_size``) and gathered as an even
tree; the padding is cut off on the host. The pad and the cut happen on the host
because their widths differ between replicas: traced into the graph they would
give every replica a different program (and every size a new compilation).

Calls without ``max_size`` first exchange every leaf's shape, in one small
gather for the whole tree; with ``max_size`` the sizes travel with the data and
the call is a single execution (plus one for the caller's pending work, if any,
which runs first on its own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _call, _check, _pack, _tree

_MAX_DIMS = 8


def _pad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``t`` cut or padded with zeros to ``size`` along ``dim`` (one torch call:
    a gather of hundreds of leaves makes one per leaf)."""
    return torch.constant_pad_nd(t, [0, 0] * (t.dim() - 1 - dim) + [0, size - t.shape[dim]], 0)


def growing_dims(flat: _tree.Flat, dim: int) -> dict[int, int]:
    """Each tensor leaf's index -> the dim along which it may differ between
    replicas (``dim``, normalised). Raises ValueError naming a leaf that has no
    such dim (a 0-d leaf, or ``dim`` out of range) or too many dims."""
    dims = {}
    for i, leaf in enumerate(flat.leaves):
        if not isinstance(leaf, torch.Tensor):
            continue
        nd = leaf.dim()
        if nd == 0 or not -nd <= dim < nd:
            raise ValueError(
                f"{flat.path(i)}: dim={dim} is out of range for a leaf of shape "
                f"{tuple(leaf.shape)} (uneven gathers need a dim to grow)"
            )
        if nd > _MAX_DIMS:
            raise ValueError(f"{flat.path(i)}: uneven gathers support up to {_MAX_DIMS} dims")
        dims[i] = dim % nd
    return dims


_STACKED = _call.Gather(stack=True)


@dataclass(frozen=True)
class UnevenGather(_call.Op):
    dim: int = 0
    max_size: int | None = None
    stack: bool = False
    name = "xcoll.gather"

    def head(self, sync, to_cpu):
        return (
            f"dim={self.dim} stack={self.stack} uneven=True max_size={self.max_size} "
            f"to_cpu={to_cpu} sync={sync}"
        )

    def validate(self, flat, transport, sync, to_cpu):
        if self.stack or not sync:
            raise ValueError(
                "uneven gathers concatenate and run now: stack=True and sync=False do not apply"
            )
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(f"dim must be an int, got {self.dim!r}")
        m = self.max_size
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
            raise ValueError(f"max_size must be a non-negative int, got {m!r}")

    def key(self, flat, world):
        return ("uneven", self.dim, flat.key)

    def plan(self, flat, world):
        dims = growing_dims(flat, self.dim)  # only that dim may differ between replicas
        return _call.Plan([], [], _check.describe(flat, dims), growing=dims)

    def apply(self, flat, transport, plan, sync, to_cpu, signature):
        dims = plan.growing
        idx = list(dims)
        # The caller's pending work runs first, on its own: here it typically has
        # shapes that differ between replicas, and in the graph of a collective that
        # would give every replica a different program. (Nothing pending: no execution.)
        transport.sync()
        host = dict(zip(idx, transport.to_host([flat.leaves[i] for i in idx]), strict=True))
        local = [host[i].shape[dims[i]] for i in idx]

        if self.max_size is None:
            shapes = transport.upload(_shapes(idx, host))
            every = _call.run(_STACKED, shapes, transport, to_cpu=True, signature=signature)
            sizes = _check_shapes(flat, idx, dims, every)
            target = _pack.size_bucket(int(sizes.max())) if idx else 0
        else:
            target = self.max_size

        # A shard larger than max_size still takes part (cut to max_size), so that
        # every replica sees its true size and raises, instead of the others
        # waiting in a gather it never joins.
        payload = {
            "data": [
                transport.upload(host[i] if n == target else _pad(host[i], dims[i], target))
                for i, n in zip(idx, local, strict=True)
            ],
            "scalars": [flat.leaves[i] for i in flat.scalars],
        }
        if self.max_size is not None:
            payload["sizes"] = transport.upload(torch.tensor(local, dtype=torch.int64))
        # (with max_size, the data carries the guard; else the shapes did)
        first = signature if self.max_size is not None else None
        got = _call.run(_STACKED, payload, transport, to_cpu=True, signature=first)
        if self.max_size is not None:
            sizes = got["sizes"]
            _check_max_size(flat, idx, dims, sizes, self.max_size)

        out, scalars = [], iter(got["scalars"])
        position = {i: j for j, i in enumerate(idx)}
        counts = sizes.tolist()
        for i, leaf in enumerate(flat.leaves):
            if not isinstance(leaf, torch.Tensor):
                out.append(next(scalars))
                continue
            j = position[i]
            padded = got["data"][j]  # (W, *padded shape)
            pieces = [padded[r].narrow(dims[i], 0, n[j]) for r, n in enumerate(counts)]
            t = torch.cat(pieces, dims[i])
            out.append(t if to_cpu else transport.upload(t))
        return flat.unflatten(out)


def _shapes(idx, host) -> torch.Tensor:
    """Each leaf's ``[ndim, *shape]`` in a fixed number of slots, so that the
    exchange has the same size on every replica even where shapes disagree."""
    rows = [[host[i].dim(), *host[i].shape, *[-1] * (_MAX_DIMS - host[i].dim())] for i in idx]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1)


def _check_shapes(flat, idx, dims, every: torch.Tensor) -> torch.Tensor:
    """Every rank's size of each leaf along its dim, ``(W, leaves)``. Raises, on
    every replica alike (they all see the same shapes), if anything else
    differs: for the first such leaf, naming the first rank whose shape
    differs from rank 0's."""
    every = every.reshape(every.shape[0], len(idx), 1 + _MAX_DIMS)
    leaves = torch.arange(len(idx))
    grows = torch.tensor([1 + dims[i] for i in idx], dtype=torch.int64)
    sizes = every[:, leaves, grows]
    others = every.clone()
    others[:, leaves, grows] = 0
    differs = (others != others[:1]).any(2).t().nonzero()  # (leaf, rank), leaf-major
    if len(differs):
        j, r = differs[0].tolist()
        i = idx[j]
        raise ValueError(
            f"{flat.path(i)}: an uneven gather along dim {dims[i]} needs the same other "
            f"dims on every replica; rank 0 has shape {_shape(every[0, j])}, "
            f"rank {r} has {_shape(every[r, j])}"
        )
    return sizes


def _check_max_size(flat, idx, dims, sizes: torch.Tensor, max_size: int) -> None:
    """Raises, on every replica alike, if any rank's leaf exceeds ``max_size``."""
    over = (sizes > max_size).nonzero().tolist()
    if over:
        r, j = over[0]
        i = idx[j]
        raise ValueError(
            f"{flat.path(i)}: rank {r} has size {int(sizes[r, j])} along dim {dims[i]}, "
            f"more than max_size={max_size}"
        )


def _shape(row: torch.Tensor) -> tuple[int, ...]:
    return tuple(row[1 : 1 + int(row[0])].tolist())
