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

from typing import Any

import torch

from . import _backends, _collectives, _tree


def size_bucket(n: int) -> int:
    """The padded size for a largest size ``n``: 0 or the next power of two.
    Sizes up to ``N`` thus compile at most ``ceil(log2(N)) + 2`` data graphs."""
    return 0 if n == 0 else 1 << (n - 1).bit_length()


def _pad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    out = t.new_zeros(*t.shape[:dim], size, *t.shape[dim + 1 :])
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


def growing_dims(flat: _tree.Flat, dim: int) -> dict[int, int]:
    """Each tensor leaf's index -> the dim along which it may differ between
    replicas (``dim``, normalised). Raises ValueError naming a leaf that has no
    such dim (a 0-d leaf, or ``dim`` out of range)."""
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
        dims[i] = dim % nd
    return dims


def gather(tree: Any, *, dim: int, max_size: int | None, to_cpu: bool, group: Any) -> Any:
    flat = _tree.flatten(tree)
    backend = _backends.resolve(flat, group)
    dims = growing_dims(flat, dim)
    idx = list(dims)
    # The caller's pending work runs first, on its own: here it typically has
    # shapes that differ between replicas, and in the graph of a collective that
    # would give every replica a different program. (Nothing pending: no execution.)
    backend.sync()
    host = dict(zip(idx, backend.to_host([flat.leaves[i] for i in idx])))
    local = [host[i].shape[dims[i]] for i in idx]

    if max_size is None:
        every = _collectives.gather(
            backend.upload(_shapes(flat, idx, host)), stack=True, to_cpu=True, group=group
        )
        sizes = _check_shapes(flat, idx, dims, every)
        target = size_bucket(int(sizes.max())) if idx else 0
    else:
        for i, n in zip(idx, local):
            if n > max_size:
                raise ValueError(
                    f"{flat.path(i)}: size {n} along dim {dims[i]} exceeds max_size={max_size}"
                )
        target = max_size

    payload = {
        "data": [backend.upload(_pad(host[i], dims[i], target)) for i in idx],
        "scalars": [leaf for leaf in flat.leaves if not isinstance(leaf, torch.Tensor)],
    }
    if max_size is not None:
        payload["sizes"] = backend.upload(torch.tensor(local, dtype=torch.int64))
    got = _collectives.gather(payload, stack=True, to_cpu=True, group=group)
    if max_size is not None:
        sizes = got["sizes"]

    out, scalars = [], iter(got["scalars"])
    position = {i: j for j, i in enumerate(idx)}
    for i, leaf in enumerate(flat.leaves):
        if not isinstance(leaf, torch.Tensor):
            out.append(next(scalars))
            continue
        j = position[i]
        padded = got["data"][j]  # (W, *padded shape)
        pieces = [padded[r].narrow(dims[i], 0, int(sizes[r, j])) for r in range(padded.shape[0])]
        t = torch.cat(pieces, dims[i])
        out.append(t if to_cpu else backend.upload(t))
    return flat.unflatten(out)


_MAX_DIMS = 8


def _shapes(flat, idx, host) -> torch.Tensor:
    """Each leaf's ``[ndim, *shape]`` in a fixed number of slots, so that the
    exchange has the same size on every replica even where shapes disagree."""
    rows = torch.full((len(idx), 1 + _MAX_DIMS), -1, dtype=torch.int64)
    for j, i in enumerate(idx):
        nd = host[i].dim()
        if nd > _MAX_DIMS:
            raise ValueError(f"{flat.path(i)}: uneven gathers support up to {_MAX_DIMS} dims")
        rows[j, 0] = nd
        rows[j, 1 : 1 + nd] = torch.tensor(host[i].shape)
    return rows.reshape(-1)


def _check_shapes(flat, idx, dims, every: torch.Tensor) -> torch.Tensor:
    """Every rank's size of each leaf along its dim, ``(W, leaves)``. Raises, on
    every replica alike (they all see the same shapes), if anything else differs."""
    every = every.reshape(every.shape[0], len(idx), 1 + _MAX_DIMS)
    sizes = torch.zeros(every.shape[0], len(idx), dtype=torch.int64)
    for j, i in enumerate(idx):
        rows = every[:, j].clone()
        sizes[:, j] = rows[:, 1 + dims[i]]
        rows[:, 1 + dims[i]] = 0
        differs = (rows != rows[0]).any(1).nonzero().flatten().tolist()
        if differs:
            r = differs[0]
            raise ValueError(
                f"{flat.path(i)}: an uneven gather along dim {dims[i]} needs the same other "
                f"dims on every replica; rank 0 has shape {_shape(every[0, j])}, "
                f"rank {r} has {_shape(every[r, j])}"
            )
    return sizes


def _shape(row: torch.Tensor) -> tuple[int, ...]:
    return tuple(row[1 : 1 + int(row[0])].tolist())
