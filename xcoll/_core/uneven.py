"""Uneven gathers: leaves whose size along ``dim`` differs between replicas.

Calls without ``max_size`` first exchange every leaf's shape (and the tree's
Python scalars), in one small gather for the whole tree. An eager engine then
gathers every replica's exact bytes in one buffer and regroups them by leaf
(:func:`_exact`).

On XLA collectives need the same shapes on every replica, and every distinct
shape is a new compilation. So the leaves are padded to a shared size bucket
(the next power of two of the largest size) and gathered as one buffer of
bytes; the padding is cut off on the host. The pad and the cut happen on the
host because their widths differ between replicas: traced into the graph they
would give every replica a different program (and every size a new
compilation).

With ``max_size`` (every engine) the leaves are padded to it, and their bytes
travel with every replica's shapes and scalars in one guarded gather, a single
execution (plus one for the caller's pending work, if any, which runs first on
its own). That gather's size must not depend on the shapes it carries, or a
replica whose other dims differ would make a collective of another size, not
the guarded one: the data travels in a room of bytes that every replica takes
from the group's history, and a call that needs more runs again
(:meth:`UnevenGather._bounded`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from .._base import tree as _tree
from .._encode import pack as _pack
from .._guard import check as _check
from . import call as _call
from . import ops as _ops
from . import recipe as _recipe

_MAX_DIMS = 8


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


_STACKED = _ops.Gather(stack=True)


@dataclass(frozen=True)
class UnevenPlan(_recipe.Plan):
    rows: Rows | None = None


@dataclass(frozen=True)
class UnevenGather(_ops.Op):
    dim: int = 0
    max_size: int | None = None
    stack: bool = False
    grad: bool = False
    name = "xcoll.gather"
    alone_backward = True

    def head(self, sync, to_cpu):
        params = _ops.gather_params(self.dim, self.stack, True, self.max_size)
        return f"{params} {super().head(sync, to_cpu)}"

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
        return UnevenPlan([], [], _check.describe(flat, dims), rows=Rows.of(flat, dims))

    def apply(self, flat, transport, plan, sync, to_cpu, signature):
        rows: Rows = plan.rows
        idx = rows.idx
        # The caller's pending work runs first, on its own: here it typically has
        # shapes that differ between replicas, and in the graph of a collective that
        # would give every replica a different program. (Nothing pending: no execution.)
        transport.sync()
        if transport.lazy:  # (padded and cut on the host, below)
            host = transport.to_host([flat.leaves[i] for i in idx])
        else:
            host = [flat.leaves[i] for i in idx]
        local = [t.shape[d] for t, d in zip(host, rows.dims, strict=True)]
        scalars = [flat.leaves[i] for i in flat.scalars]
        if self.max_size is not None:
            data, scalars, sizes = self._bounded(
                flat, transport, rows, host, local, scalars, signature
            )
        else:
            # (the scalars travel with the shapes: that gather carries the guard)
            exchange = {"shapes": transport.upload(rows.shapes(local)), "scalars": scalars}
            got = _call.run(_STACKED, exchange, transport, to_cpu=True, signature=signature)
            sizes = rows.sizes(flat, got["shapes"])
            scalars = got["scalars"]
            if not transport.lazy:
                data = _exact(rows, host, sizes, transport, to_cpu)
                return _output(flat, idx, data, scalars), sizes
            target = _pack.size_bucket(int(sizes.max())) if idx else 0
            room = rows.layout(target).nbytes
            payload = {"data": _packed(transport, rows, host, local, target, room)}
            got = _call.run(_STACKED, payload, transport, to_cpu=True)
            data = _unpack(rows, got["data"], sizes, target)
        if not to_cpu:
            data = [transport.upload(t) for t in data]
        return _output(flat, idx, data, scalars), sizes

    def backward_dims(self, flat, leaves):
        """Per leaf, its growing dim and its column in the forward's sizes."""
        growing = growing_dims(flat, self.dim)
        columns = {i: k for k, i in enumerate(sorted(growing))}
        return tuple((growing[i], columns[i]) for i in leaves)

    def take(self, reduced, dims, shapes, transport, sizes):
        """This replica's own rows of the summed gradient, found by the sizes
        that the forward exchanged (the replicas' shapes differ)."""
        r = transport.rank()
        return [
            g.narrow(d, int(sizes[:r, k].sum()), int(sizes[r, k])).clone(
                memory_format=torch.contiguous_format
            )
            for g, (d, k) in zip(reduced, dims, strict=True)
        ]

    def _bounded(self, flat, transport, rows, host, local, scalars, signature):
        """The call with ``max_size``: every replica's shape rows, scalars and
        padded data in one guarded gather, whose size must not depend on the
        leaves' other dims (if it did, a replica whose other dims differ
        would make a collective of another size, which gloo aborts and which on
        XLA is another program, and the guard it carries would never be
        read). So the data travels in a room of bytes that every replica
        takes from the same history (:data:`_rooms`); a call that needs more
        runs again with room enough (all replicas alike: by then they have
        checked that their shapes agree), and its key keeps that room.
        Returns the gathered tensor leaves (on the host), the scalars and the
        sizes (:meth:`Rows.sizes`)."""
        size = self.max_size
        assert size is not None  # (apply calls this with max_size only)
        key = (
            transport.group_key,
            transport.world,
            _pack.size_bucket(size),
            len(rows.idx),
            len(scalars),
        )
        need = rows.layout(size).nbytes
        room = _rooms.get(key, 0)
        while True:  # (at most twice)
            shapes = torch.cat([rows.shapes(local), torch.tensor([need])])  # (one upload)
            payload = {
                "shapes": transport.upload(shapes),
                "scalars": scalars,
                "data": _packed(transport, rows, host, local, size, room),
            }
            got = _call.run(_STACKED, payload, transport, to_cpu=True, signature=signature)
            # (the checks that are left with XCOLL_CHECK=never: under the guard
            # the replicas' descriptions agreed, and so do their needs)
            sizes = rows.sizes(flat, got["shapes"][:, :-1])
            _check_needs(got["shapes"][:, -1].tolist())
            _check_max_size(flat, rows, sizes, size)
            if need <= room:
                return _unpack(rows, got["data"], sizes, size), got["scalars"], sizes
            room = _rooms[key] = need


