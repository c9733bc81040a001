"""The exact encodings, checked in-process against torch's own semantics."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers import same_bits, same_values
from tests.strategies import _float_values
from xcoll._backends.base import TORCH
from xcoll._encode import wire as _wire

FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
bitcast = TORCH.bitcast


@pytest.mark.parametrize("dtype", FLOATS)
@given(values=st.lists(_float_values(exact=False), min_size=1, max_size=20))
def test_moves_round_trip_bitwise(dtype, values):
    x = torch.tensor(values, dtype=torch.float64).to(dtype)
    wire = _wire.encode_move(x, bitcast)
    assert not wire.dtype.is_floating_point
    assert same_bits(_wire.decode_move(wire.clone(), dtype, bitcast), x)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("reduction", ["max", "min"])
@given(
    rows=st.lists(
        st.lists(_float_values(exact=False), min_size=3, max_size=3), min_size=1, max_size=5
    )
)
def test_ordered_keys_reduce_like_torch(dtype, reduction, rows):
    xs = [torch.tensor(r, dtype=torch.float64).to(dtype) for r in rows]
    keys = torch.stack([_wire.encode_order(x, reduction, bitcast) for x in xs])
    got = _wire.decode_order(keys.amax(0) if reduction == "max" else keys.amin(0), dtype, bitcast)
    expected = xs[0]
    for x in xs[1:]:
        expected = (torch.maximum if reduction == "max" else torch.minimum)(expected, x)
    assert same_values(got, expected)  # NaN propagates; -0.0 == +0.0


# ---- reduce encodings ---------------------------------------------------------

_INTS = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]


def _fold(reduction, rows):
    """The all-reduce an engine makes of the replicas' wires (``rows``): elementwise,
    in the wire's dtype (integers wrap)."""
    f = {"sum": torch.add, "prod": torch.mul, "max": torch.maximum, "min": torch.minimum}[reduction]
    acc = rows[0]
    for r in rows[1:]:
        acc = f(acc, r)
    return acc


def _promised(reduction, xs, dtype, means):
    """What docs/design.md promises a reduce of ``xs`` gives: integers wrap as
    their dtype does; bools: max is any, min is all; float sums and products
    (of values whose float32 results are exact) read -0.0 as +0.0, a mean is
    the sum divided by W before the one rounding to ``dtype``; max and min
    order -0.0 below +0.0; NaN propagates as the quiet NaN."""
    if dtype == torch.bool:
        return torch.stack(xs).any(0) if reduction == "max" else torch.stack(xs).all(0)
    if not dtype.is_floating_point:
        return _fold(reduction, xs)
    x = torch.stack([t.double() for t in xs])
    if reduction in ("sum", "prod"):
        acc = (x + 0.0).sum(0) if reduction == "sum" else (x + 0.0).prod(0)
        for a, z in means:
            acc[a:z] /= len(xs)
    else:
        acc = x.amax(0) if reduction == "max" else x.amin(0)
        signed = torch.signbit(x)
        zero_sign = signed.all(0) if reduction == "max" else signed.any(0)
        acc = torch.where(acc == 0, torch.where(zero_sign, -0.0, 0.0).double(), acc)
    acc = acc.masked_fill(torch.isnan(x).any(0) | torch.isnan(acc), float("nan")).to(dtype)
    return acc.masked_fill(torch.isnan(acc), float("nan"))


@st.composite
def _reduce_rows(draw):
    dtype = draw(st.sampled_from(FLOATS + _INTS + [torch.bool]), "dtype")
    reductions = ["max", "min"] if dtype == torch.bool else ["sum", "prod", "max", "min"]
    reduction = draw(st.sampled_from(reductions), "reduction")
    world, n = draw(st.integers(1, 4), "world"), draw(st.integers(1, 6), "n")
    if dtype == torch.bool:
        values = st.booleans()
    elif dtype.is_floating_point:  # (sums and products of these are exact in float32)
        values = _float_values(exact=reduction in ("sum", "prod"))
    else:
        info = torch.iinfo(dtype)
        values = st.integers(info.min, info.max)
    rows = [
        torch.tensor(draw(st.lists(values, min_size=n, max_size=n)), dtype=torch.float64)
        if dtype.is_floating_point
        else torch.tensor(draw(st.lists(values, min_size=n, max_size=n)), dtype=dtype)
        for _ in range(world)
    ]
    cut = sorted(draw(st.lists(st.integers(0, n), min_size=2, max_size=2)))
    means = [tuple(cut)] if dtype.is_floating_point and reduction == "sum" and cut[0] < cut[1] else []
    return dtype, reduction, [r.to(dtype) for r in rows], means


