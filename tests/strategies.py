"""Hypothesis strategies: one tree skeleton, then per-rank values for it.

A skeleton fixes structure, leaf kinds, dtypes and shapes (which must agree on
every replica); values differ by rank and by position and include -0.0, NaN
(with any payload and sign), +-inf, subnormals and integer extremes; 0-d leaves
often coincide (0.0, -0.0, 1.0), and a rank may pass one tensor under two paths.

Leaves are mostly small (at most 27 elements); about one in ten holds a few
hundred bytes to 4 KiB, with values drawn from a seed; and some are exactly a
gather header's 8 bytes (a slot as large as the header, every slot one size,
is a layout of its own: see :func:`skeletons`).
"""

from __future__ import annotations

import os
from collections import namedtuple
from dataclasses import dataclass

import hypothesis.strategies as st
import optree
import torch

# float64 is refused on TPUs (kept as float32 there: docs/reliability.md)
_ON_TPU = os.environ.get("PJRT_DEVICE") == "TPU"
DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int32,
    torch.int64,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
if not _ON_TPU:
    DTYPES.insert(0, torch.float64)
Pair = namedtuple("Pair", ["first", "second"])


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]
    transposed: bool  # the replica holds a non-contiguous (transposed) view


@dataclass(frozen=True)
class ScalarSpec:
    kind: type  # bool, int or float


