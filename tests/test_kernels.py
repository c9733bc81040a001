"""The kernels that build and cut packed buffers: the torch kernels' results
checked in-process against what they must be (a move's bytes after a gather of
W replicas, a reduce's decoded NaN), and the XLA kernels (XLA computations)
giving the same bits as the torch kernels on drawn buckets, NaN payloads
included, on one real XLA:CPU replica."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import example, given, settings

from tests.helpers import PROPERTY, same_bits
from tests.replicas import shared_pool
from xcoll._base.tree import SUPPORTED_DTYPES
from xcoll._encode import pack as _pack
from xcoll._encode import wire as _wire

_DTYPES = sorted(SUPPORTED_DTYPES, key=str)  # every dtype xcoll moves
_BITS = {torch.float64: torch.int64, torch.float32: torch.int32}
_BITS.update({torch.float16: torch.int16, torch.bfloat16: torch.int16})


# A float's exponent bits: with any of the mantissa bits, a NaN
_EXPONENT = {torch.float64: 0x7FF << 52, torch.float32: 0xFF << 23}
_EXPONENT.update({torch.float16: 0x1F << 10, torch.bfloat16: 0xFF << 7})


def _random_bits(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Every bit pattern is possible: NaNs with any payload and sign (about
    one element in four, at random places: drawn bits are NaN too rarely),
    zeros of both signs (one in eight), subnormals."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    carrier = _BITS.get(dtype, dtype)
    info = torch.iinfo(carrier)
    t = torch.randint(info.min, info.max, shape, generator=g, dtype=carrier)
    if dtype not in _BITS:
        return t
    nan = torch.rand(shape, generator=g) < 0.25
    t[nan] |= _EXPONENT[dtype] | 1
    # and zeros of both signs (key 0 is +0.0's: its order is the sign bit's)
    zero = torch.rand(shape, generator=g) < 0.125
    t[zero] = torch.where(torch.rand(shape, generator=g) < 0.5, 0, info.min)[zero].to(carrier)
    return t.view(dtype)


def _as_int(kernels, t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers, made where ``t`` is (so a download cannot change them)."""
    if t.dtype in _BITS:
        t = kernels.bitcast(t, _BITS[t.dtype])
    return t.cpu()


