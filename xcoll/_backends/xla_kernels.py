"""The XLA kernels (:class:`XlaKernels`): buffers packed, encoded, cut and
decoded by small XLA computations, each a frozen dataclass that is its own
cache key and one node of the traced graph when applied.

Facts they rely on, measured on XLA:CPU (see docs/design.md): ``Tensor.view(dtype)``
is not lowered (it runs on the CPU, outside the graph), so bitcasts are built
as computations; XLA:CPU canonicalises bfloat16 NaN payloads when it copies
floats, so moves join and regroup floats as the integers of their bits; XLA:CPU
compiles a kernel per output and a concatenation in time that grows faster
than its parts (:class:`Split`, :data:`CHUNK`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch_xla.core.xla_builder as xb

from .._base import memo as _memo
from .._encode import pack as _pack
from .._encode import wire as _wire
from . import _xlac
from .base import Kernels
from .xla_step import step

_XLA_TYPES = {
    torch.float64: xb.Type.F64,
    torch.float32: xb.Type.F32,
    torch.float16: xb.Type.F16,
    torch.bfloat16: xb.Type.BF16,
    torch.int64: xb.Type.S64,
    torch.int32: xb.Type.S32,
    torch.int16: xb.Type.S16,
    torch.int8: xb.Type.S8,
    torch.uint8: xb.Type.U8,
}

# Built XLA computations (bitcasts by shape and dtypes, packs, unpacks and splits
# by the shapes of their parts), each built by one replica thread.
_computations: _memo.Memo[object] = _memo.Memo(locked=True)


def _join(ops, shapes):
    """``ops`` (of ``shapes``) flattened and concatenated, in an XLA computation."""
    return xb.Op.concat_in_dim(
        [q.reshape([_pack.numel(s)]) for q, s in zip(ops, shapes, strict=True)], 0
    )


def _encode(op, dtype: torch.dtype):
    """_wire.encode_move in an XLA computation."""
    if dtype == torch.bool:
        return op.cast(xb.Type.U8)
    if dtype in _wire.BITS:
        return op.bitcast(_XLA_TYPES[_wire.BITS[dtype]])
    return op


def _cast_back(op, dtype: torch.dtype):
    """_wire.cast_back in an XLA computation: a merged bucket's piece as its
    leaf's narrower ``dtype``, a NaN the quiet NaN."""
    if dtype == torch.bool:
        return op != op.zeros_like()
    op = op.cast(_XLA_TYPES[dtype])
    return _quiet(op) if dtype.is_floating_point else op


def _quiet(op):
    """Every NaN of a float ``op`` as the quiet NaN ``float("nan")``."""
    return (op != op).select(op.scalar_like(float("nan")), op)


def _decode(op, dtype: torch.dtype):
    """_wire.decode_move in an XLA computation."""
    if dtype == torch.bool:
        return op != op.zeros_like()
    if dtype in _wire.BITS:
        return op.bitcast(_XLA_TYPES[dtype])
    return op


def _slot_major(op, world: int, sizes):
    """_pack.slot_major in an XLA computation: ``op`` of shape ``(world, sum(sizes))``."""
    blocks = [
        op.slice_in_dim(a, a + k * m, 1)
        .reshape([world, k, m])
        .transpose([1, 0, 2])
        .reshape([world * k * m])
        for a, k, m in _pack.runs(sizes)
    ]
    return xb.Op.concat_in_dim(blocks, 0) if len(blocks) > 1 else blocks[0]


def _bytes(op):
    """A 1-d integer ``op`` as its bytes (little-endian, as a torch view)."""
    t = op.shape().dtype
    if t == xb.Type.U8:
        return op
    if t == xb.Type.S8:
        return op.bitcast(xb.Type.U8)
    n = op.shape().sizes[0]
    raw = op.bitcast(xb.Type.U8)  # (n, itemsize)
    return raw.reshape([n * raw.shape().sizes[-1]])


