"""Buckets and packed buffers: the leaves of one bucket travel as one flat buffer.

This module knows nothing about devices or backends. It uses only torch ops that
every device lowers (reshape, transpose, cat, slicing), so the same plan serves XLA,
torch.distributed and a single process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._base import tree as _tree


@dataclass(frozen=True)
class Slot:
    """Where leaf ``leaf`` lives in its bucket's flat buffer; ``dtype``: the
    leaf's own, where it differs from its bucket's (a reduce's merged
    bucket: the leaf travels widened and is cast back)."""

    leaf: int
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype | None = None

    @property
    def numel(self) -> int:
        return numel(self.shape)


#: Elements each Python int of a reduce's int64 sum or product travels as,
#: by reduction (:attr:`Bucket.exact`): its parts (:func:`int_parts`).
WIDTH = {"sum": 2, "prod": 3}


@dataclass
class Bucket:
    """Leaves that share one collective. Tensor leaves come first, then Python
    scalars as one block (they are uploaded together, as one 1-d tensor)."""

    key: Hashable
    dtype: torch.dtype
    tensors: list[Slot] = field(default_factory=list)
    scalars: list[Slot] = field(default_factory=list)
    size: int = 0
    #: The reduction, "sum" or "prod", where each Python scalar travels as a slot of shape
    #: ``(WIDTH[exact],)`` (a reduce's int64 sum or product: :func:`int_parts`);
    #: "" otherwise (one element each, of shape ``()``).
    exact: str = ""

    def _add(
        self, slots: list[Slot], leaf: int, shape: tuple[int, ...], dtype: torch.dtype | None = None
    ) -> None:
        slot = Slot(leaf, self.size, shape, None if dtype == self.dtype else dtype)
        slots.append(slot)
        self.size += slot.numel

    # Read on every call of a cached plan (buckets are not changed once planned).
    @functools.cached_property
    def sizes(self) -> list[int]:
        """Each tensor slot's number of elements, then the scalar block's (if any)."""
        return [s.numel for s in self.tensors] + ([self.block] if self.scalars else [])

    @functools.cached_property
    def block(self) -> int:
        """The number of elements of the Python scalars' block."""
        return sum(s.numel for s in self.scalars)

    @functools.cached_property
    def tensor_leaves(self) -> tuple[int, ...]:
        """The leaf of each tensor slot, in order."""
        return tuple(s.leaf for s in self.tensors)

    @functools.cached_property
    def casts(self) -> tuple[torch.dtype | None, ...]:
        """Each tensor slot's :attr:`Slot.dtype`, then None for the scalar
        block (if any): what each piece of the bucket is cast to."""
        return tuple(s.dtype for s in self.tensors) + ((None,) if self.scalars else ())

    @functools.cached_property
    def part_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The shapes of the bucket's :func:`parts`."""
        return tuple(s.shape for s in self.tensors) + (((self.block,),) if self.scalars else ())


def plan(
    leaves: Sequence[object],
    keys: Sequence[Hashable],
    dtypes: Sequence[torch.dtype],
    first: frozenset[int] = frozenset(),
    exact: Mapping[Hashable, str] | None = None,
) -> list[Bucket]:
    """Groups leaf ``i`` into the bucket ``keys[i]``, of dtype ``dtypes[i]``,
    in order of first appearance.

    Tensor leaves keep their shape and are laid out by dtype (the bucket's
    first: a bucket cast back in a few runs), then size, then shape, then
    position, so that leaves of equal shape sit together: a gathered bucket
    regroups in a few blocks (:func:`slot_major`) and splits in a few calls
    (:func:`split`). Python scalars get shape ``()`` and are laid out after the
    tensors of their bucket. Leaves in ``first`` come before the others of
    their kind (a reduce's means, so that they are one range to divide).
    The Python scalars of a bucket whose key is in ``exact`` travel as
    ``exact[key]`` says (:attr:`Bucket.exact`).

    >>> [[(s.leaf, s.offset) for s in b.tensors + b.scalars]
    ...  for b in plan([torch.zeros(3), 1.0, torch.zeros(2)], ["f", "f", "f"], [torch.float32] * 3)]
    [[(2, 0), (0, 2), (1, 5)]]
    """
    buckets: dict[Hashable, Bucket] = {}
    # (cast, not first, numel, shape, leaf, dtype): sorted by all but the dtype
    tensors: dict[Hashable, list[tuple[str, bool, int, tuple[int, ...], int, torch.dtype]]] = {}
    scalar_leaves: list[int] = []
    for i, leaf in enumerate(leaves):
        if keys[i] not in buckets:
            buckets[keys[i]] = Bucket(keys[i], dtypes[i])
            tensors[keys[i]] = []
        if isinstance(leaf, torch.Tensor):
            shape, own = tuple(leaf.shape), leaf.dtype
            cast = "" if own == buckets[keys[i]].dtype else str(own)
            tensors[keys[i]].append((cast, i not in first, numel(shape), shape, i, own))
        else:
            scalar_leaves.append(i)
    for key, bucket in buckets.items():
        for _, _, _, shape, i, own in sorted(tensors[key], key=lambda t: t[:5]):
            bucket._add(bucket.tensors, i, shape, own)
    for i in sorted(scalar_leaves, key=lambda i: i not in first):
        bucket = buckets[keys[i]]
        bucket.exact = (exact or {}).get(keys[i], "")
        bucket._add(bucket.scalars, i, (WIDTH[bucket.exact],) if bucket.exact else ())
    return list(buckets.values())