def _both(case):
    """Runs every kernel of both sets on the same input; returns their outputs as integers."""
    import torch_xla

    from xcoll._backends.base import TORCH
    from xcoll._backends.xla_kernels import XlaKernels

    parts, dtypes, world, seed, reductions, means, guard = case
    dev = torch_xla.device()
    xla = XlaKernels()
    shapes = [[tuple(p.shape) for p in bucket] for bucket in parts]
    sizes = [[p.numel() for p in bucket] for bucket in parts]
    # a reduce's merged bucket casts each piece back to its part's dtype
    casts = [
        [None if p.dtype == d else p.dtype for p in b] for b, d in zip(parts, dtypes, strict=True)
    ]
    # (moves never merge: join and unjoin take the buckets of one dtype)
    pure = [k for k, b in enumerate(parts) if not any(casts[k])]
    out = {"torch": {}, "xla": {}}
    on_device = [[p.to(dev) for p in bucket] for bucket in parts]
    for name, kernels, inputs in (("torch", TORCH, parts), ("xla", xla, on_device)):
        got = out[name]
        flats = [
            _random_bits(dtype, (world * sum(n),), seed + k).to(inputs[0][0].device)
            for k, (dtype, n) in enumerate(zip(dtypes, sizes, strict=True))
        ]
        pieces = kernels.split(flats, [[(world, *s) for s in b] for b in shapes], casts)
        got["split"] = [[_as_int(kernels, t) for t in b] for b in pieces]
        # the buckets that merged nothing, without casts (the default)
        plain_shapes = [[(world, *s) for s in shapes[k]] for k in pure]
        plain = kernels.split([flats[k] for k in pure], plain_shapes)
        got["split, no casts"] = [[_as_int(kernels, t) for t in b] for b in plain]
        # a move's one buffer: a header segment (if any), then the buckets by element size
        joined = _pack.Joined.of([dtypes[k] for k in pure], [shapes[k] for k in pure], guard)
        head = [[_random_bits(torch.int32, (guard,), seed + 5)]] if guard else []
        segments = [[h.to(dev) for h in seg] for seg in head] if name == "xla" else head
        segments = segments + [inputs[pure[k]] for k in joined.order]
        if segments:  # (else no header, and every bucket merged: nothing to join)
            joined_buf = kernels.join(segments, joined)
            got["join"] = [_as_int(kernels, joined_buf)]
            # unjoin inverts join on a gather of W copies: slot-major, each part W times
            back = kernels.unjoin(torch.cat([joined_buf] * world), joined, world)
            # (expected on the host: XLA:CPU's copies of bfloat16 change NaN payloads)
            on_host = head + [parts[pure[k]] for k in joined.order]
            for seg, parts_k in zip(back, on_host, strict=True):
                expected = torch.cat([p.reshape(-1).repeat(world) for p in parts_k])
                assert torch.equal(_as_int(kernels, seg).cpu(), _as_int(TORCH, expected)), name
            # and on any bits a gather could return (every replica's different)
            words = _random_bits(torch.int32, (world * joined.words,), seed + 1).to(dev)
            words = words if name == "xla" else words.cpu()
            for wire in (False, True):
                segs = kernels.unjoin(words, joined, world, wire)
                got[f"unjoin wire={wire}"] = [_as_int(kernels, t) for t in segs]
        # each dtype's (W, 3, W) random bits (NaN payloads included) cut into
        # the replicas' parts along dims 0 and 2 (a reduce-scatter's, an all-to-all's)
        cuts = [_random_bits(d, (world, 3, world), seed + 11 * k) for k, d in enumerate(dtypes)]
        cuts = [t.to(dev) for t in cuts] if name == "xla" else cuts
        got["parts"] = [
            [_as_int(kernels, x) for x in kernels.parts(t, d, world)] for t in cuts for d in (0, 2)
        ]
        encoded = kernels.encode_reduce(inputs, shapes, dtypes, reductions)
        got["encode_reduce"] = [_as_int(kernels, t) for t in encoded]
        # decoded from random wires: any bits an all-reduce could return
        reduced = [
            _reduced(dtypes[k], reductions[k], e.dtype, tuple(e.shape), seed + 3 * k).to(e.device)
            for k, e in enumerate(encoded)
        ]
        decoded = kernels.decode_reduce(reduced, dtypes, reductions, means, world)
        got["decode_reduce"] = [_as_int(kernels, t) for t in decoded]
    return out


def _reduced(dtype, reduction, wire_dtype, shape, seed):
    """Random bits an all-reduce of a bucket's wire could return. A float
    max/min travels as ordered keys (``_wire.encode_order``): keys of random
    floats, so that the decoded values hold NaN of any sign and payload (random
    keys decode to NaN too rarely)."""
    if dtype.is_floating_point and reduction in ("max", "min"):
        bits = _random_bits(dtype, shape, seed).view(wire_dtype)
        return torch.where(bits < 0, bits ^ torch.iinfo(wire_dtype).max, bits)
    return _random_bits(wire_dtype, shape, seed)


# The narrower dtypes whose leaves a reduce may merge into a bucket of the key's
# dtype (xcoll._core.ops.merged; float32 for sums and products only)
_NARROWER = {
    torch.float32: [torch.float16, torch.bfloat16],
    torch.int64: [torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool],
    torch.int32: [torch.int16, torch.int8, torch.uint8, torch.bool],
    torch.int16: [torch.int8, torch.uint8, torch.bool],
    torch.int8: [torch.bool],
    torch.uint8: [torch.bool],
}