def _typed(raw, dtype: torch.dtype):
    """Inverse of :func:`_bytes` for each row of a 2-d ``raw`` of u8 and an
    integer ``dtype``."""
    if dtype == torch.uint8:
        return raw
    if dtype.itemsize == 1:
        return raw.bitcast(_XLA_TYPES[dtype])
    w, n = raw.shape().sizes
    return raw.reshape([w, n // dtype.itemsize, dtype.itemsize]).bitcast(_XLA_TYPES[dtype])


def _encode_reduce(op, dtype: torch.dtype, reduction: str):
    """_wire.encode_reduce in an XLA computation: its constants are part of the
    computation (a Python scalar in a torch op on an XLA tensor would be device
    data that torch_xla caches by value and shares with equal scalars elsewhere,
    so that replicas whose values coincide differently would trace different
    programs)."""
    if dtype == torch.bool:
        return op.cast(xb.Type.U8)
    if not dtype.is_floating_point:
        return op
    if reduction in ("max", "min"):
        bits = op.bitcast(_XLA_TYPES[_wire.BITS[dtype]])
        bits = (op != op).select(bits.scalar_like(_wire.WINNING_NAN[dtype, reduction]), bits)
        flipped = bits ^ bits.scalar_like(_wire.MAGNITUDE[_wire.BITS[dtype]])
        return (bits < bits.zeros_like()).select(flipped, bits)
    wide = _wire.ACCUMULATE.get(dtype, dtype)
    op = op.cast(_XLA_TYPES[wide]) if wide != dtype else op
    # -0.0 as +0.0, found by its bits: XLA may drop an "x + 0.0", and XLA:CPU
    # compares subnormals as zero (a float "x == 0" would flush them)
    carrier = _wire.BITS[wide]
    bits = op.bitcast(_XLA_TYPES[carrier])
    negative_zero = bits == bits.scalar_like(torch.iinfo(carrier).min)
    return negative_zero.select(op.zeros_like(), op)


def _decode_reduce(op, dtype: torch.dtype, reduction: str, means, divisor):
    """_wire.decode_reduce in an XLA computation. ``divisor`` (W, a parameter:
    XLA turns a division by a constant into a multiplication by its reciprocal,
    which is not correctly rounded when W is not a power of two)."""
    if dtype == torch.bool:
        return op != op.zeros_like()
    if not dtype.is_floating_point:
        return op
    if reduction in ("max", "min"):
        flipped = op ^ op.scalar_like(_wire.MAGNITUDE[_wire.BITS[dtype]])
        op = (op < op.zeros_like()).select(flipped, op).bitcast(_XLA_TYPES[dtype])
    else:
        if means:
            pieces, at, n = [], 0, op.shape().sizes[0]
            for start, stop in [*means, (n, n)]:
                if start > at:
                    pieces.append(op.slice_in_dim(at, start, 0))
                if stop > start:
                    part = op.slice_in_dim(start, stop, 0)
                    pieces.append(part / divisor.reshape([]).broadcast([stop - start]))
                at = stop
            op = xb.Op.concat_in_dim(pieces, 0) if len(pieces) > 1 else pieces[0]
        op = op.cast(_XLA_TYPES[dtype]) if _wire.ACCUMULATE.get(dtype, dtype) != dtype else op
    return _quiet(op)


@dataclass(frozen=True)
class _Computation:
    """An XLA computation xcoll applies to tensors, as the frozen data that
    builds it: its fields are everything its :meth:`body` reads, and with them
    the shapes and dtypes of the inputs it takes, so a computation is its own
    cache key. Applied, it is one node of the traced graph."""

    #: The computation's name in the graph (``xla::xcoll_...``).
    NAME: ClassVar[str]

    def body(self, *params: xb.Op) -> xb.Op:
        raise NotImplementedError

    def build(self, inputs: Sequence[torch.Tensor]):
        return xb.create_computation(self.NAME, self.body, [xb.tensor_shape(t) for t in inputs])

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        computation = _computations.get(self, self.build, inputs)
        return _xlac.user_computation(f"xla::{self.NAME}", inputs, computation)


@dataclass(frozen=True)
class Bitcast(_Computation):
    """A tensor of ``shape`` and ``dtype``, its bits seen as ``to``."""

    NAME = "xcoll_bitcast"
    shape: tuple[int, ...]
    dtype: torch.dtype
    to: torch.dtype

    def body(self, *params):
        return params[0].bitcast(_XLA_TYPES[self.to])


@dataclass(frozen=True)
class EncodeReduce(_Computation):
    """:meth:`Kernels.encode_reduce`: each bucket's parts (of dtypes ``own``,
    in order) packed and encoded, one output per bucket."""

    NAME = "xcoll_encode_reduce"
    dtypes: tuple[torch.dtype, ...]
    reductions: tuple[str, ...]
    own: tuple[torch.dtype, ...]
    shapes: tuple[tuple[tuple[int, ...], ...], ...]

    def body(self, *params):
        out, at = [], 0
        for dtype, reduction, bucket_shapes in zip(self.dtypes, self.reductions, self.shapes, strict=True):
            n = len(bucket_shapes)
            # (a narrower part, widened exactly: bool as 0/1)
            typed = [
                q if d == dtype else q.cast(_XLA_TYPES[dtype])
                for q, d in zip(params[at : at + n], self.own[at : at + n], strict=True)
            ]
            at += n
            # Bits become integers before the join: XLA:CPU may canonicalise
            # NaN payloads when it copies floats (bfloat16).
            wire = _join([_encode(q, dtype) for q in typed], bucket_shapes)
            out.append(_encode_reduce(_decode(wire, dtype), dtype, reduction))
        return xb.Op.tuple(out)


@dataclass(frozen=True)
class Join(_Computation):
    """:meth:`Kernels.join`: the parts with elements (empty parts have no
    bytes, so they are no parameters), in ``joined``'s order."""

    NAME = "xcoll_join"
    joined: _pack.Joined

    def body(self, *params):
        joined, raw, at = self.joined, [], 0
        counts = [sum(1 for n in sizes if n) for sizes in joined.sizes]
        for dtype, k, n, padded in zip(joined.dtypes, counts, joined.nbytes, joined.padded, strict=True):
            # joined in the wire dtype, then seen as bytes once per segment
            wire = [_encode(q, dtype) for q in params[at : at + k]]
            at += k
            segment = _bytes(_join(wire, [q.shape().sizes for q in wire]))
            if padded > n:
                zero = xb.Op.scalar(params[0].builder(), 0, dtype=xb.Type.U8)
                segment = xb.Op.concat_in_dim([segment, zero.broadcast([padded - n])], 0)
            raw.append(segment)
        raw = xb.Op.concat_in_dim(raw, 0) if len(raw) > 1 else raw[0]
        return xb.Op.tuple([raw.reshape([joined.words, 4]).bitcast(xb.Type.S32)])


#: A move's segment, or a reduce's bucket, of more than :data:`CHUNKED_FROM`
#: parts (leaves of one dtype) is packed from chunks of :data:`CHUNK` parts,
#: each (where its parts are data) in an execution of its own (:class:`Pack`)
#: before the call's: XLA:CPU compiles a computation of N parameters in time
#: that grows faster than N (a concatenation of 1,000 leaves 3.8 s, of 3,000
#: 14 s), and a chunk's program is compiled once for all the chunks of the
#: same shapes. Small chunks, because a concatenation's compile costs up to
#: 15 ms per part (float16 parts of mixed shapes: 128 parts 1 s, 512 parts
#: 7.6 s) and small chunks repeat more often: the first gather of 10,000
#: mixed leaves took 100 s in chunks of 512, 25 s in chunks of 128 and 8 s in
#: chunks of 64, a later one about the same in each (``bench.first_calls``).
CHUNKED_FROM = 1024
CHUNK = 64


@dataclass(frozen=True)
class Pack(_Computation):
    """A chunk of a bucket's parts (of dtypes ``own`` and ``shapes``), each
    converted to ``dtype`` (exactly: a merged bucket's narrower parts) and
    encoded in its wire dtype (:func:`_encode`), joined into one 1-d buffer."""

    NAME = "xcoll_pack"
    dtype: torch.dtype
    own: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]

    def body(self, *params):
        to = _XLA_TYPES[self.dtype]
        typed = [q if d == self.dtype else q.cast(to) for q, d in zip(params, self.own, strict=True)]
        return xb.Op.tuple([_join([_encode(q, self.dtype) for q in typed], self.shapes)])


def _chunked(parts, shapes, dtype: torch.dtype):
    """A bucket's ``parts`` (of ``shapes``), their shapes and their dtypes,
    with each chunk of :data:`CHUNK` parts that are all data replaced by the
    chunk's packed buffer (run now, a program of its own: no collective in
    it), which :class:`Join` and :class:`EncodeReduce` take as a part of
    ``dtype`` (its wire form encodes as itself). A chunk with a pending part
    stays parts: its graph (the caller's work) would run again in the
    chunk's program, and with it the caller's step in a call with
    ``sync=False``. Parts without elements are left out (no bytes)."""
    live = [(t, s) for t, s in zip(parts, shapes, strict=True) if _pack.numel(s)]
    out: list[torch.Tensor] = []
    out_shapes: list[tuple[int, ...]] = []
    own: list[torch.dtype] = []
    for a in range(0, len(live), CHUNK):
        tensors = [t for t, _ in live[a : a + CHUNK]]
        chunk_shapes = tuple(s for _, s in live[a : a + CHUNK])
        if _xlac.data_handles(tensors) is None:
            out += tensors
            out_shapes += chunk_shapes
            own += [t.dtype for t in tensors]
            continue
        buf = Pack(dtype, tuple(t.dtype for t in tensors), chunk_shapes)(tensors)[0]
        step(buf.device, [buf])
        out.append(buf)
        out_shapes.append((int(buf.shape[0]),))
        own.append(dtype)
    return out, tuple(out_shapes), own


@dataclass(frozen=True)
class Unjoin(_Computation):
    """:meth:`Kernels.unjoin` of a result of ``world`` rows (1: a broadcast's)."""

    NAME = "xcoll_unjoin"
    joined: _pack.Joined
    world: int
    wire: bool

    def body(self, *params):
        joined, w = self.joined, self.world
        rows = params[0].reshape([w, joined.words])
        out, col = [], 0
        for dtype, sizes, n, padded in zip(
            joined.dtypes, joined.sizes, joined.nbytes, joined.padded, strict=True
        ):
            # cut out as whole words, reinterpreted, regrouped in its dtype
            words = rows.slice_in_dim(col, col + padded // 4, 1)
            col += padded // 4
            raw = words.bitcast(xb.Type.U8).reshape([w, padded]).slice_in_dim(0, n, 1)
            typed = _typed(raw, _wire.wire_dtype(dtype))  # (w, elements)
            seg = _slot_major(typed, w, sizes) if w > 1 else typed.reshape([typed.shape().sizes[1]])
            out.append(seg if self.wire else _decode(seg, dtype))
        return xb.Op.tuple(out)


@dataclass(frozen=True)
class DecodeReduce(_Computation):
    """:meth:`Kernels.decode_reduce` of all-reduced buffers of ``lengths``
    in their wire dtypes ``wires``; then W as a (1,) parameter per dtype in
    :attr:`divided` (XLA turns a division by a constant into a multiplication
    by its reciprocal, which is not correctly rounded when W is not a power
    of two)."""

    NAME = "xcoll_decode_reduce"
    dtypes: tuple[torch.dtype, ...]
    reductions: tuple[str, ...]
    means: tuple[tuple[tuple[int, int], ...], ...]
    lengths: tuple[int, ...]
    wires: tuple[torch.dtype, ...]

    @property
    def divided(self) -> list[torch.dtype]:
        """The wire dtypes that a mean is divided in, one divisor each."""
        return sorted({o for o, m in zip(self.wires, self.means, strict=True) if m}, key=str)

    def body(self, *params):
        n = len(self.wires)
        by_dtype = dict(zip(self.divided, params[n:], strict=True))
        return xb.Op.tuple(
            [
                _decode_reduce(p, d, reduction, m, by_dtype.get(o))
                for p, o, d, reduction, m in zip(
                    params[:n], self.wires, self.dtypes, self.reductions, self.means, strict=True
                )
            ]
        )


@dataclass(frozen=True)
class Split(_Computation):
    """:meth:`Kernels.split` of 1-d buffers of ``dtypes``: each cut into
    pieces of ``shapes``, each cast back to its leaf's dtype (``casts``,
    None where it is the bucket's). After the buffers, it takes each piece's
    offset as a parameter (:meth:`offsets`; none for a piece without
    elements): XLA:CPU compiles a kernel per output, and a kernel that cuts
    at a constant is one of its own, while one that cuts at a parameter is
    the same for every piece of a shape and dtype, and compiled once (1,024
    pieces of one shape: 30 s to compile with constants, 0.7 s with
    parameters; ``python -m bench.outputs``)."""

    NAME = "xcoll_split"
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[tuple[int, ...], ...], ...]
    casts: tuple[tuple[torch.dtype | None, ...], ...]

    def offsets(self, device: torch.device) -> list[torch.Tensor]:
        """Each piece's offset in its buffer, as a (1,) index uploaded to
        ``device`` (an upload of more than 0 dims is never shared with
        another value: one parameter each)."""
        starts = [
            a
            for bucket in self.shapes
            for a, s in zip(itertools.accumulate(map(_pack.numel, bucket), initial=0), bucket, strict=False)
            if _pack.numel(s)
        ]
        index = [torch.tensor([a], dtype=torch.int32 if a < 2**31 else torch.int64) for a in starts]
        return _xlac.upload(index, device) if index else []

    def apply(self, flats: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The pieces of ``flats``: the computation and the offsets it takes
        on the flats' device, found by one lookup (built on first use)."""
        device = str(flats[0].device)
        computation, offsets = _splits.get((self, device), self.built, flats)
        return _xlac.user_computation(f"xla::{self.NAME}", [*flats, *offsets], computation)

    def built(self, flats: Sequence[torch.Tensor]) -> tuple[object, list[torch.Tensor]]:
        offsets = self.offsets(flats[0].device)
        inputs = [*flats, *offsets]
        return _computations.get(self, self.build, inputs), offsets

    def body(self, *params):
        offsets = iter(params[len(self.dtypes) :])
        pieces = []
        for p, bucket_shapes, bucket_casts in zip(params, self.shapes, self.casts, strict=False):
            for shape, dtype in zip(bucket_shapes, bucket_casts, strict=True):
                n = _pack.numel(shape)
                piece = p.dynamic_slice([next(offsets).reshape([])], [n]) if n else p.slice_in_dim(0, 0, 0)
                piece = piece.reshape(list(shape))
                pieces.append(piece if dtype is None else _cast_back(piece, dtype))
        return xb.Op.tuple(pieces)


@dataclass(frozen=True)
class Parts(_Computation):
    """:meth:`Kernels.parts` of a tensor of ``shape`` and ``dtype``: its
    ``world`` parts along ``dim``, cut in its integer wire form (a float
    cut as itself may be converted to float32 and back by XLA:CPU, which
    quiets a bfloat16 NaN's payload: seen in an all-to-all's wire)."""

    NAME = "xcoll_parts"
    shape: tuple[int, ...]
    dtype: torch.dtype
    dim: int
    world: int

    def body(self, *params):
        t = params[0]
        wire = _wire.BITS.get(self.dtype)
        if wire is not None:
            t = t.bitcast(_XLA_TYPES[wire])
        n = self.shape[self.dim] // self.world
        parts = [t.slice_in_dim(q * n, (q + 1) * n, self.dim) for q in range(self.world)]
        if wire is not None:
            parts = [p.bitcast(_XLA_TYPES[self.dtype]) for p in parts]
        return xb.Op.tuple(parts)


@dataclass(frozen=True)
class Keep(_Computation):
    """A broadcast's wire on one replica: kept where the (1,) mask (the first
    parameter) is true, zeros elsewhere; its first ``guard`` elements (the
    header, which every replica adds to) kept on every replica."""

    NAME = "xcoll_keep"
    dtype: torch.dtype
    length: int
    guard: int

    def body(self, *params):
        (mask, wire), n, guard = params, self.length, self.guard
        kept = mask.reshape([]).broadcast([n - guard])
        rest = wire.slice_in_dim(guard, n, 0)
        rest = kept.select(rest, rest.zeros_like())
        if not guard:
            return rest
        return xb.Op.concat_in_dim([wire.slice_in_dim(0, guard, 0), rest], 0)


# (Split, device) -> its computation, and its pieces' offsets on the device
# (uploaded once).
_splits: _memo.Memo[tuple[object, list[torch.Tensor]]] = _memo.Memo(locked=True)

# (device, dtype, W) -> W as a (1,) device tensor (uploaded once; a 1-d upload
# is never shared with another value).
_divisors: _memo.Memo[torch.Tensor] = _memo.Memo(locked=True)


def _divisor(device: torch.device, dtype: torch.dtype, world: int) -> torch.Tensor:
    key = (str(device), dtype, world)
    return _divisors.get(key, lambda: torch.tensor([world], dtype=dtype).to(device))


class XlaKernels(Kernels):
    """:class:`Kernels` as XLA computations: each call is one node of the traced
    graph, cached by what builds it (every torch call a replica thread makes can
    hand the GIL to another replica; at W=4 on 2 cores the calls, not the work,
    were most of a call's time). They lower the same operations as the torch
    kernels, bit for bit (tested)."""

    def bitcast(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return Bitcast(tuple(t.shape), t.dtype, dtype)([t])[0]

    def parts(self, t, dim, world):
        return Parts(tuple(t.shape), t.dtype, dim, world)([t])

    def encode_reduce(self, parts, shapes, dtypes, reductions):
        # packed and encoded in one computation: one graph node per call
        # (a bucket of many parts: of their chunks, :func:`_chunked`; a
        # chunk's buffer is a part of its bucket's dtype)
        flat = [t for p in parts for t in p]
        own = tuple(t.dtype for t in flat)
        if any(len(p) > CHUNKED_FROM for p in parts):
            chunked = [
                _chunked(p, s, d) if len(p) > CHUNKED_FROM else (p, s, [t.dtype for t in p])
                for p, s, d in zip(parts, shapes, dtypes, strict=True)
            ]
            parts, shapes, owns = (list(x) for x in zip(*chunked, strict=True))
            flat = [t for p in parts for t in p]
            own = tuple(d for o in owns for d in o)
        shapes = tuple(tuple(tuple(s) for s in b) for b in shapes)
        return EncodeReduce(tuple(dtypes), tuple(reductions), own, shapes)(flat)

    def join(self, segments, joined):
        if any(len(parts) > CHUNKED_FROM for parts in segments):
            # (of a segment of many parts: its chunks' buffers, :func:`_chunked`)
            chunked = [
                _chunked(p, s, d)[:2] if len(p) > CHUNKED_FROM else (p, s)
                for p, s, d in zip(segments, joined.shapes, joined.dtypes, strict=True)
            ]
            segments = [p for p, _ in chunked]
            joined = dataclasses.replace(joined, shapes=tuple(s for _, s in chunked))
        flat = list(itertools.chain.from_iterable(segments))
        if joined.empty:  # (empty parts are no parameters)
            flat = [
                t
                for k, seg in enumerate(segments)
                for j, t in enumerate(seg)
                if (k, j) not in joined.empty
            ]
        return Join(joined)(flat)[0]

    def unjoin(self, result, joined, world, wire=False, skip=0):
        return Unjoin(joined, world or 1, wire)([result])[skip:]

    def decode_reduce(self, outs, dtypes, reductions, means, world):
        wires = tuple(o.dtype for o in outs)
        means = tuple(tuple(m) for m in means)
        lengths = tuple(o.shape[0] for o in outs)
        decode = DecodeReduce(tuple(dtypes), tuple(reductions), means, lengths, wires)
        divisors = [_divisor(outs[0].device, d, world) for d in decode.divided]
        return decode([*outs, *divisors])

    def keep(self, t, mask):
        # (an XLA computation: its zeros are part of it, not a traced scalar,
        # which torch_xla would share with equal values elsewhere in the graph)
        kept = Keep(t.dtype, t.numel(), 0)([mask, t.reshape(-1)])[0]
        return kept.reshape(t.shape)

    def split(self, flats, shapes, casts=None):
        if not any(shapes):  # (torch_xla builds no tuple of no pieces)
            return [[] for _ in shapes]
        casts = tuple(map(tuple, casts)) if casts else tuple((None,) * len(s) for s in shapes)
        split = Split(tuple(f.dtype for f in flats), tuple(tuple(s) for s in shapes), casts)
        pieces = split.apply(flats)
        ends = list(itertools.accumulate(len(b) for b in shapes))
        return [pieces[a:z] for a, z in zip([0, *ends], ends, strict=False)]