@st.composite
def _tensor_spec(draw, dtypes, large: int):
    """A tensor leaf's spec; with odds 1 in ``large``, a leaf of 200 bytes to
    4 KiB (1-d, or 2-d of 4 columns); otherwise of up to 3 dims of up to 3
    (a gather header's 8 bytes among them: 2 float32, 1 int64, 4 float16)."""
    dtype = draw(st.sampled_from(dtypes))
    if draw(st.integers(1, large)) == 1:
        nbytes = draw(st.sampled_from([256, 1024, 4096]) | st.integers(200, 4096))
        n = max(4, nbytes // dtype.itemsize)
        shape = draw(st.sampled_from([(n,), (n // 4, 4)]))
    else:
        shape = tuple(draw(st.lists(st.integers(0, 3), min_size=0, max_size=3)))
    return TensorSpec(dtype, shape, draw(st.booleans()) and len(shape) == 2)


def _tensor_specs(dtypes, large: int = 10):
    return _tensor_spec(dtypes, large)


def skeletons(dtypes=DTYPES, scalars=True, max_leaves=8):
    """A tree's skeleton; one in four has every leaf of one spec (one tensor
    dtype and shape: a move whose slots all have one size, often the
    header's 8 bytes, sometimes a few KiB)."""
    leaf = _tensor_specs(dtypes)
    if scalars:
        leaf = leaf | st.builds(ScalarSpec, st.sampled_from([bool, int, float]))

    def extend(children):
        keys = st.text("abcdefgh", min_size=1, max_size=3)
        return (
            st.lists(children, max_size=3)
            | st.lists(children, max_size=3).map(tuple)
            | st.dictionaries(keys, children, max_size=3)
            | st.builds(Pair, children, children)
            | st.just(None)
        )

    mixed = st.recursive(leaf, extend, max_leaves=max_leaves)
    uniform = _tensor_specs(dtypes, large=3).flatmap(
        lambda spec: st.recursive(st.just(spec), extend, max_leaves=max_leaves)
    )
    return st.integers(0, 3).flatmap(lambda k: uniform if k == 0 else mixed)


def is_spec(x) -> bool:
    return isinstance(x, (TensorSpec, ScalarSpec))


def scatterable(skeleton, world_size: int, dim: int):
    """``skeleton`` with each tensor leaf's ``dim`` times ``world_size`` (a
    0-d leaf made 1-d first): every leaf cuts into the replicas' equal parts
    (a reduce-scatter's, an all-to-all's)."""

    def widen(spec):
        if not isinstance(spec, TensorSpec):
            return spec
        shape = list(spec.shape) or [1]
        shape[dim] *= world_size
        return TensorSpec(spec.dtype, tuple(shape), spec.transposed)

    return optree.tree_map(widen, skeleton, is_leaf=is_spec, none_is_leaf=False)


def _float_values(exact: bool):
    if exact:  # small halves: sums and products are exact in every float dtype for W <= 4
        finite = st.integers(-8, 8).map(lambda k: k / 2)
    else:
        finite = st.floats(allow_nan=False, allow_infinity=False, width=16) | st.sampled_from(
            [1e-45, -1e-40, 3.0e38]
        )
    return finite | st.sampled_from([-0.0, float("nan"), float("inf"), float("-inf")])


def _int_values(dtype, exact: bool):
    info = torch.iinfo(dtype)
    if exact:  # no overflow in sums and products of W <= 4 values
        return st.integers(-3, 3) if info.min < 0 else st.integers(0, 3)
    return st.integers(info.min, info.max) | st.sampled_from(
        [info.min, info.max, 0, -1 if info.min < 0 else 1]
    )


# The integer bits of each float dtype: (carrier, exponent all ones, mantissa mask, sign).
_NAN_BITS = {
    torch.float16: (torch.int16, 0x7C00, 0x3FF, 0x8000),
    torch.bfloat16: (torch.int16, 0x7F80, 0x7F, 0x8000),
    torch.float32: (torch.int32, 0x7F800000, 0x7FFFFF, 0x80000000),
    torch.float64: (torch.int64, 0x7FF0000000000000, 0xFFFFFFFFFFFFF, 1 << 63),
}


@st.composite
def _nan_payload(draw, dtype: torch.dtype) -> int:
    """A NaN of ``dtype`` with any sign and payload, as its signed integer bits
    (conversions such as ``torch.rand(...).to(torch.bfloat16)`` of NaN make them)."""
    carrier, exponent, mantissa, sign = _NAN_BITS[dtype]
    bits = exponent | draw(st.integers(1, mantissa)) | (sign if draw(st.booleans()) else 0)
    width = 8 * carrier.itemsize
    return bits - (1 << width) if bits >= 1 << (width - 1) else bits


def _seeded(dtype: torch.dtype, n: int, seed: int, exact: bool) -> torch.Tensor:
    """``n`` values of ``dtype`` from ``seed``, for a large leaf (drawn one by
    one they would exhaust Hypothesis's budget): any bits, or with ``exact``
    the exact strategies' values, -0.0, NaN and infinities included."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        if exact:
            return torch.randint(max(info.min, -3), 4, (n,), generator=g).to(dtype)
        t = torch.randint(info.min, info.max, (n,), generator=g, dtype=dtype)
        at = torch.rand(n, generator=g) < 0.125  # and the extremes
        extremes = torch.tensor([info.min, info.max], dtype=dtype)
        t[at] = extremes[torch.randint(0, 2, (int(at.sum()),), generator=g)]
        return t
    if not exact:  # every bit pattern: NaN payloads, subnormals, infinities
        carrier = _NAN_BITS[dtype][0]
        info = torch.iinfo(carrier)
        return torch.randint(info.min, info.max, (n,), generator=g, dtype=carrier).view(dtype)
    values = torch.randint(-8, 9, (n,), generator=g).double() / 2
    special = torch.tensor([-0.0, float("nan"), float("inf"), float("-inf")], dtype=torch.float64)
    at = torch.rand(n, generator=g) < 0.125
    values[at] = special[torch.randint(0, 4, (int(at.sum()),), generator=g)]
    return values.to(dtype)


def _tensor(draw, spec: TensorSpec, exact: bool) -> torch.Tensor:
    n = 1
    for s in spec.shape:
        n *= s
    if n > 64:
        t = _seeded(spec.dtype, n, draw(st.integers(0, 2**31 - 1)), exact).reshape(spec.shape)
        return t.t().contiguous().t() if spec.transposed else t
    if spec.dtype == torch.bool:
        values = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    elif spec.dtype.is_floating_point:
        # 0-d leaves often coincide (equal values share a device buffer on XLA)
        coincide = st.sampled_from([0.0, -0.0, 1.0]) if not spec.shape else st.nothing()
        values = draw(st.lists(coincide | _float_values(exact), min_size=n, max_size=n))
    else:
        coincide = st.sampled_from([0, 1]) if not spec.shape else st.nothing()
        values = draw(st.lists(coincide | _int_values(spec.dtype, exact), min_size=n, max_size=n))
    t = torch.tensor(values, dtype=torch.float64 if spec.dtype.is_floating_point else None)
    t = t.to(spec.dtype).reshape(spec.shape)
    if spec.dtype in _NAN_BITS and n and draw(st.booleans()):  # NaNs with payloads
        bits = t.reshape(-1).view(_NAN_BITS[spec.dtype][0])
        for at in draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n)):
            bits[at] = draw(_nan_payload(spec.dtype))
    if spec.transposed:  # same shape, non-contiguous storage
        t = t.t().contiguous().t()
    elif n == 1 and spec.shape and draw(st.booleans()):
        # one element of stride 0, as the gradient of out.sum() is where out
        # has one element (torch counts it contiguous, but will not view it
        # as bytes)
        t = t.reshape(()).expand(spec.shape)
    return t


def _scalar(draw, spec: ScalarSpec, exact: bool):
    if spec.kind is bool:
        return draw(st.booleans())
    if spec.kind is int:
        return draw(st.integers(-1000, 1000) if exact else st.integers(-(2**63), 2**63 - 1))
    return draw(_float_values(exact).map(float) if exact else st.floats(width=64))


@st.composite
def rank_trees(draw, skeleton, world_size: int, exact: bool = False, reorder: bool = True):
    """``world_size`` trees with the skeleton's structure and per-rank values;
    with ``reorder``, odd ranks build their dicts in the opposite key order."""

    def fill(spec):
        return (
            _tensor(draw, spec, exact)
            if isinstance(spec, TensorSpec)
            else _scalar(draw, spec, exact)
        )

    trees = [
        optree.tree_map(fill, skeleton, is_leaf=is_spec, none_is_leaf=False)
        for _ in range(world_size)
    ]
    specs = optree.tree_leaves(skeleton, is_leaf=is_spec, none_is_leaf=False)
    trees = [_alias(draw, t, specs) for t in trees]
    return [_reverse_dicts(t) if reorder and r % 2 else t for r, t in enumerate(trees)]


def _alias(draw, tree, specs):
    """Maybe the same tensor object under two paths (as a user may pass one
    tensor twice), on this rank only: a later leaf of the same spec becomes an
    earlier one."""
    if not draw(st.booleans()):
        return tree
    leaves, treespec = optree.tree_flatten(tree, none_is_leaf=False)
    for j, spec in enumerate(specs):
        # (not a transposed one: the replica's view of it is pending computation,
        # and a pending tensor passed twice on one rank only is the caller's trap)
        if isinstance(spec, TensorSpec) and not spec.transposed:
            earlier = [i for i in range(j) if specs[i] == spec]
            if earlier and draw(st.booleans()):
                leaves[j] = leaves[draw(st.sampled_from(earlier))]
    return optree.tree_unflatten(treespec, leaves)


def _reverse_dicts(tree):
    if isinstance(tree, dict):
        return {k: _reverse_dicts(tree[k]) for k in reversed(list(tree))}
    if isinstance(tree, Pair):
        return Pair(*map(_reverse_dicts, tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(map(_reverse_dicts, tree))
    return tree