#: Per (process group, its size, max_size's size bucket, number of tensor
#: leaves, of Python scalars): the bytes of data room that calls with
#: ``max_size`` send, the most that such a call has needed on that group.
#: Every replica updates it at the same calls, from what they all gathered, so
#: every replica's is the same. Nothing else is in the key, so that replicas
#: whose calls differ otherwise (a dict key, a dtype, other dims, max_size
#: within a bucket) still send the same room, and the guard names the
#: difference; calls that share a key send the largest room of them.
_rooms: dict[tuple, int] = {}


def _pad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``t`` cut or padded with zeros to ``size`` along ``dim`` (one torch call:
    a gather of hundreds of leaves makes one per leaf)."""
    if t.numel() == 0:  # (constant_pad_nd refuses a leaf with a dim of size 0)
        return t.new_zeros(t.shape[:dim] + (size,) + t.shape[dim + 1 :])
    return torch.constant_pad_nd(t, [0, 0] * (t.dim() - 1 - dim) + [0, size - t.shape[dim]], 0)


def _packed(transport, rows: Rows, host, local, size: int, room: int) -> torch.Tensor:
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


def _unpack(rows: Rows, every: torch.Tensor, sizes: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Each leaf's rows from every replica, in rank order, cut from ``every``
    (every replica's :func:`_packed` bytes, ``(W, room)``, on the host) by
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


@dataclass(frozen=True)
class Layout:
    """Where a replica's leaves lie in its bytes when each is padded to one
    size along its dim: dtype by dtype (:attr:`Rows.groups`), each dtype's
    bytes padded to 8 (so that each starts aligned)."""

    #: Each leaf's padded shape.
    shapes: list[tuple[int, ...]]
    #: Each dtype's first byte, its elements, and each of its leaves' elements.
    starts: list[int]
    elements: list[int]
    numels: list[list[int]]
    nbytes: int

    @staticmethod
    def of(rows: Rows, size: int) -> Layout:
        shapes = [r[:d] + (size,) + r[d:] for r, d in zip(rows.rest, rows.dims, strict=True)]
        numels = [[_pack.numel(shapes[j]) for j in js] for _, js in rows.groups]
        starts, elements, at = [], [], 0
        for (dtype, _), counts in zip(rows.groups, numels, strict=True):
            starts.append(at)
            elements.append(sum(counts))
            at += sum(counts) * dtype.itemsize
            at += -at % 8
        return Layout(shapes, starts, elements, numels, at)


def _output(flat, idx, data, scalars):
    """The output tree from the gathered tensor leaves (in ``idx`` order) and
    the gathered Python scalars."""
    out = [None] * len(flat.leaves)
    for i, t in zip(idx, data, strict=True):
        out[i] = t
    for i, values in zip(flat.scalars, scalars, strict=True):
        out[i] = values
    return flat.unflatten(out)


@dataclass(frozen=True)
class Rows:
    """What a plan knows of an uneven gather's tensor leaves (``idx``, in tree
    order): everything but their sizes along their growing ``dims``, which
    are exchanged on every call, and how an eager engine lays out their bytes.
    Built once per plan, so that a call makes a few torch calls per dtype,
    not per leaf."""

    idx: list[int]
    dims: list[int]
    #: Each leaf's ``[ndim, *shape, -1, ...]`` in ``1 + _MAX_DIMS`` slots (the
    #: same size on every replica even where shapes disagree), with 0 as its
    #: growing size; and that size's slot, one-hot.
    template: torch.Tensor
    grows: torch.Tensor
    #: Each leaf's elements per unit of its growing dim, and its other dims.
    per_row: torch.Tensor
    rest: list[tuple[int, ...]]
    #: The leaves' positions by dtype, element sizes descending (so that each
    #: dtype's bytes start aligned).
    groups: tuple[tuple[torch.dtype, tuple[int, ...]], ...]
    #: The positions of :attr:`groups` one after another, and for each: its
    #: element size, its group and its group's first place in that order; and
    #: each group's last place.
    order: torch.Tensor
    itemsize: torch.Tensor
    group: torch.Tensor
    first: torch.Tensor
    last: torch.Tensor
    _layouts: dict = field(default_factory=dict, compare=False, repr=False)

    def layout(self, size: int) -> Layout:
        """The :class:`Layout` of these leaves padded to ``size`` (built once
        per size: a call with ``max_size`` has one, one without a few buckets)."""
        if size not in self._layouts:
            if len(self._layouts) >= 64:  # (a max_size that changes on every call)
                self._layouts.clear()
            self._layouts[size] = Layout.of(self, size)
        return self._layouts[size]

    @staticmethod
    def of(flat: _tree.Flat, dims: dict[int, int]) -> Rows:
        idx = list(dims)
        leaves = [flat.leaves[i] for i in idx]
        template = [[t.dim(), *t.shape, *[-1] * (_MAX_DIMS - t.dim())] for t in leaves]
        grows = torch.zeros(len(idx), 1 + _MAX_DIMS, dtype=torch.int64)
        rest = []
        for j, (t, i) in enumerate(zip(leaves, idx, strict=True)):
            template[j][1 + dims[i]] = 0
            grows[j, 1 + dims[i]] = 1
            rest.append(tuple(t.shape[: dims[i]] + t.shape[dims[i] + 1 :]))
        by: dict[torch.dtype, list[int]] = {}
        for j in sorted(range(len(idx)), key=lambda j: -leaves[j].dtype.itemsize):
            by.setdefault(leaves[j].dtype, []).append(j)
        groups = tuple((d, tuple(js)) for d, js in by.items())
        order = [j for _, js in groups for j in js]
        group = [g for g, (_, js) in enumerate(groups) for _ in js]
        ends = list(itertools.accumulate(len(js) for _, js in groups))
        first = [ends[g] - len(groups[g][1]) for g in group]

        def ints(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64)

        return Rows(
            idx=idx,
            dims=[dims[i] for i in idx],
            template=ints(template).reshape(len(idx), 1 + _MAX_DIMS),
            grows=grows,
            per_row=ints([_pack.numel(r) for r in rest]),
            rest=rest,
            groups=groups,
            order=ints(order),
            itemsize=ints([leaves[j].dtype.itemsize for j in order]),
            group=ints(group),
            first=ints(first),
            last=ints([n - 1 for n in ends]),
        )

    def shapes(self, local: list[int]) -> torch.Tensor:
        """This replica's shape rows with its ``local`` sizes, 1-d, for the exchange."""
        return torch.addcmul(self.template, self.grows, torch.tensor(local, dtype=torch.int64)[:, None]).reshape(-1)

    def sizes(self, flat: _tree.Flat, every: torch.Tensor) -> torch.Tensor:
        """Every rank's size of each leaf along its dim, ``(W, leaves)``, from
        every rank's :meth:`shapes`. Raises, on every replica alike (they all
        see the same shapes), if anything else differs. (Under the guard that
        gather has compared the replicas' shapes already; this is what is left
        of the check with ``XCOLL_CHECK=never``.)"""
        every = every.reshape(every.shape[0], len(self.idx), 1 + _MAX_DIMS)
        if torch.ne(every * (1 - self.grows), self.template).any():
            _shape_error(flat, self, every)
        return (every * self.grows).sum(2)