#: Bytes up to which a call's buffers travel in one size class of exactly
#: this size (an eager engine's first collective, padded; a lazy engine's
#: whole call, :mod:`xcoll._backends.hosted`): replicas whose calls differ in
#: size (a metrics dict without a key, a leaf in float64) then still meet in
#: one collective, whose guard header names the difference, where the engine
#: would abort (gloo: the replica that receives more than it expects; XLA: the
#: process, on programs that differ).
SMALL = 4096


def size_bucket(n: int) -> int:
    """The padded size for a largest size ``n``: 0 or the next power of two, so
    that sizes up to ``N`` compile at most ``ceil(log2(N)) + 2`` graphs on XLA.

    >>> [size_bucket(n) for n in (0, 1, 3, 4, 5)]
    [0, 1, 4, 4, 8]
    """
    return 0 if n == 0 else 1 << (n - 1).bit_length()


def runs(sizes: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of equal ``sizes``: ``(offset, count, size)`` each."""
    out: list[tuple[int, int, int]] = []
    offset = 0
    for n in sizes:
        if out and out[-1][2] == n:
            start, count, _ = out[-1]
            out[-1] = (start, count + 1, n)
        else:
            out.append((offset, 1, n))
        offset += n
    return out


def slot_major(buf: torch.Tensor, spans: Sequence[tuple[int, int, int]]) -> torch.Tensor:
    """``buf`` of shape ``(w, n)`` (one row per replica, slots side by side,
    in ``spans``: the :func:`runs` of their sizes) as a 1-d tensor in which
    each slot's ``(w, size)`` block is contiguous, in slot order: a gathered
    leaf is then one reshape away. One transpose per run of equal sizes."""
    w = buf.shape[0]
    if w == 1 or not spans[1:] and spans[0][1] == 1:  # one slot: a copy in row order
        return buf.reshape(-1)
    out = buf.new_empty(buf.numel())
    at = 0
    for a, k, n in spans:
        block = buf[:, a : a + k * n].reshape(w, k, n).transpose(0, 1)
        into = out[at : at + w * k * n].view(k, w, n)
        # Written in place, in copies of at most CAT_GRAIN elements: a larger
        # copy runs on several threads, which with W processes on 2 cores cost
        # 37 ms per call for 256 leaves (their bytes) against 1 ms
        step = max(1, CAT_GRAIN // (w * n)) if n else k
        for c in range(0, k, step):
            into[c : c + step].copy_(block[c : c + step])
        at += w * k * n
    return out


def split(flat: torch.Tensor, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """Consecutive pieces of the 1-d ``flat`` as views of ``shapes``.

    One torch call when every piece is 1-d or none is empty, a few per run of
    equal shapes otherwise, rather than one per piece: each call may hand the GIL to another
    replica thread (XLA:CPU runs one per device), and waiting to get it back
    costs far more than the call (measured: 37 us per ``view`` with 4 replica
    threads on 2 cores, against 1.3 us alone).
    """
    shapes = tuple(shapes)
    lengths = _lengths(shapes)
    if lengths is not None:  # (cheaper than the templates' unflatten: one split, no views)
        return list(flat.split_with_sizes(lengths))
    templates = _templates(shapes)
    if templates is not None:
        return list(torch._utils._unflatten_dense_tensors(flat, templates))
    groups, sizes = _groups(shapes)
    out: list[torch.Tensor] = []
    for (shape, k), chunk in zip(groups, flat.split(sizes), strict=True):
        if k == 1:
            out.append(chunk.view(shape))
        else:
            out.extend(chunk.view(k, *shape).unbind(0))
    return out


@functools.lru_cache(maxsize=1024)
def _lengths(shapes: tuple[tuple[int, ...], ...]) -> list[int] | None:
    """The lengths of ``shapes`` if every one is 1-d, else None."""
    return [s[0] for s in shapes] if all(len(s) == 1 for s in shapes) else None


@functools.lru_cache(maxsize=1024)
def _templates(shapes: tuple[tuple[int, ...], ...]) -> list[torch.Tensor] | None:
    """Storage-less tensors of ``shapes``, for ``_unflatten_dense_tensors`` (which
    gives an empty piece the wrong shape: None then)."""
    if any(numel(s) == 0 for s in shapes):
        return None
    return [torch.empty(s, device="meta") for s in shapes]


@functools.lru_cache(maxsize=1024)
def _groups(shapes: tuple[tuple[int, ...], ...]):
    """Runs of equal shapes, ``(shape, count)``, and each run's number of elements."""
    groups: list[tuple[tuple[int, ...], int]] = []
    for shape in shapes:
        if groups and groups[-1][0] == shape:
            groups[-1] = (shape, groups[-1][1] + 1)
        else:
            groups.append((shape, 1))
    return groups, [k * numel(shape) for shape, k in groups]


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


#: torch's GRAIN_SIZE: larger copies run on several threads.
CAT_GRAIN = 32768


@dataclass(frozen=True)
class Joined:
    """A move's buckets as the bytes of one buffer of 32-bit words, so that a
    gather or a broadcast is one collective whatever its dtypes: the guard's
    header (int32 words, when the call has one) first, then the buckets by
    descending element size. Each segment is padded with zero bytes to a
    multiple of 8, so that every segment starts aligned for any dtype and a
    device can cut it out as whole words, then reinterpret it."""

    #: Positions in the call's list of live buckets, in byte order.
    order: tuple[int, ...]
    #: Each segment's dtype (the header's int32 first, if any) and the shapes
    #: of its parts (:attr:`Bucket.part_shapes`).
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[tuple[int, ...], ...], ...]

    @staticmethod
    def of(
        dtypes: Sequence[torch.dtype],
        shapes: Sequence[Sequence[tuple[int, ...]]],
        guard: int,
        positions: Sequence[int] | None = None,
    ) -> Joined:
        """For buckets of ``dtypes`` and parts of ``shapes`` (at ``positions``
        in the list of live buckets, default ``0, 1, ...``), and a header of
        ``guard`` words."""
        by_size = sorted(range(len(dtypes)), key=lambda k: -dtypes[k].itemsize)
        at = list(range(len(dtypes))) if positions is None else list(positions)
        head = ((torch.int32,), (((guard,),),)) if guard else ((), ())
        return Joined(
            tuple(at[k] for k in by_size),
            head[0] + tuple(dtypes[k] for k in by_size),
            head[1] + tuple(tuple(tuple(s) for s in shapes[k]) for k in by_size),
        )

    # Hashed once: a compiled computation is looked up by its layout on every
    # call, and a call of 256 leaves would otherwise hash 256 shapes each time.
    def __hash__(self) -> int:
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:
        return hash((self.order, self.dtypes, self.shapes))

    @functools.cached_property
    def sizes(self) -> tuple[tuple[int, ...], ...]:
        """Each segment's slot sizes, in elements."""
        return tuple(tuple(numel(s) for s in seg) for seg in self.shapes)

    @functools.cached_property
    def empty(self) -> frozenset[tuple[int, int]]:
        """``(segment, part)`` of each part without elements (it has no bytes)."""
        return frozenset((k, j) for k, seg in enumerate(self.sizes) for j, n in enumerate(seg) if not n)

    @functools.cached_property
    def nbytes(self) -> tuple[int, ...]:
        """Each segment's number of bytes (one replica's), without its padding."""
        return tuple(sum(n) * d.itemsize for d, n in zip(self.dtypes, self.sizes, strict=True))

    @functools.cached_property
    def padded(self) -> tuple[int, ...]:
        """Each segment's number of bytes with its padding."""
        return tuple(n + -n % 8 for n in self.nbytes)

    @functools.cached_property
    def words(self) -> int:
        return sum(self.padded) // 4

    @functools.cached_property
    def segments(self) -> tuple[tuple[int, int, list[tuple[int, int, int]]], ...]:
        """Each segment's first byte, its number of bytes without its padding,
        and the :func:`runs` of its slots' numbers of bytes (for
        :func:`slot_major`)."""
        out, at = [], 0
        for d, ns, n, p in zip(self.dtypes, self.sizes, self.nbytes, self.padded, strict=True):
            out.append((at, n, runs([k * d.itemsize for k in ns])))
            at += p
        return tuple(out)


