"""Hypothesis strategies: one tree skeleton, then per-rank values for it.

A skeleton fixes structure, leaf kinds, dtypes and shapes (which must agree on
every replica); values differ by rank and by position and include -0.0, NaN,
+-inf, subnormals and integer extremes.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import hypothesis.strategies as st
import optree
import torch

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]
Pair = namedtuple("Pair", ["first", "second"])


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]
    transposed: bool  # the replica holds a non-contiguous (transposed) view


@dataclass(frozen=True)
class ScalarSpec:
    kind: type  # bool, int or float


def _tensor_specs(dtypes):
    def build(dtype, shape, transposed):
        return TensorSpec(dtype, shape, transposed and len(shape) == 2)

    shapes = st.lists(st.integers(0, 3), min_size=0, max_size=3).map(tuple)
    return st.builds(build, st.sampled_from(dtypes), shapes, st.booleans())


def skeletons(dtypes=DTYPES, scalars=True, max_leaves=8):
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

    return st.recursive(leaf, extend, max_leaves=max_leaves)


def is_spec(x) -> bool:
    return isinstance(x, (TensorSpec, ScalarSpec))


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


def _tensor(draw, spec: TensorSpec, exact: bool) -> torch.Tensor:
    n = 1
    for s in spec.shape:
        n *= s
    if spec.dtype == torch.bool:
        values = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    elif spec.dtype.is_floating_point:
        values = draw(st.lists(_float_values(exact), min_size=n, max_size=n))
    else:
        values = draw(st.lists(_int_values(spec.dtype, exact), min_size=n, max_size=n))
    t = torch.tensor(values, dtype=torch.float64 if spec.dtype.is_floating_point else None)
    t = t.to(spec.dtype).reshape(spec.shape)
    if spec.transposed:  # same shape, non-contiguous storage
        t = t.t().contiguous().t()
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
    return [_reverse_dicts(t) if reorder and r % 2 else t for r, t in enumerate(trees)]


def _reverse_dicts(tree):
    if isinstance(tree, dict):
        return {k: _reverse_dicts(tree[k]) for k in reversed(list(tree))}
    if isinstance(tree, Pair):
        return Pair(*map(_reverse_dicts, tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(map(_reverse_dicts, tree))
    return tree