@settings(deadline=None)
@given(case=_reduce_rows())
def test_reduce_encodings_reduce_as_documented(case):
    """Each replica's buffer encoded (``encode_reduce``), the engine's
    all-reduce of the wires in their own dtype, decoded (``decode_reduce``):
    the result docs/design.md promises, bit for bit, in the wire dtype it
    names (bools as uint8, float max/min as integer keys, half-precision
    sums and products in float32), the buffer itself where its width stays."""
    dtype, reduction, xs, means = case
    wires = []
    for x in xs:
        buf = x.clone()
        wire = _wire.encode_reduce(buf, reduction, bitcast)
        expected = {torch.bool: torch.uint8}.get(dtype, dtype)
        if dtype.is_floating_point and reduction in ("max", "min"):
            expected = _wire.BITS[dtype]
        elif dtype.is_floating_point:
            expected = _wire.ACCUMULATE.get(dtype, dtype)
        assert wire.dtype == expected, (dtype, reduction, wire.dtype)
        if wire.dtype.itemsize == dtype.itemsize:  # consumed: no second buffer
            assert wire.data_ptr() == buf.data_ptr()
        wires.append(wire)
    got = _wire.decode_reduce(_fold(reduction, wires), dtype, reduction, bitcast, means, len(xs))
    assert same_bits(got, _promised(reduction, xs, dtype, means)), (dtype, reduction, xs, got)


class _Temporaries(TorchDispatchMode):
    """Records the largest number of elements of a tensor that a torch op
    makes while it is active, other than views of ``buf``."""

    def __init__(self, buf: torch.Tensor):
        super().__init__()
        self.storage, self.largest = buf.untyped_storage().data_ptr(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() != self.storage:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("reduction", ["max", "min"])
def test_a_reduce_larger_than_a_chunk_is_encoded_whole(reduction):
    """Buffers of more than 2**20 elements are encoded and decoded in chunks:
    every chunk is, and no temporary (a mask, the flipped keys) has more than
    a chunk's elements, whatever the buffer's size."""
    n = (1 << 20) + 3
    x = torch.arange(n, dtype=torch.float32) - n // 2
    x[-1] = -0.0
    x[7] = float("nan")
    buf = x.clone()
    with _Temporaries(buf) as encoding:
        wire = _wire.encode_reduce(buf, reduction, bitcast)
    assert torch.equal(wire, _wire.encode_order(x, reduction, bitcast))
    with _Temporaries(wire) as decoding:
        got = _wire.decode_reduce(wire, torch.float32, reduction, bitcast)
    assert same_bits(got, x.masked_fill(torch.isnan(x), float("nan")))
    assert 0 < encoding.largest <= 1 << 20 and 0 < decoding.largest <= 1 << 20


# ---- merged reduce buckets ----------------------------------------------------

# Integer dtypes, each after every dtype whose values it may hold (xcoll._encode.wire.INTS)
_INTEGERS = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
_HALVES = [torch.float16, torch.bfloat16, torch.float32]


def _values(d: torch.dtype) -> tuple[int, int]:
    return (0, 1) if d == torch.bool else (torch.iinfo(d).min, torch.iinfo(d).max)


def _holds(wide: torch.dtype, d: torch.dtype) -> bool:
    """Whether every value of ``d`` is one of ``wide``'s."""
    (lo, hi), (a, z) = _values(wide), _values(d)
    return lo <= a and z <= hi


@pytest.mark.parametrize("reduction", ["sum", "prod", "max", "min"])
@settings(deadline=None)
@given(
    leaves=st.lists(
        st.tuples(st.sampled_from(_INTEGERS + FLOATS), st.integers(0, 12)), min_size=1, max_size=8
    ),
    widen=st.sampled_from([0, 16, 64, 1 << 20]),
)
def test_a_merged_bucket_holds_every_value_of_its_leaves(reduction, leaves, widen):
    """A reduce's leaves of one reduction share a bucket where the result stays the
    same: integers in the widest integer dtype present that holds every
    value of theirs (uint8 not in int8), up to Tuning.widen bytes of each dtype
    widened; half-precision sums and products with float32's, or with each
    other as float32; every other leaf in a bucket of its own dtype."""
    from xcoll._base import tree as _tree
    from xcoll._core import ops as _ops

    if reduction in ("sum", "prod"):  # (a bool's prod is its min, a sum of bools is refused)
        leaves = [(d, n) for d, n in leaves if d != torch.bool] or [(torch.int8, 1)]
    flat = _tree.flatten([torch.zeros(n, dtype=d) for d, n in leaves])
    with _ops.tuned(widen=widen):
        got = _ops.merged(flat, [(d, reduction) for d, _ in leaves])
    present = {d for d, _ in leaves}
    ints = [d for d in _INTEGERS if d in present]
    widest = ints[-1] if ints else None
    halves = [d for d in _HALVES if d in present]
    for (d, _), key in zip(leaves, got, strict=True):
        elements = sum(n for e, n in leaves if e == d)  # (every leaf of d is merged or none)
        if d in ints and _holds(widest, d) and elements * widest.itemsize <= widen:
            expected = widest
        elif d in halves and reduction in ("sum", "prod") and len(halves) > 1:
            expected = torch.float32
        else:
            expected = d
        assert key == (expected, reduction), (d, key, leaves)