def fill(out: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
    """Copies ``parts``, flattened, one after another into the 1-d ``out``,
    serially: ``torch.cat`` of more than 32768 elements runs on several
    threads, which on 2 cores cost 184 us against 19 us for 256 leaves of 128
    float32. Consecutive parts are copied together up to that size; a larger
    part is copied alone (its copy is worth the threads)."""
    if not parts:
        return
    if out.numel() <= CAT_GRAIN:  # (flattened in one C++ call, not one Python call each)
        out.copy_(torch._C._nn.flatten_dense_tensors(list(parts)))  # (torch._utils' own call)
        return
    group: list[torch.Tensor] = []
    at = start = 0
    for p in parts:
        n = p.numel()
        if group and at - start + n > CAT_GRAIN:
            torch.cat(group, out=out[start:at])
            group, start = [], at
        if n > CAT_GRAIN:
            out[at : at + n].copy_(p.reshape(-1))
            start = at + n
        else:
            group.append(p.reshape(-1))
        at += n
    if group:
        torch.cat(group, out=out[start:at])


def cat_bytes(
    segments: Sequence[Sequence[torch.Tensor]], nbytes: Sequence[int], padded: Sequence[int]
) -> torch.Tensor:
    """The bytes of each segment's ``parts`` (of one dtype, ``nbytes`` bytes
    in all), flattened, each segment followed by zero bytes up to
    ``padded``, as one new 1-d uint8 tensor: a :class:`Joined` buffer, in one
    copy of each part (for buffers of at most ``CAT_GRAIN`` bytes: torch.cat
    runs on one thread there)."""
    pieces: list[torch.Tensor] = []
    for parts, n, p in zip(segments, nbytes, padded, strict=True):
        # (of one part, a view: the cat is the copy)
        flat = torch._C._nn.flatten_dense_tensors(list(parts))
        try:
            seg = flat.view(torch.uint8)
        except RuntimeError:
            # (a view with torch's negative bit, which the cat would resolve;
            # or one element of a stride that is not 1, which torch counts as
            # contiguous but will not view as bytes: an expanded 0-d tensor,
            # as the gradient of ``out.sum()`` is where ``out`` has one element)
            flat = flat.resolve_neg()
            if flat.stride(0) != 1:
                flat = flat.clone(memory_format=torch.contiguous_format)
            seg = flat.view(torch.uint8)
        pieces += [seg, seg.new_zeros(p - n)] if p > n else [seg]
    return torch.cat(pieces)


def concat(parts: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """``parts`` flattened and concatenated into one new 1-d tensor of
    ``dtype`` (default: the first part's; :func:`fill`)."""
    n = sum(map(torch.Tensor.numel, parts))
    if n <= CAT_GRAIN:
        # (one C++ call, which converts exactly: a merged bucket's narrower
        # parts promote to at most its dtype; of one part it is a view: copied)
        flat = torch._C._nn.flatten_dense_tensors(list(parts))
        return flat.to(dtype or flat.dtype, copy=not parts[1:])
    out = parts[0].new_empty(n, dtype=dtype)
    fill(out, parts)
    return out


def parts(
    bucket: Bucket, leaves: Sequence[object], upload: Callable[[torch.Tensor], torch.Tensor]
) -> list[torch.Tensor]:
    """The tensors whose concatenation is the bucket's packed buffer, one per
    entry of ``bucket.part_shapes``: its tensor leaves, then one 1-d tensor of
    its Python scalars (an exact bucket's as :func:`int_parts`), made on
    the host and moved by ``upload`` (once)."""
    out: list[torch.Tensor] = list(map(leaves.__getitem__, bucket.tensor_leaves))  # type: ignore[arg-type]
    if bucket.scalars:
        values: Sequence[Any] = [leaves[s.leaf] for s in bucket.scalars]
        if bucket.exact:
            values = [x for v in values for x in int_parts(v, bucket.exact)]
        out.append(upload(torch.tensor(values, dtype=bucket.dtype)))
    return out


_LOW = (1 << 32) - 1
_TOP = 1 << 63  # (2**63: one past int64's largest value)
_WRAP = 1 << 64


def int_parts(value: int, reduction: str) -> tuple[int, ...]:
    """A Python int (in int64) as the int64 elements whose all-reduce by ``reduction``
    gives the exact result back (:func:`int_value`).

    * sum: two limbs, ``value & (2**32 - 1)`` and ``value >> 32``: summed over
      fewer than 2**31 replicas, neither leaves int64, and ``hi * 2**32 +
      lo`` is the exact sum, as Python adds (it may exceed int64).
    * prod: the value, the smallest power of two at least its magnitude
      (``2**b``; 2**63 as int64's -2**63), and its sign. The product wraps
      modulo 2**64 as int64 does; the powers' product is ``2**sum(b)``, not 0,
      exactly when ``sum(b) <= 63``, where the product's magnitude is at most
      2**63, so that the sign and the wrapped product give it exactly.

    >>> int_parts(-1, "sum"), int_parts(-5, "prod"), int_parts(2**62 + 1, "prod")
    ((4294967295, -1), (-5, 8, -1), (4611686018427387905, -9223372036854775808, 1))
    """
    if reduction == "sum":
        return value & _LOW, value >> 32
    bound = 1 << (abs(value) - 1).bit_length() if value else 1
    return value, bound if bound < _TOP else -_TOP, (value > 0) - (value < 0)


def int_value(parts: Sequence[int], reduction: str) -> int | None:
    """The exact result of the all-reduce by ``reduction`` of :func:`int_parts`, from
    the reduced ``parts``; None for a product that may not fit in 64 bits
    (its factors' bounds multiply past 2**63: the wrapped product cannot tell).

    >>> int_value([2 * 4294967295, -2], "sum"), int_value([-(2**63), 0, 1], "prod")
    (-2, None)
    """
    if reduction == "sum":
        return (parts[1] << 32) + parts[0]
    product, bound, sign = parts
    if not sign:  # (a zero factor: the wrapped product is 0 too, and exact)
        return 0
    if not bound:
        return None
    return product % _WRAP if sign > 0 else -(-product % _WRAP)


def leaf_bytes(leaf: torch.Tensor | bool | int | float) -> torch.Tensor:
    """A tensor or Python scalar as its bytes, 1-d uint8 (a scalar as those
    of the dtype it travels as: :func:`xcoll._base.tree.scalar_dtype`).
    No device keeps uint8 narrower, so a value sent so arrives whole under
    the XLA settings that narrow a dtype (``XLA_USE_32BIT_LONG`` keeps int64
    as int32, ``XLA_USE_BF16`` floats as bfloat16; a TPU, float64 as float32)."""
    t = leaf if isinstance(leaf, torch.Tensor) else torch.tensor(leaf, dtype=_tree.scalar_dtype(leaf))
    return t.reshape(-1).view(torch.uint8)


def from_leaf_bytes(data: torch.Tensor, like: Any) -> Any:
    """:func:`leaf_bytes`' inverse: ``data`` (host bytes) as a leaf like ``like``."""
    # (its own storage: a view into a collective's buffer may start at an
    # offset that the wider dtype cannot view)
    data = data.clone()
    if isinstance(like, torch.Tensor):
        return data.view(like.dtype).reshape(like.shape)
    return _tree.to_python(data.view(_tree.scalar_dtype(like)).reshape(()), like)
