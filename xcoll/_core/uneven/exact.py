"""An eager engine's uneven gather (:func:`exact`): every replica's exact
bytes in one all-gather, regrouped leaf by leaf by one index."""

from __future__ import annotations

import torch

from ..._encode import pack as _pack
from .rows import Rows


def exact(rows: Rows, host, sizes, transport, to_cpu) -> list[torch.Tensor]:
    """An eager engine's uneven gather once every replica's ``sizes`` are
    known (``(W, leaves)``): each replica sends its leaves' exact bytes (their
    growing dim first), dtype by dtype with each dtype's bytes padded to 8,
    and its total padded at the end to the largest replica's. The result is
    regrouped leaf by leaf in rank order by one index for all leaves (one
    ``index_select`` per dtype), so that each output is a view. The offsets
    are computed by a few torch calls for all leaves at once: at 256 leaves
    each call costs more than its arithmetic. Eager engines only: on XLA the
    sizes would be in the program."""
    first_dims = [t.movedim(d, 0) if d else t for t, d in zip(host, rows.dims, strict=True)]
    w, me = sizes.shape[0], transport.rank()
    elements = (sizes * rows.per_row)[:, rows.order]  # (W, leaves): group by group
    nbytes = elements * rows.itemsize
    ahead = nbytes.cumsum(1)
    ahead -= nbytes  # (a replica's bytes before each leaf)
    ahead -= ahead[:, rows.first]  # (... of its group)
    total = ahead[:, rows.last] + nbytes[:, rows.last]  # (W, groups): each group's bytes
    padded = total + (-total) % 8
    start = padded.cumsum(1) - padded  # (each group's first byte in a replica's buffer)
    width = max(int(padded.sum(1).max()), 8)
    buf = torch.zeros(width, dtype=torch.uint8, device=transport.device)
    for (dtype, js), a, n in zip(rows.groups, start[me].tolist(), total[me].tolist(), strict=True):
        _pack.fill(buf[a : a + n].view(dtype), [first_dims[j] for j in js])
    every = transport.all_gather(buf)
    transport.wait()
    if to_cpu:
        every = transport.to_host([every])[0]
    # Where each leaf's piece from each replica starts in ``every``, in
    # elements of its dtype, and how many: leaf-major, then rank order
    at = torch.arange(w, dtype=torch.int64)[:, None] * width + start[:, rows.group] + ahead
    begin = (at // rows.itemsize).t().reshape(-1)
    length = elements.t().reshape(-1)
    into = length.cumsum(0) - length
    index = torch.repeat_interleave(begin - into, length)
    index += torch.arange(index.shape[0])
    index = index.to(every.device)
    totals = sizes.sum(0).tolist()
    data: list = [None] * len(first_dims)
    base = 0
    for dtype, js in rows.groups:
        shapes = [(totals[j], *rows.rest[j]) for j in js]
        n = sum(map(_pack.numel, shapes))
        grouped = every.view(dtype).index_select(0, index[base : base + n])
        base += n
        for j, t in zip(js, _pack.split(grouped, shapes), strict=True):
            data[j] = t
    for j, d in enumerate(rows.dims):
        if d:  # (a view would not be contiguous)
            data[j] = data[j].movedim(0, d).contiguous()
    return data
