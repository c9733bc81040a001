"""The exact encodings, checked in-process against torch's own semantics."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

from tests.helpers import same_bits, same_values
from tests.strategies import _float_values
from xcoll import _wire
from xcoll._backends.base import TORCH

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
@pytest.mark.parametrize("op", ["max", "min"])
@given(
    rows=st.lists(
        st.lists(_float_values(exact=False), min_size=3, max_size=3), min_size=1, max_size=5
    )
)
def test_ordered_keys_reduce_like_torch(dtype, op, rows):
    xs = [torch.tensor(r, dtype=torch.float64).to(dtype) for r in rows]
    keys = torch.stack([_wire.encode_order(x, op, bitcast) for x in xs])
    got = _wire.decode_order(keys.amax(0) if op == "max" else keys.amin(0), dtype, bitcast)
    expected = xs[0]
    for x in xs[1:]:
        expected = (torch.maximum if op == "max" else torch.minimum)(expected, x)
    assert same_values(got, expected)  # NaN propagates; -0.0 == +0.0
