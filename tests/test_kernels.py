"""The XLA kernels (XLA computations) give the same bits as the torch kernels
on drawn buckets, NaN payloads included, on one real XLA:CPU replica."""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis import given

from tests.helpers import PROPERTY
from tests.replicas import shared_pool
from xcoll import _pack
from xcoll._tree import SUPPORTED_DTYPES

_DTYPES = sorted(SUPPORTED_DTYPES, key=str)  # every dtype xcoll moves
_BITS = {torch.float64: torch.int64, torch.float32: torch.int32}
_BITS.update({torch.float16: torch.int16, torch.bfloat16: torch.int16})


# A float's exponent bits: with any of the mantissa bits, a NaN
_EXPONENT = {torch.float64: 0x7FF << 52, torch.float32: 0xFF << 23}
_EXPONENT.update({torch.float16: 0x1F << 10, torch.bfloat16: 0xFF << 7})


def _random_bits(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Every bit pattern is possible: NaNs with any payload and sign (about
    one element in four, at random places: drawn bits are NaN too rarely),
    subnormals."""
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
    from xcoll._backends.xla import XlaKernels

    parts, dtypes, world, seed, ops, means = case
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
        got["pack"] = [_as_int(kernels, t) for t in kernels.pack(inputs, shapes, dtypes)]
        flats = [
            _random_bits(dtype, (world * sum(n),), seed + k).to(inputs[0][0].device)
            for k, (dtype, n) in enumerate(zip(dtypes, sizes, strict=True))
        ]
        pieces = kernels.split(flats, [[(world, *s) for s in b] for b in shapes], casts)
        got["split"] = [[_as_int(kernels, t) for t in b] for b in pieces]
        # a move's one buffer: a header segment, then the buckets by element size
        joined = _pack.Joined.of([dtypes[k] for k in pure], [shapes[k] for k in pure], guard=4)
        header = torch.tensor([seed, 0, -1, 7], dtype=torch.int32).to(inputs[0][0].device)
        segments = [[header]] + [inputs[pure[k]] for k in joined.order]
        joined_buf = kernels.join(segments, joined)
        got["join"] = [_as_int(kernels, joined_buf)]
        # unjoin inverts join on a gather of W copies: slot-major, each part W times
        back = kernels.unjoin(torch.cat([joined_buf] * world), joined, world)
        # (expected on the host: XLA:CPU's copies of bfloat16 change NaN payloads)
        on_host = [[header.cpu()]] + [parts[pure[k]] for k in joined.order]
        for seg, parts_k in zip(back, on_host, strict=True):
            expected = torch.cat([p.reshape(-1).repeat(world) for p in parts_k])
            assert torch.equal(_as_int(kernels, seg).cpu(), _as_int(TORCH, expected)), name
        words = _random_bits(torch.int32, (world * joined.words,), seed + 1).to(header.device)
        for wire in (False, True):
            segs = kernels.unjoin(words, joined, world, wire)
            got[f"unjoin wire={wire}"] = [_as_int(kernels, t) for t in segs]
        encoded = kernels.encode_reduce(kernels.pack(inputs, shapes, dtypes), ops)
        got["encode_reduce"] = [_as_int(kernels, t) for t in encoded]
        # decoded from random wires: any bits an all-reduce could return
        reduced = [
            _random_bits(e.dtype, tuple(e.shape), seed + 3 * k).to(e.device)
            for k, e in enumerate(encoded)
        ]
        decoded = kernels.decode_reduce(reduced, dtypes, ops, means, world)
        got["decode_reduce"] = [_as_int(kernels, t) for t in decoded]
    return out


# The narrower dtypes whose leaves a reduce may merge into a bucket of the key's
# dtype (xcoll._call.merged; float32 for sums and products only)
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
        bucket = [
            _random_bits(d, s, seed + 7 * k + j)
            for j, (d, s) in enumerate(zip(own, bucket_shapes, strict=True))
        ]
        # the XLA pack needs at least one element per bucket (an empty bucket is never sent)
        if sum(p.numel() for p in bucket):
            parts.append(bucket)
            dtypes.append(dtype)
    ops, means = [], []
    for bucket, dtype in zip(parts, dtypes, strict=True):
        n = sum(p.numel() for p in bucket)
        choices = ["max", "min"] if dtype == torch.bool else ["sum", "prod", "max", "min"]
        if dtype.is_floating_point and any(p.dtype != dtype for p in bucket):
            choices = ["sum", "prod"]
        ops.append(draw(st.sampled_from(choices)))
        cut = sorted(draw(st.lists(st.integers(0, n), min_size=2, max_size=2)))
        mean = dtype.is_floating_point and ops[-1] == "sum" and cut[0] < cut[1]
        means.append(((cut[0], cut[1]),) if mean else ())
    return parts, dtypes, draw(st.sampled_from([1, 2, 3])), seed, ops, means


@PROPERTY
@given(case=_buckets())
def test_xla_kernels_give_the_torch_kernels_bits(case):
    if not case[0]:
        return  # every drawn bucket was empty
    parts, dtypes, _, _, ops, _ = case
    got = shared_pool("xla-cpu-1").run(_both, [case])[0]
    for what in got["torch"]:
        for k, (a, b) in enumerate(zip(got["torch"][what], got["xla"][what], strict=True)):
            pairs = zip(a, b, strict=True) if isinstance(a, list) else [(a, b)]
            per_bucket = what in ("pack", "split", "encode_reduce", "decode_reduce")
            merged = per_bucket and any(p.dtype != dtypes[k] for p in parts[k])
            for j, (x, y) in enumerate(pairs):
                assert x.dtype == y.dtype and x.shape == y.shape, (what, k, x, y)
                if not per_bucket:  # (join, unjoin: by segment, each bit moved as it is)
                    assert torch.equal(x, y), (what, k, x, y)
                    continue
                dtype = parts[k][j].dtype if what == "split" else dtypes[k]
                arithmetic = (what == "decode_reduce" and ops[k] in ("sum", "prod")) or (
                    what in ("pack", "split") and merged
                )
                if dtype.is_floating_point and arithmetic:
                    # XLA:CPU's float arithmetic and conversions flush
                    # subnormals to zero (docs/design.md): compared as zeros
                    x, y = _flushed(x, dtype), _flushed(y, dtype)
                if (what == "pack" and merged and dtype.is_floating_point) or (
                    what == "encode_reduce" and ops[k] in ("sum", "prod")
                ):
                    # a float sum's encoding (and a half-precision part's
                    # widening) may carry NaN payloads either way: decoding
                    # makes every NaN the quiet NaN
                    nan = torch.isnan(_float_view(x))
                    assert torch.equal(nan, torch.isnan(_float_view(y))), (what, k)
                    x, y = x[~nan], y[~nan]
                assert torch.equal(x, y), (what, k, x, y)


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
    from xcoll._backends.xla import XlaKernels

    out = []
    for t, carrier in cases:
        a = TORCH.bitcast(t, carrier)
        b = XlaKernels().bitcast(t.to(torch_xla.device()), carrier).cpu()
        out.append((a, b))
    return out