def _exact(rows: Rows, host, sizes, transport, to_cpu) -> list[torch.Tensor]:
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


def _shape_error(flat: _tree.Flat, rows: Rows, every: torch.Tensor) -> None:
    """Raises for the first leaf whose other dims differ between ranks,
    naming the first rank whose shape differs from rank 0's."""
    others = every * (1 - rows.grows)
    # (some rank differs from rank 0: this replica's row is among them)
    j, r = (others != others[:1]).any(2).t().nonzero()[0].tolist()  # leaf-major
    i, d = rows.idx[j], rows.dims[j]
    raise ValueError(
        f"{flat.path(i)}: an uneven gather along dim {d} needs the same other "
        f"dims on every replica; rank 0 has shape {_shape(every[0, j])}, "
        f"rank {r} has {_shape(every[r, j])}"
    )


def _check_needs(needs: list[int]) -> None:
    """Raises, on every replica alike, if the replicas' leaves need different
    bytes although their shapes agree: each would read the others' bytes as
    its own, and only some would run again."""
    if len(set(needs)) > 1:
        r = next(r for r, n in enumerate(needs) if n != needs[0])
        raise ValueError(
            f"xcoll.gather: the replicas' leaves have the same shapes but need different "
            f"bytes at their max_size (rank 0: {needs[0]}, rank {r}: {needs[r]}): their "
            "dtypes or their max_size differ"
        )


def _check_max_size(flat, rows: Rows, sizes: torch.Tensor, max_size: int) -> None:
    """Raises, on every replica alike, if any rank's leaf exceeds ``max_size``."""
    over = (sizes > max_size).nonzero().tolist()
    if over:
        r, j = over[0]
        raise ValueError(
            f"{flat.path(rows.idx[j])}: rank {r} has size {int(sizes[r, j])} along dim "
            f"{rows.dims[j]}, more than max_size={max_size}"
        )


def _shape(row: torch.Tensor) -> tuple[int, ...]:
    return tuple(row[1 : 1 + int(row[0])].tolist())
