"""What a plan knows of an uneven gather's tensor leaves (:class:`Rows`):
everything but their sizes along their growing dims, which every call
exchanges; and where their bytes lie when each is padded to one size
(:class:`Layout`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from ..._base import tree as _tree
from ..._encode import pack as _pack

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


def _shape(row: torch.Tensor) -> tuple[int, ...]:
    return tuple(row[1 : 1 + int(row[0])].tolist())
