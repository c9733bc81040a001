"""Uneven gathers: leaves whose size along ``dim`` differs between replicas.

Calls without ``max_size`` first exchange every leaf's shape (and the tree's
Python scalars), in one small gather for the whole tree. An eager engine then
gathers every replica's exact bytes in one buffer and regroups them by leaf
(:func:`.exact.exact`).

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

from dataclasses import dataclass

import torch

from ..._backends.base import Transport
from ..._base import tree as _tree
from ..._encode import pack as _pack
from ..._guard import check as _check
from ..._guard import verdict as _verdict
from .. import call as _call
from .. import ops as _ops
from .. import recipe as _recipe
from .exact import exact
from .padded import packed, unpack
from .rows import Rows, growing_dims

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
    name: str = "xcoll.gather"

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
        _verdict.synced(transport)
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
            exchange = {"shapes": _bytes(transport, rows.shapes(local)), "scalars": scalars}
            got = _call.run(_STACKED, exchange, transport, to_cpu=True, signature=signature)
            sizes = rows.sizes(flat, _int64_rows(got["shapes"]))
            scalars = got["scalars"]
            if not transport.lazy:
                data = exact(rows, host, sizes, transport, to_cpu)
                return _output(flat, idx, data, scalars), sizes
            target = _pack.size_bucket(int(sizes.max())) if idx else 0
            room = rows.layout(target).nbytes
            payload = {"data": packed(transport, rows, host, local, target, room)}
            got = _call.run(_STACKED, payload, transport, to_cpu=True)
            data = unpack(rows, got["data"], sizes, target)
        if not to_cpu:
            data = [transport.upload(t) for t in data]
        return _output(flat, idx, data, scalars), sizes

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
                "shapes": _bytes(transport, shapes),
                "scalars": scalars,
                "data": packed(transport, rows, host, local, size, room),
            }
            got = _call.run(_STACKED, payload, transport, to_cpu=True, signature=signature)
            # (the checks that are left with XCOLL_CHECK=never: under the guard
            # the replicas' descriptions agreed, and so do their needs)
            every = _int64_rows(got["shapes"])
            sizes = rows.sizes(flat, every[:, :-1])
            _check_needs(every[:, -1].tolist())
            _check_max_size(flat, rows, sizes, size)
            if need <= room:
                return unpack(rows, got["data"], sizes, size), got["scalars"], sizes
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


def _output(flat, idx, data, scalars):
    """The output tree from the gathered tensor leaves (in ``idx`` order) and
    the gathered Python scalars."""
    out = [None] * len(flat.leaves)
    for i, t in zip(idx, data, strict=True):
        out[i] = t
    for i, values in zip(flat.scalars, scalars, strict=True):
        out[i] = values
    return flat.unflatten(out)


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


def _bytes(transport: Transport, shapes: torch.Tensor) -> torch.Tensor:
    """A replica's shape row (int64) uploaded as its bytes: what no device
    keeps narrower (``XLA_USE_32BIT_LONG`` keeps int64 as int32)."""
    return transport.upload(_pack.leaf_bytes(shapes))


def _int64_rows(rows: torch.Tensor) -> torch.Tensor:
    """Every replica's shape row, from the gathered rows of their bytes."""
    # (a copy of standard strides: a gathered row may be a view whose strides
    # the wider dtype cannot view, a single row's among them)
    return rows.flatten().clone().view(torch.int64).reshape(rows.shape[0], rows.shape[1] // 8)


@dataclass(frozen=True)
class Narrowed(_ops.Transpose):
    """An uneven gather's backward rule: this replica's own rows of the
    summed gradient, found by the sizes that the forward exchanged (the
    replicas' shapes differ)."""

    #: Per travelling leaf, its growing dim and its column in the forward's sizes.
    dims: tuple[tuple[int, int], ...] = ()

    def take(self, reduced, shapes, transport, sizes):
        r = transport.rank()
        return [
            g.narrow(d, int(sizes[:r, k].sum()), int(sizes[r, k])).clone(
                memory_format=torch.contiguous_format
            )
            for g, (d, k) in zip(reduced, self.dims, strict=True)
        ]


def _uneven_transpose(
    op: UnevenGather, flat: _tree.Flat, leaves: tuple[int, ...]
) -> _ops.Transpose:
    """An all-reduce sum of the output gradients (the replicas' shapes
    differ: no engine cuts them into equal parts), run on its own, after
    the pending work, as the forward's collective is."""
    growing = growing_dims(flat, op.dim)
    columns = {i: k for k, i in enumerate(sorted(growing))}
    dims = tuple((growing[i], columns[i]) for i in leaves)
    return Narrowed(_ops.summed(op, flat, leaves), separate=True, dims=dims)


_ops.TRANSPOSES[UnevenGather] = _uneven_transpose