@st.composite
def _buckets(draw):
    # A move's header: none, a gather's 2 words, or more. Parts of random
    # sizes, or every part of one size in bytes: a header's (a gather whose
    # slots all have its header's size regroups as one run), or a few KiB.
    guard = draw(st.sampled_from([0, 2, 64]))
    same = draw(st.sampled_from([None, None, 4 * guard or 16, 2048]))
    shapes = st.lists(st.integers(0, 3), max_size=3).map(tuple)
    buckets = draw(
        st.lists(
            st.tuples(st.sampled_from(_DTYPES), st.lists(shapes, min_size=1, max_size=4)),
            min_size=1,
            max_size=3,
        )
    )
    seed = draw(st.integers(0, 2**20))
    parts, dtypes = [], []
    for k, (dtype, bucket_shapes) in enumerate(buckets):
        merged = draw(st.booleans()) and dtype in _NARROWER
        own = [
            draw(st.sampled_from([dtype, *_NARROWER[dtype]])) if merged else dtype
            for _ in bucket_shapes
        ]
        if same:
            bucket_shapes = [(same // d.itemsize,) for d in own]
        bucket = [
            _random_bits(d, s, seed + 7 * k + j)
            for j, (d, s) in enumerate(zip(own, bucket_shapes, strict=True))
        ]
        # the XLA pack needs at least one element per bucket (an empty bucket is never sent)
        if sum(p.numel() for p in bucket):
            parts.append(bucket)
            dtypes.append(dtype)
    reductions, means = [], []
    for bucket, dtype in zip(parts, dtypes, strict=True):
        n = sum(p.numel() for p in bucket)
        choices = ["max", "min"] if dtype == torch.bool else ["sum", "prod", "max", "min"]
        if dtype.is_floating_point and any(p.dtype != dtype for p in bucket):
            choices = ["sum", "prod"]
        reductions.append(draw(st.sampled_from(choices)))
        cut = sorted(draw(st.lists(st.integers(0, n), min_size=2, max_size=2)))
        mean = dtype.is_floating_point and reductions[-1] == "sum" and cut[0] < cut[1]
        means.append(((cut[0], cut[1]),) if mean else ())
    return parts, dtypes, draw(st.sampled_from([1, 2, 3])), seed, reductions, means, guard


@PROPERTY
@given(case=_buckets())
# (every bucket merged: nothing to split without casts, which XLA could not build)
@example(
    case=(
        [[torch.tensor(float("nan")), torch.tensor(-4.0), torch.tensor(17.0, dtype=torch.float16)]],
        [torch.float32],
        1,
        0,
        ["sum"],
        [()],
        0,
    )
)
def test_xla_kernels_give_the_torch_kernels_bits(case):
    if not case[0]:
        return  # every drawn bucket was empty
    _compare(case)


# Each dtype under reductions whose kernels differ (float sums and products widen half
# precision, float max/min travel as keys), and the merged buckets of each kind
_EVERY = [
    (torch.float64, [torch.float64], ["sum", "max"]),
    (torch.float32, [torch.float32], ["prod", "min"]),
    (torch.float16, [torch.float16], ["sum", "min"]),
    (torch.bfloat16, [torch.bfloat16], ["prod", "max"]),
    (torch.int64, [torch.int64], ["sum"]),
    (torch.int32, [torch.int32], ["prod"]),
    (torch.int16, [torch.int16], ["max"]),
    (torch.int8, [torch.int8], ["min"]),
    (torch.uint8, [torch.uint8], ["sum"]),
    (torch.bool, [torch.bool], ["max", "min"]),
    (torch.float32, [torch.float32, torch.float16, torch.bfloat16], ["sum"]),
    (torch.int64, [torch.int64, torch.int32, torch.int16, torch.uint8], ["max"]),
    (torch.int8, [torch.int8, torch.bool], ["min"]),
    (torch.uint8, [torch.uint8, torch.bool], ["max"]),
]


# A float sum's means (ranges divided by W): its first part, all of it, a middle range
_MEANS = [((0, 3),), ((0, 14),), ((2, 9),)]


def _every_bucket(world: int, guard: int, seed: int):
    """A case (as :func:`_buckets` draws one) of the buckets of :data:`_EVERY`,
    each of four parts of two sizes (two runs of equal slots), a float sum's
    elements divided by W in one of :data:`_MEANS`."""
    shapes = [(3,), (3,), (2, 2), (4,)]
    parts, dtypes, reductions, means = [], [], [], []
    for dtype, own, bucket_reductions in _EVERY:
        for reduction in bucket_reductions:
            k = len(parts)
            kinds = [own[j % len(own)] for j in range(len(shapes))]
            pairs = enumerate(zip(kinds, shapes, strict=True))
            parts.append([_random_bits(d, s, seed + 10 * k + j) for j, (d, s) in pairs])
            dtypes.append(dtype)
            reductions.append(reduction)
            mean = dtype.is_floating_point and reduction == "sum"
            means.append(_MEANS[sum(1 for m in means if m) % len(_MEANS)] if mean else ())
    return parts, dtypes, world, seed, reductions, means, guard


@pytest.mark.parametrize("world,guard", [(2, 64), (3, 4)])
def test_xla_kernels_give_the_torch_kernels_bits_for_every_dtype_and_op(world, guard):
    """Every kernel path once, whatever the examples drawn above (CI's derive
    from the test's name, and can miss a dtype or a reduction)."""
    _compare(_every_bucket(world, guard, seed=world))


def _compare(case):
    parts, dtypes, _, _, reductions, _, _ = case
    got = shared_pool("xla-cpu-1").run(_both, [case])[0]
    for k, x in enumerate(got["torch"]["decode_reduce"]):
        if dtypes[k].is_floating_point:  # every NaN the quiet NaN, whatever the inputs' were
            nan = torch.isnan(x.view(dtypes[k]))
            assert torch.all(x[nan] == _quiet_bits(dtypes[k])), (k, dtypes[k], reductions[k])
    for what in got["torch"]:
        for k, (a, b) in enumerate(zip(got["torch"][what], got["xla"][what], strict=True)):
            pairs = zip(a, b, strict=True) if isinstance(a, list) else [(a, b)]
            per_bucket = what in ("split", "encode_reduce", "decode_reduce")
            merged = per_bucket and any(p.dtype != dtypes[k] for p in parts[k])
            for j, (x, y) in enumerate(pairs):
                assert x.dtype == y.dtype and x.shape == y.shape, (what, k, x, y)
                if not per_bucket:  # (join, unjoin: by segment, each bit moved as it is)
                    assert torch.equal(x, y), (what, k, x, y)
                    continue
                dtype = parts[k][j].dtype if what == "split" else dtypes[k]
                arithmetic = (what == "decode_reduce" and reductions[k] in ("sum", "prod")) or (
                    what in ("encode_reduce", "split") and merged
                )
                if dtype.is_floating_point and arithmetic:
                    # XLA:CPU's float arithmetic and conversions flush
                    # subnormals to zero (docs/design.md): compared as zeros
                    x, y = _flushed(x, dtype), _flushed(y, dtype)
                if what == "encode_reduce" and reductions[k] in ("sum", "prod"):
                    # a float sum's encoding (and a half-precision part's
                    # widening) may carry NaN payloads either way: decoding
                    # makes every NaN the quiet NaN
                    nan = torch.isnan(_float_view(x))
                    assert torch.equal(nan, torch.isnan(_float_view(y))), (what, k)
                    x, y = x[~nan], y[~nan]
                assert torch.equal(x, y), (what, k, x, y)


def _quiet_bits(dtype: torch.dtype) -> int:
    """The bits of the quiet NaN ``float("nan")`` in ``dtype``, as a signed integer."""
    return int(torch.tensor(float("nan"), dtype=dtype).view(_BITS[dtype]).item())


def _flushed(ints: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bits ``ints`` of floats of ``dtype`` with every subnormal replaced
    by the zero of its sign."""
    exponent = _EXPONENT[dtype]
    magnitude = ints & ~torch.iinfo(ints.dtype).min
    subnormal = (ints & exponent == 0) & (magnitude != 0)
    return torch.where(subnormal, ints & torch.iinfo(ints.dtype).min, ints)


def _float_view(ints: torch.Tensor) -> torch.Tensor:
    """Integers holding float bits, seen as the float of their width."""
    width = {torch.int64: torch.float64, torch.int32: torch.float32, torch.int16: torch.float16}
    return ints.view(width[ints.dtype]) if ints.dtype in width else ints.float()


def test_bitcast_agrees_on_every_float_dtype():
    floats = [(_random_bits(d, (5, 3), 11), i) for d, i in _BITS.items()]
    ints = [(_random_bits(i, (5, 3), 12), d) for d, i in _BITS.items()]
    got = shared_pool("xla-cpu-1").run(_bitcasts, [floats + ints])[0]
    for (t, to), (a, b) in zip(floats + ints, got, strict=True):
        if to == torch.float16:
            # torch_xla's float16 download canonicalises NaN payloads: compare
            # the NaNs as NaNs, every other element bit for bit
            nan = torch.isnan(a)
            assert torch.equal(nan, torch.isnan(b)), (t.dtype, to)
            a, b = a[~nan], b[~nan]
        assert torch.equal(
            a.view(_BITS.get(a.dtype, a.dtype)), b.view(_BITS.get(b.dtype, b.dtype))
        ), (t.dtype, to)


def _bitcasts(cases):
    import torch_xla

    from xcoll._backends.base import TORCH
    from xcoll._backends.xla_kernels import XlaKernels

    out = []
    for t, carrier in cases:
        a = TORCH.bitcast(t, carrier)
        b = XlaKernels().bitcast(t.to(torch_xla.device()), carrier).cpu()
        out.append((a, b))
    return out


# ---- the torch kernels, in-process --------------------------------------------
# (no deadline: a loaded machine is slow, whatever the example)


@st.composite
def _moves(draw):
    """One move's segments on each of W replicas: a header of 0, 2 or 64 int32
    words (a gather's is 2), then buckets of distinct dtypes whose parts have
    random sizes, or all one size in bytes: the header's (every slot of a
    gather then has one size, and regroups as one run), or larger."""
    world = draw(st.integers(1, 4), "world")
    guard = draw(st.sampled_from([0, 2, 64]), "guard")
    dtypes = draw(
        st.lists(st.sampled_from(_DTYPES), min_size=0 if guard else 1, max_size=4, unique=True),
        "dtypes",
    )
    same = draw(st.sampled_from([None, 4 * guard or 8, 256, 4096]), "bytes of every part")
    shapes = []
    for d in dtypes:
        count = draw(st.integers(1, 4), "parts")
        if same is None:
            shape = st.lists(st.integers(0, 3), max_size=3).map(tuple)
            shapes.append([draw(shape, "shape") for _ in range(count)])
        else:
            shapes.append([(max(1, same // d.itemsize),)] * count)
    return world, guard, dtypes, shapes, draw(st.integers(0, 2**20), "seed")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


# Every slot of one size, padding none: the buffer regroups as one run of equal slots
@settings(deadline=None)
@example(case=(2, 0, [torch.uint8], [[()] * 8], 0))  # 1 byte each
@example(case=(3, 64, [torch.float32], [[(64,), (16, 4)]], 1))  # the gather header's 256
@example(case=(2, 0, [torch.int16], [[(3,)] * 4], 2))
@given(case=_moves())
def test_torch_join_and_unjoin_carry_every_replicas_bytes(case):
    from xcoll._backends.base import TORCH

    world, guard, dtypes, shapes, seed = case
    joined = _pack.Joined.of(dtypes, shapes, guard)
    # each replica's segments, its own bits, in the joined buffer's order
    replicas = []
    for r in range(world):
        at = seed + 1000 * r
        head = [[_random_bits(torch.int32, (guard,), at)]] if guard else []
        buckets = [
            [_random_bits(dtypes[k], s, at + 10 * k + j) for j, s in enumerate(shapes[k])]
            for k in joined.order
        ]
        replicas.append(head + buckets)
    bufs = [TORCH.join(segments, joined) for segments in replicas]
    for buf, segments in zip(bufs, replicas, strict=True):
        assert buf.dtype == torch.int32 and tuple(buf.shape) == (joined.words,)
        raw, at = buf.view(torch.uint8), 0
        for seg, n, padded in zip(segments, joined.nbytes, joined.padded, strict=True):
            assert torch.equal(raw[at : at + n], torch.cat([_bytes(p) for p in seg]))
            assert not raw[at + n : at + padded].any(), "padding is zero bytes"
            at += padded
        assert at == 4 * joined.words
    # a gather's result (every replica's buffer, in rank order): each segment
    # slot-major, every slot's W parts side by side
    for wire in (False, True):
        got = TORCH.unjoin(torch.cat(bufs), joined, world, wire)
        assert len(got) == len(joined.dtypes)
        for k, (seg, dtype) in enumerate(zip(got, joined.dtypes, strict=True)):
            slots = zip(*(segments[k] for segments in replicas), strict=True)
            expected = torch.cat([p.reshape(-1) for slot in slots for p in slot])
            if wire:
                expected = _wire.encode_move(expected, TORCH.bitcast)
            assert same_bits(seg, expected), (k, dtype, wire)
    # a broadcast's (one replica's buffer)
    got = TORCH.unjoin(bufs[-1].clone(), joined, None)
    for seg, parts in zip(got, replicas[-1], strict=True):
        assert same_bits(seg, torch.cat([p.reshape(-1) for p in parts]))


_FLOATS = [d for d in _DTYPES if d.is_floating_point]


@settings(deadline=None)
@given(
    dtype=st.sampled_from(_FLOATS),
    reduction=st.sampled_from(["sum", "prod", "max", "min"]),
    world=st.integers(1, 4),
    n=st.integers(1, 40),
    cut=st.lists(st.integers(0, 40), min_size=2, max_size=2).map(sorted),
    seed=st.integers(0, 2**20),
)
def test_torch_decode_reduce_makes_every_nan_quiet_and_divides_means(
    dtype, reduction, world, n, cut, seed
):
    """Whatever the all-reduce returned: a float result's NaN is the quiet NaN
    ``float("nan")``, whatever its sign and payload; a max/min's keys decode to
    the floats they order; a mean's range is divided by W before rounding."""
    from xcoll._backends.base import TORCH

    means = [(min(cut[0], n), min(cut[1], n))] if reduction == "sum" and cut[0] < min(cut[1], n) else []
    wide = _wire.ACCUMULATE.get(dtype, dtype) if reduction in ("sum", "prod") else dtype
    values = _random_bits(wide, (n,), seed)  # NaN of any sign and payload, subnormals
    wire = values.clone()
    if reduction in ("max", "min"):
        wire = _reduced(dtype, reduction, _BITS[dtype], (n,), seed)
    got = TORCH.decode_reduce([wire], [dtype], [reduction], [means], world)[0]
    expected = values.clone()
    for a, z in means:
        expected[a:z] /= world
    expected = expected.to(dtype)
    expected[torch.isnan(expected)] = float("nan")
    assert got.dtype == dtype and got.shape == (n,)
    assert torch.equal(_as_int(TORCH, got), _as_int(TORCH, expected)), (got, expected)
    assert torch.all(_as_int(TORCH, got)[torch.isnan(got)] == _quiet_bits(dtype))


@st.composite
def _merged_bucket(draw):
    dtype = draw(st.sampled_from(sorted(_NARROWER, key=str)), "bucket dtype")
    own = draw(st.lists(st.sampled_from([dtype, *_NARROWER[dtype]]), min_size=1, max_size=6))
    shapes = [draw(st.lists(st.integers(0, 3), max_size=2).map(tuple)) for _ in own]
    world = draw(st.integers(1, 3), "world")
    return dtype, own, [(world, *s) for s in shapes], draw(st.integers(0, 2**20), "seed")


@settings(deadline=None)
@given(case=_merged_bucket())
def test_torch_split_cuts_a_merged_bucket_and_casts_each_piece_back(case):
    """A reduce's merged bucket (``xcoll._core.ops.merged``): each leaf's piece of
    the wide result, cast back to its own dtype (rounded once, a NaN the quiet
    NaN: ``_wire.cast_back``), in order."""
    from xcoll._backends.base import TORCH

    dtype, own, shapes, seed = case
    n = sum(_pack.numel(s) for s in shapes)
    flat = _random_bits(dtype, (n,), seed)
    casts = [None if d == dtype else d for d in own]
    pieces = TORCH.split([flat], [shapes], [casts])[0]
    if not any(casts):  # (and the same without casts: the default)
        assert all(map(same_bits, TORCH.split([flat], [shapes])[0], pieces))
    at = 0
    for piece, d, shape in zip(pieces, own, shapes, strict=True):
        m = _pack.numel(shape)
        expected = flat[at : at + m].to(d).reshape(shape)
        if d.is_floating_point:
            expected[torch.isnan(expected)] = float("nan")
        assert same_bits(piece, expected), (dtype, d, shape)
        at += m


@settings(deadline=None)
@given(case=_merged_bucket())
def test_torch_pack_widens_each_part_exactly(case):
    """A reduce's merged bucket packed: one buffer of the bucket's dtype, each
    part converted exactly (it is narrower), whether or not a part of the
    bucket's own dtype comes first (float16 and bfloat16 sum as float32). A
    NaN stays a NaN; its payload may come out of the widening either way
    (torch's conversions differ, the one of ``copy_`` keeps it, the one of
    ``to`` does not), and decoding makes every NaN the quiet NaN."""
    from xcoll._backends.base import TORCH

    dtype, own, shapes, seed = case
    parts = [_random_bits(d, s, seed + j) for j, (d, s) in enumerate(zip(own, shapes, strict=True))]
    got = TORCH.pack([parts], [shapes], [dtype])[0]
    expected = torch.cat([p.reshape(-1).to(dtype) for p in parts])
    if dtype.is_floating_point:
        nan = torch.isnan(expected)
        assert torch.equal(torch.isnan(got), nan), (got, expected)
        got, expected = got[~nan], expected[~nan]
    assert same_bits(got, expected)


def test_torch_join_and_unjoin_make_their_buffers_where_the_parts_are():
    """On the parts' device, whichever it is (here torch's ``meta``, which
    holds no data: the kernels serve every device but XLA's)."""
    from xcoll._backends.base import TORCH

    joined = _pack.Joined.of([torch.float32, torch.int8], [[(3,)], [(5,), ()]], 4)
    meta = torch.device("meta")
    segments = [[torch.empty(4, dtype=torch.int32, device=meta)]]
    int8 = [torch.empty(s, dtype=torch.int8, device=meta) for s in [(5,), ()]]
    segments += [[torch.empty(3, device=meta)], int8]
    buf = TORCH.join(segments, joined)
    assert buf.device == meta and tuple(buf.shape) == (joined.words,)
    for world in (None, 2):
        result = torch.empty((world or 1) * joined.words, dtype=torch.int32, device=meta)
        assert all(t.device == meta for t in TORCH.unjoin(result, joined, world))


def _means(_):
    import torch_xla

    import xcoll

    x = torch.tensor([1.0, 2.0], dtype=torch.bfloat16).to(torch_xla.device()) * (xcoll.rank() + 1)
    return xcoll.reduce({"m": x, "y": x.float()}, "mean", to_cpu=True)


def test_xla_means_divide_on_each_replicas_own_device():
    # (each replica thread has a device of its own: a divisor made on another's
    # aborts the process)
    out = shared_pool("xla-cpu-2").run(_means, [None, None])
    for got in out:
        assert got["m"].tolist() == [1.5, 3.0] and got["m"].dtype == torch.bfloat16, got
        assert got["y"].tolist() == [1.5, 3.0], got
