"""Uneven gathers: leaves whose size along ``dim`` differs between replicas.

Calls without ``max_size`` first exchange every leaf's shape (and the tree's
Python scalars), in one small gather for the whole tree. An eager engine then
gathers every replica's exact bytes in one buffer and regroups them by leaf
(:func:`_exact`).

On XLA collectives need the same shapes on every replica, and every distinct
shape is a new compilation. So the leaves are padded to a shared size bucket
(the next power of two of the largest size, or ``max_size``) and gathered as an
even tree; the padding is cut off on the host. The pad and the cut happen on the
host because their widths differ between replicas: traced into the graph they
would give every replica a different program (and every size a new
compilation). With ``max_size`` the sizes travel with the data (on every
engine) and the call is a single execution (plus one for the caller's pending
work, if any, which runs first on its own).
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
        if transport.lazy:  # (padded and cut on the host, below)
            host = dict(zip(idx, transport.to_host([flat.leaves[i] for i in idx]), strict=True))
        else:
            host = {i: flat.leaves[i] for i in idx}
        local = [host[i].shape[dims[i]] for i in idx]

        scalars = [flat.leaves[i] for i in flat.scalars]
        if self.max_size is None:
            # (the scalars travel with the shapes: that gather carries the guard)
            exchange = {"shapes": transport.upload(_shapes(idx, host)), "scalars": scalars}
            got = _call.run(_STACKED, exchange, transport, to_cpu=True, signature=signature)
            sizes = _check_shapes(flat, idx, dims, got["shapes"])
            scalars = got["scalars"]
            if not transport.lazy:
                data = _exact(idx, dims, host, sizes, transport, to_cpu)
                return _output(flat, idx, data, scalars)
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
        }
        if self.max_size is not None:
            payload["sizes"] = transport.upload(torch.tensor(local, dtype=torch.int64))
            payload["scalars"] = scalars
        # (with max_size, the data carries the guard; else the shapes did)
        first = signature if self.max_size is not None else None
        got = _call.run(_STACKED, payload, transport, to_cpu=True, signature=first)
        if self.max_size is not None:
            sizes = got["sizes"]
            _check_max_size(flat, idx, dims, sizes, self.max_size)
            scalars = got["scalars"]
        counts = sizes.tolist()
        data = []
        for i, padded in zip(idx, got["data"], strict=True):  # (W, *padded shape)
            j = len(data)
            t = torch.cat([padded[r].narrow(dims[i], 0, n[j]) for r, n in enumerate(counts)], dims[i])
            data.append(t if to_cpu else transport.upload(t))
        return _output(flat, idx, data, scalars)


def _output(flat, idx, data, scalars):
    """The output tree from the gathered tensor leaves (in ``idx`` order) and
    the gathered Python scalars."""
    out = [None] * len(flat.leaves)
    for i, t in zip(idx, data, strict=True):
        out[i] = t
    for i, values in zip(flat.scalars, scalars, strict=True):
        out[i] = values
    return flat.unflatten(out)


def _exact(idx, dims, host, sizes, transport, to_cpu) -> list[torch.Tensor]:
    """An eager engine's uneven gather once every replica's ``sizes`` are
    known (``(W, leaves)``): each replica sends its leaves' exact bytes (its
    growing dim first), padded only at the end to the largest replica's total,
    and the result is regrouped leaf by leaf in rank order by one index per
    dtype, so that each output is a view. The offsets are computed with a few
    torch ops per dtype, not per leaf and replica. Eager engines only: on XLA
    the sizes would be in the program."""
    rows = [host[i].movedim(dims[i], 0) if dims[i] else host[i] for i in idx]
    groups: dict[torch.dtype, list[int]] = {}
    for j in sorted(range(len(rows)), key=lambda j: -rows[j].dtype.itemsize):
        groups.setdefault(rows[j].dtype, []).append(j)  # (aligned: element sizes descending)
    w, me = sizes.shape[0], transport.rank()
    per_row = torch.tensor([_pack.numel(tuple(r.shape[1:])) for r in rows], dtype=torch.int64)
    elements = sizes * per_row  # (W, leaves)
    segments = []  # per dtype: its leaves' elements and every replica's start byte
    at = torch.zeros(w, dtype=torch.int64)
    for dtype, js in groups.items():
        e = elements[:, js]
        segments.append((dtype, js, e, at))
        nbytes = e.sum(1) * dtype.itemsize
        at = at + nbytes + (-nbytes) % 8
    width = max(int(at.max()) if w else 0, 8)
    buf = torch.zeros(width, dtype=torch.uint8, device=transport.device)
    for dtype, js, e, start in segments:
        a, n = int(start[me]), int(e[me].sum()) * dtype.itemsize
        _pack.fill(buf[a : a + n].view(dtype), [rows[j] for j in js])
    every = transport.all_gather(buf)
    transport.wait()
    if to_cpu:
        every = transport.to_host([every])[0]
    ranks = torch.arange(w, dtype=torch.int64)
    totals = sizes.sum(0).tolist()
    data: list = [None] * len(rows)
    for dtype, js, e, start in segments:
        k = dtype.itemsize
        inner = e.cumsum(1) - e
        begin = ((ranks * width + start) // k)[:, None] + inner  # (W, leaves of the dtype)
        length = e.t().reshape(-1)  # leaf-major, rank-minor: each leaf's pieces in rank order
        first = begin.t().reshape(-1) - (length.cumsum(0) - length)
        index = torch.repeat_interleave(first, length)
        index += torch.arange(index.shape[0])
        flat = every.view(torch.uint8 if dtype == torch.bool else dtype)
        grouped = flat.index_select(0, index.to(every.device))
        if dtype == torch.bool:
            grouped = grouped != 0
        shapes = [(totals[j], *rows[j].shape[1:]) for j in js]
        for j, t in zip(js, _pack.split(grouped, shapes), strict=True):
            data[j] = t.movedim(0, dims[idx[j]]).contiguous() if dims[idx[j]] else t
    return data


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
