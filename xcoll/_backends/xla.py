"""PyTorch/XLA backend: collectives are traced into the replica's lazy graph, and
buffers are packed and cut by XLA computations (:class:`XlaKernels`).

Imported only when a leaf is on an XLA device (or the XLA runtime is running).
Facts this module relies on, measured on XLA:CPU (see docs/design.md):

* ``xm.all_gather(pin_layout=False)`` lowers to one real all-gather; the pinned
  default pads with the replica's ordinal, so replicas compile different graphs.
* Every collective adds torch_xla's numeric token to its input and derives the
  next token from its result, so a float collective turns -0.0 into +0.0 and a
  NaN result poisons later ones. The token is reset before each collective
  and once after a call's last one (``wait``), and xcoll's moves carry
  integers (see ``_wire``).
* ``Tensor.view(dtype)`` is not lowered (it runs on the CPU, outside the graph),
  so bitcasts are built as small XLA computations.
* XLA:CPU cannot all-reduce bfloat16 (``_wire`` sums half precision in float32).
* When thread-per-device replicas reach ``torch_xla.sync()`` together with a
  graph not yet compiled, each thread compiles its own executable and their
  collectives never meet. A process-wide lock around the step lets the first
  thread compile and the others hit the cache; it is held only until the
  step's graph is compiled (:mod:`.compile_lock` says why). In a
  one-replica process it costs nothing. See :func:`sync` for why a step then
  waits.
* A ``sync=False`` call's verdict is read once its header is data, at this
  device's next xcoll call or sync (:meth:`XlaTransport.settle`), never
  inside someone else's step: a read waits for the execution, and so for
  every replica's step.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch_xla
import torch_xla.core.xla_builder as xb
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr

from .._base import memo as _memo
from .._base import tree as _tree
from .._encode import pack as _pack
from .._encode import wire as _wire
from . import _xlac
from ._launch import launch_hint
from .base import Kernels, Transport
from .compile_lock import CompileLock

SYNC_LOCK = CompileLock()

# From the first XLA call on, 0-d values of 0 and 1 are data, not constants
# (docs/design.md, "One program on every replica").
_xlac.scalars_as_data()

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
_REDUCE_TYPES = {
    "sum": xm.REDUCE_SUM,
    "prod": xm.REDUCE_MUL,
    "max": xm.REDUCE_MAX,
    "min": xm.REDUCE_MIN,
}

# Built XLA computations (bitcasts by shape and dtypes, packs, unpacks and splits
# by the shapes of their parts), each built by one replica thread.
_computations: _memo.Memo[object] = _memo.Memo(locked=True)


def sync(device: torch.device | None = None, wait: bool = True) -> None:
    """Runs this replica's pending graph and waits for it to finish (unless
    not ``wait``: :func:`own_sync`).

    ``torch_xla.sync()`` runs under the process-wide lock (see the module
    docstring). Then it waits, so that each replica has one execution in flight:
    XLA:CPU's rendezvous cannot tell a replica's consecutive executions apart (all
    run as RunId 0), so a replica that runs ahead joins another execution's
    collective and every replica hangs (seen after a few dozen back-to-back calls
    at W=4). It waits for this device only (:func:`_xlac.wait_device`).
    """
    device = device or torch_xla.device()
    if _xlac.pending(device):
        step(device)
        if wait:
            _xlac.wait_device(device)
    else:  # (_xlac.pending says why there is no step then)
        _xlac.reset_token(device)
    _xlac.run_step_closures()  # (outside the lock: _xlac.step says why)


def step(device: torch.device, tensors: Sequence[torch.Tensor] | None = None) -> None:
    """Under :data:`SYNC_LOCK`: :func:`_xlac.step` of ``device``, or
    :func:`_xlac.sync_only` of ``tensors`` (their graph alone)."""
    held = SYNC_LOCK.hold()
    try:
        if tensors is None:
            _xlac.step(device)
        else:
            _xlac.sync_only(tensors)
    finally:
        SYNC_LOCK.release(held)


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


def _encode_reduce(op, dtype: torch.dtype, how: str):
    """_wire.encode_reduce in an XLA computation: its constants are part of the
    computation (a Python scalar in a torch op on an XLA tensor would be device
    data that torch_xla caches by value and shares with equal scalars elsewhere,
    so that replicas whose values coincide differently would trace different
    programs)."""
    if dtype == torch.bool:
        return op.cast(xb.Type.U8)
    if not dtype.is_floating_point:
        return op
    if how in ("max", "min"):
        bits = op.bitcast(_XLA_TYPES[_wire.BITS[dtype]])
        bits = (op != op).select(bits.scalar_like(_wire.WINNING_NAN[dtype, how]), bits)
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


def _decode_reduce(op, dtype: torch.dtype, how: str, means, divisor):
    """_wire.decode_reduce in an XLA computation. ``divisor`` (W, a parameter:
    XLA turns a division by a constant into a multiplication by its reciprocal,
    which is not correctly rounded when W is not a power of two)."""
    if dtype == torch.bool:
        return op != op.zeros_like()
    if not dtype.is_floating_point:
        return op
    if how in ("max", "min"):
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
    ops: tuple[str, ...]
    own: tuple[torch.dtype, ...]
    shapes: tuple[tuple[tuple[int, ...], ...], ...]

    def body(self, *params):
        out, at = [], 0
        for dtype, how, bucket_shapes in zip(self.dtypes, self.ops, self.shapes, strict=True):
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
            out.append(_encode_reduce(_decode(wire, dtype), dtype, how))
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
    ops: tuple[str, ...]
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
                _decode_reduce(p, d, how, m, by_dtype.get(o))
                for p, o, d, how, m in zip(
                    params[:n], self.wires, self.dtypes, self.ops, self.means, strict=True
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


# (Split, device) -> its pieces' offsets on the device (uploaded once).
_offsets: _memo.Memo[list[torch.Tensor]] = _memo.Memo(locked=True)

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

    def encode_reduce(self, parts, shapes, dtypes, ops):
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
        return EncodeReduce(tuple(dtypes), tuple(ops), own, shapes)(flat)

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

    def decode_reduce(self, outs, dtypes, ops, means, world):
        wires = tuple(o.dtype for o in outs)
        means = tuple(tuple(m) for m in means)
        lengths = tuple(o.shape[0] for o in outs)
        decode = DecodeReduce(tuple(dtypes), tuple(ops), means, lengths, wires)
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
        device = flats[0].device
        pieces = split([*flats, *_offsets.get((split, str(device)), split.offsets, device)])
        ends = list(itertools.accumulate(len(b) for b in shapes))
        return [pieces[a:z] for a, z in zip([0, *ends], ends, strict=False)]


# Settings under which the device keeps some dtypes in a narrower one: values of
# those dtypes would change in transit, so such leaves are refused.
_DOWNCASTS = {
    "XLA_USE_BF16": ((torch.float32, torch.float64), "bfloat16"),
    "XLA_DOWNCAST_BF16": ((torch.float32, torch.float64), "bfloat16"),
    "XLA_USE_32BIT_LONG": ((torch.int64,), "int32"),
}


_set_up = False
_cpu_threads = False  # (XLA:CPU replica threads: set up once per process)


def _set_up_process(device: torch.device) -> None:
    """Raises, naming the fix, where a launch would fail in XLA: several
    devices in a process that was not started as their replicas, or more
    XLA:CPU replica threads than torch_xla's thread pool has threads (only that many
    reach a collective, and XLA aborts the process after 10 s: "only 2 of
    them arrived", measured with ``torch_xla.launch`` at W=4 on 2 cores).
    Then, on XLA:CPU replica threads, makes ``torch_xla.sync`` xcoll's
    (:func:`own_sync`) and each traced scalar data of its own
    (:func:`_xlac.scalar_data_unshared`). Once per process."""
    global _set_up, _cpu_threads
    if _set_up:
        return
    hint = launch_hint(xla_leaves=True)
    if hint and xr.world_size() == 1:  # results would be W times too small
        raise RuntimeError("xcoll: XLA runs this process as a world of one" + hint)
    replicas = xr.addressable_runtime_device_count()
    cpu = replicas > 1 and xm.xla_device_hw(device) == "CPU"  # (measured there only)
    if cpu and xr.world_size() == 1:
        # XLA compiles collectives for every device it sees, with one replica
        # running them: its verifier then fails ("subgroup_size == 1 ||
        # shard_count == subgroup_size")
        raise RuntimeError(
            f"this process sees {replicas} XLA devices but runs as a world of one: start "
            "the function with torch_xla.launch(fn) (or xmp.spawn), which runs one replica "
            "per device, or make one device visible (CPU: CPU_NUM_DEVICES=1) "
            "(docs/launchers.md)"
        )
    if cpu:
        setting = os.environ.get("XLA_THREAD_POOL_SIZE", "")
        pool = int(setting) if setting.strip().isdigit() else (os.cpu_count() or 1)
        if pool < replicas:
            raise RuntimeError(
                f"this process runs {replicas} XLA:CPU replicas as threads, but torch_xla's "
                f"thread pool has {pool} (XLA_THREAD_POOL_SIZE, default: the number of cores), "
                f"so only {pool} can reach a collective and XLA would abort the process; set "
                f"XLA_THREAD_POOL_SIZE={max(16, 2 * replicas)} in the environment that starts "
                "the program (docs/launchers.md)"
            )
    if cpu:
        torch_xla.sync = own_sync
        _xlac.scalar_data_unshared()
    _set_up, _cpu_threads = True, cpu


def own_sync(wait: bool = False, reset_scope: bool = True) -> None:
    """``torch_xla.sync`` (what ``xm.mark_step()`` and ``MpDeviceLoader``
    call) on thread-per-device XLA:CPU replicas, from xcoll's first call
    there on: :func:`sync` of the calling thread's device (``reset_scope``
    is torch_xla's default). torch_xla's own, called by W replica threads at
    once, compiles a new graph once per thread, and the collectives never
    meet (measured: plain ``xm.all_reduce`` then ``torch_xla.sync()`` at W=2
    aborted 3 runs of 3); with nothing pending, its step locks device 0 as
    its barrier and waits for replica 0's execution. It waits for nothing
    (``wait`` too is moot), and verdicts of ``sync=False`` calls are read at
    the next xcoll call: a caller may sync under a lock of its own, and a
    wait there would wait for the replicas that wait for that lock. (The
    device's next step waits for this one's execution: torch_xla locks the
    device until the synchronous client has run it.)"""
    sync(torch_xla.device(), wait=False)


class XlaTransport(Transport):
    kernels = XlaKernels()
    lazy = True

    def __init__(self, device: torch.device | None):
        self.device = torch.device(device) if device is not None else torch_xla.device()
        self._key = str(self.device)
        _set_up_process(self.device)
        # What a call asks of its replica and of the device, fixed for the
        # process: its rank and world size, and the dtypes that the device
        # keeps narrower (torch_xla reads those settings when it starts).
        self._rank = xr.global_ordinal()
        self.world = xr.world_size()
        self._narrowed = _narrowed(self.device)
        self.replica_threads = _cpu_threads

    def validate(self, flat) -> None:
        if not self._narrowed:
            return
        for i, leaf in enumerate(flat.leaves):
            dtype = _tree.dtype_of(leaf)
            if dtype in self._narrowed:
                why, to = self._narrowed[dtype]
                raise TypeError(
                    f"{flat.path(i)}: {dtype} is kept as {to} on this device ({why}), so its "
                    f"values would change in transit; convert the leaf yourself (e.g. to {to})"
                )

    def own_buffers(self, flat):
        # A traced program has one parameter per device buffer, so a leaf whose
        # buffer is shared gives its replica a program of its own: a 0-d upload
        # (torch_xla caches those by value and shares them with equal scalars
        # anywhere in the graph, its collective token included), or one buffer
        # passed twice (t, t.detach()). Each such leaf is fetched (a transfer:
        # it is data, so nothing runs) and uploaded again (a 0-d one as 1-d:
        # torch_xla shares no upload of more than 0 dims), all in one call. A
        # pending tensor passed twice runs its graph alone first
        # (_run_repeated), then is split the same way. In a world of one too:
        # its program would depend on its values, and be compiled again for
        # each pattern of them.
        leaves = flat.leaves
        tensors, zero_d = flat.tensors, set(flat.zero_d)
        handles: Sequence[int | None] | None = _xlac.data_handles([leaves[i] for i in tensors])
        if handles is None:  # (one call if all are data) some are pending: asked one by one
            twice = len({id(leaves[i]) for i in tensors}) < len(tensors)
            if twice:
                _run_repeated(self.device, [leaves[i] for i in tensors])
            handles = [
                _xlac.data_handle(leaves[i]) if twice or i in zero_d else None for i in tensors
            ]
        if not zero_d and len(set(handles)) == len(handles):  # (no leaf shares a buffer)
            return leaves
        seen: set[int | None] = set()
        redo = []
        for i, h in zip(tensors, handles, strict=True):
            if h is not None and (i in zero_d or h in seen):
                redo.append(i)
            seen.add(h)
        if not redo:
            return leaves
        leaves = list(leaves)
        # (0-d: as 1-d, then a view, the same on every replica whose leaf is data)
        hosts = [h if h.dim() else h.reshape(1) for h in self.to_host([leaves[i] for i in redo])]
        for i, up in zip(redo, _xlac.upload(hosts, self.device), strict=True):
            leaves[i] = up if leaves[i].dim() else up[0]
        return leaves

    def upload_all(self, cpus):
        return _xlac.upload(cpus, self.device) if cpus else []

    def rank(self) -> int:
        return self._rank

    # The token is reset before each collective, which isolates it from NaN in
    # the results of earlier ones (the caller's, when sync=False, or this
    # call's), and once after the last (wait), which isolates the caller's
    # later collectives from this call's.

    def all_gather(self, buf: torch.Tensor) -> torch.Tensor:
        _xlac.reset_token(self.device)
        return _xlac.all_gather(buf, self.world)

    def all_reduce(self, buf: torch.Tensor, op: str) -> torch.Tensor:
        if self.world == 1:  # (``buf`` is the call's own: nothing to reduce)
            return buf
        _xlac.reset_token(self.device)
        return _xlac.all_reduce(buf, _REDUCE_TYPES[op])

    def wait(self) -> None:
        _xlac.reset_token(self.device)

    def broadcast(self, buf: torch.Tensor, src: int, guard: int = 0) -> torch.Tensor:
        # Integer sum with zeros from every other replica: exact, and nothing of
        # theirs (NaN included: the wire is integer) reaches the result, except
        # the guard header, which every replica adds to. The mask is uploaded
        # data, so every replica traces the same graph.
        is_src = self.upload(torch.tensor([self.rank() == src]))
        kept = Keep(buf.dtype, buf.shape[0], guard)([is_src, buf])[0]
        return self.all_reduce(kept, "sum")

    def sync(self) -> None:
        sync(self.device)
        self.settle()

    def sync_and_fetch(self, tensors):
        # Fetching an output of the execution waits for it, as sync's wait
        # would (one execution in flight per replica), and costs one wait less:
        # measured 0.3 ms per call at W=4 on 2 cores.
        step(self.device)
        _xlac.run_step_closures()
        hosts = self.to_host(tensors)
        self.settle()
        return hosts

    def fetch(self, tensors):
        # Where a leaf is pending, everything pending runs first (the caller's
        # work with it, as in any call's sync), as this replica's own program;
        # then this device has live pending tensors, so the step's barrier is
        # its own (_xlac.pending). Leaves that are data: a transfer, no step.
        # (One call over the leaves, not _xlac.pending's pass over every live
        # tensor of the device, a model's parameters included.)
        if tensors and _xlac.data_handles(tensors) is None:
            step(self.device)
            _xlac.run_step_closures()
        return self.to_host(tensors)

    def defer(self, verdict) -> None:
        with _DEFERRED_LOCK:
            _deferred.setdefault(self._key, []).append(verdict)

    def settle(self) -> None:
        # (a call of this thread on another device settles that device's)
        if not _deferred.get(self._key):
            return
        ready = _ready(self._key)
        for verdict in ready:  # (every one, before any raises)
            verdict.read()
        for verdict, host in zip(ready, self.to_host([v.header for v in ready]), strict=True):
            verdict.check(host)

    def to_host(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        # Bit for bit: torch_xla's float16 download makes every NaN the canonical
        # one, so a float16 tensor that came back holding NaN is fetched again as
        # its int16 bits (one small execution, only then). Data only: torch_xla
        # gives the copy of a tensor that requires grad requires_grad as well.
        hosts = _xlac.get_cpu_tensors(tensors)
        for k, (t, h) in enumerate(zip(tensors, hosts, strict=True)):
            if h.requires_grad:
                hosts[k] = h = h.detach()
            if t.dtype == torch.float16 and bool(torch.isnan(h).any()):
                bits = self.kernels.bitcast(t, torch.int16)
                hosts[k] = _xlac.get_cpu_tensors([bits])[0].view(torch.float16)
        return hosts

    def exchange(self, buf: torch.Tensor) -> torch.Tensor:
        out = self.all_gather(buf)
        _xlac.reset_token(self.device)
        step(self.device, [out])  # the graph of ``out`` alone, not everything pending
        _xlac.wait_device(self.device)
        return self.to_host([out])[0].view(self.world, -1)


# Deferred verdicts by device (XlaTransport.defer): a backward's call defers
# from autograd's thread, the replica's own thread settles.
_deferred: dict[str, list] = {}
_DEFERRED_LOCK = threading.Lock()


def _ready(device: str) -> list:
    """The deferred verdicts of ``device`` whose header is data (a sync has
    run their call), in the order of their calls, taken from the list."""
    with _DEFERRED_LOCK:
        waiting = _deferred.pop(device, [])
        if _xlac.data_handles([v.header for v in waiting]) is not None:  # (one call: all are)
            return waiting
        data = [_xlac.data_handle(v.header) is not None for v in waiting]
        rest = [v for v, d in zip(waiting, data, strict=True) if not d]
        if rest:
            _deferred[device] = rest
        return [v for v, d in zip(waiting, data, strict=True) if d]


def _run_repeated(device: torch.device, tensors: Sequence[torch.Tensor]) -> None:
    """Runs the graph of each pending tensor that ``tensors`` hold more than
    once, alone, and waits for it, so that it is data on every replica (and
    :meth:`XlaTransport.own_buffers`
    gives its second place a buffer of its own). torch_xla's graph cache keys
    a program by its nodes, not by which output reads which of them: a call
    of one signature whose pending leaves alias in another pattern ([a, a, c]
    after [a, c, a]) reused the first call's program and returned wrong
    values (measured: gradients of a world of one on XLA:CPU)."""
    seen: set[int] = set()
    repeated = []
    for t in tensors:
        if id(t) in seen and _xlac.data_handle(t) is None:
            repeated.append(t)
        seen.add(id(t))
    if repeated:
        step(device, repeated)
        _xlac.wait_device(device)


def _narrowed(device: torch.device) -> dict[torch.dtype, tuple[str, str]]:
    """The dtypes that ``device`` keeps in a narrower one: dtype -> (why, as what)."""
    out = {}
    for var, (dtypes, to) in _DOWNCASTS.items():
        if os.environ.get(var, "0") not in ("", "0", "false", "False"):
            out.update({d: (var, to) for d in dtypes})
    if xm.xla_device_hw(device) == "TPU":
        out.setdefault(torch.float64, ("the TPU", "float32"))
    return out


# One transport per device and thread: a transport holds its rank, which
# torch_xla keeps per thread (thread-per-device replicas), so one cached per
# device alone would give a thread that holds another replica's tensors that
# replica's rank.
_local = threading.local()


def transport(device: torch.device | None = None) -> XlaTransport:
    """This thread's transport of ``device`` (default: the thread's XLA
    device), made on its first call."""
    cache: dict[str, XlaTransport] = _local.__dict__.setdefault("transports", {})
    key = str(device if device is not None else torch_xla.device())
    t = cache.get(key)
    if t is None:
        t = cache[key] = XlaTransport(torch.device(key))
    return t
