"""The padded uneven gathers (on XLA, and every engine with ``max_size``): each
replica's leaves padded to one size along their dims, as a buffer of bytes
(:func:`packed`), and every replica's rows cut out of the gathered buffers on
the host (:func:`unpack`)."""

from __future__ import annotations

import torch

from ..._encode import pack as _pack
from .rows import Rows


def _pad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``t`` cut or padded with zeros to ``size`` along ``dim`` (one torch call:
    a gather of hundreds of leaves makes one per leaf)."""
    if t.numel() == 0:  # (constant_pad_nd refuses a leaf with a dim of size 0)
        return t.new_zeros(t.shape[:dim] + (size,) + t.shape[dim + 1 :])
    return torch.constant_pad_nd(t, [0, 0] * (t.dim() - 1 - dim) + [0, size - t.shape[dim]], 0)


def packed(transport, rows: Rows, host, local, size: int, room: int) -> torch.Tensor:
    """This replica's leaves, each padded (or cut) to ``size`` along its dim,
    as ``room`` bytes on ``transport``'s device, dtype by dtype (as
    :meth:`Rows.layout`); all zeros if they need more room."""
    lay = rows.layout(size)
    device = host[0].device if host else torch.device("cpu")
    if lay.nbytes > room:
        return transport.upload(torch.zeros(room, dtype=torch.uint8, device=device))
    # (not zeroed first: only the bytes between dtypes and after the last are)
    buf = torch.empty(room, dtype=torch.uint8, device=device)
    end = 0
    for (dtype, js), at, n in zip(rows.groups, lay.starts, lay.elements, strict=True):
        buf[end:at].zero_()
        end = at + n * dtype.itemsize
        # (a shard larger than max_size is cut to it: it still takes part, so
        # that every replica sees its true size and raises, instead of the
        # others waiting in a gather it never joins)
        parts = [host[j] if local[j] == size else _pad(host[j], rows.dims[j], size) for j in js]
        _pack.fill(buf[at:end].view(dtype), parts)
    buf[end:].zero_()
    return transport.upload(buf)


def unpack(rows: Rows, every: torch.Tensor, sizes: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Each leaf's rows from every replica, in rank order, cut from ``every``
    (every replica's :func:`packed` bytes, ``(W, room)``, on the host) by
    ``sizes`` (``(W, leaves)``)."""
    lay = rows.layout(size)
    if every.storage_offset() % 8 or not every.is_contiguous():  # (for the dtype views)
        every = every.clone(memory_format=torch.contiguous_format)
    counts = sizes.tolist()
    data: list = [None] * len(rows.idx)
    for (dtype, js), at, n, numels in zip(
        rows.groups, lay.starts, lay.elements, lay.numels, strict=True
    ):
        if n:
            group = every[:, at : at + n * dtype.itemsize].view(dtype)
        else:  # (a view of no bytes may have any strides)
            group = torch.empty(every.shape[0], 0, dtype=dtype)
        for j, piece in zip(js, group.split(numels, 1), strict=True):
            padded, d = piece.reshape(piece.shape[0], *lay.shapes[j]), rows.dims[j]
            data[j] = torch.cat([padded[r].narrow(d, 0, c[j]) for r, c in enumerate(counts)], d)
    return data
