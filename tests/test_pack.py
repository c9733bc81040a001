"""The packing plan (xcoll._encode.pack), in-process: where each leaf lies in its
bucket's buffer, and where each bucket lies in a move's one buffer."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import example, given, settings

from xcoll._encode import pack as _pack

_DTYPES = [torch.float32, torch.float16, torch.int64, torch.int8, torch.bool]


@st.composite
def _leaves(draw):
    """Leaves (tensors of a few dtypes and shapes, Python scalars), each with
    a bucket key; a bucket's dtype is that of its first leaf's key."""
    n = draw(st.integers(0, 10), "leaves")
    keys = draw(st.lists(st.sampled_from("abc"), min_size=n, max_size=n), "keys")
    key_dtype = {k: draw(st.sampled_from(_DTYPES), f"dtype of {k}") for k in "abc"}
    leaves = []
    for _ in range(n):
        if draw(st.integers(0, 3)) == 0:
            leaves.append(draw(st.sampled_from([1.5, 2, True])))
        else:
            shape = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
            leaves.append(torch.zeros(shape, dtype=draw(st.sampled_from(_DTYPES))))
    first = frozenset(draw(st.sets(st.integers(0, max(n - 1, 0)))) if n else set())
    return leaves, keys, [key_dtype[k] for k in keys], first


@settings(deadline=None)
@example(case=([1.5, 2, torch.zeros(2), torch.zeros(2)], ["a"] * 4, [torch.float32] * 4, {1, 3}))
@given(case=_leaves())
def test_a_plan_lays_out_each_bucket_as_documented(case):
    """Buckets in order of their keys' first appearance. In each, the tensor
    leaves by dtype (the bucket's own first, the others by name), then by
    whether they are in ``first`` (those first), size, shape and position;
    then its Python scalars, those in ``first`` first; each slot right after
    the one before, a tensor's own dtype noted where it is not the bucket's."""
    leaves, keys, dtypes, first = case
    buckets = _pack.plan(leaves, keys, dtypes, first)
    assert [b.key for b in buckets] == list(dict.fromkeys(keys))
    for b in buckets:
        mine = [i for i, k in enumerate(keys) if k == b.key]
        assert b.dtype == dtypes[mine[0]]
        tensors = [i for i in mine if isinstance(leaves[i], torch.Tensor)]

        def order(i, b=b):
            t = leaves[i]
            cast = "" if t.dtype == b.dtype else str(t.dtype)
            return cast, i not in first, t.numel(), tuple(t.shape), i

        scalars = [i for i in mine if i not in tensors]
        expected = sorted(tensors, key=order)
        assert [s.leaf for s in b.tensors] == expected
        assert [s.leaf for s in b.scalars] == sorted(scalars, key=lambda i: i not in first)
        at = 0
        for s in b.tensors + b.scalars:
            assert s.offset == at
            leaf = leaves[s.leaf]
            if isinstance(leaf, torch.Tensor):
                assert s.shape == tuple(leaf.shape)
                assert s.dtype == (None if leaf.dtype == b.dtype else leaf.dtype)
            else:
                assert s.shape == () and s.dtype is None
            at += s.numel
        assert b.size == at
        assert b.sizes == [s.numel for s in b.tensors] + ([len(b.scalars)] if b.scalars else [])
        assert b.casts == tuple(s.dtype for s in b.tensors) + ((None,) if b.scalars else ())


@settings(deadline=None)
@given(sizes=st.lists(st.integers(0, 3), max_size=12))
def test_runs_are_the_maximal_runs_of_equal_sizes(sizes):
    spans = _pack.runs(sizes)
    assert [n for _, k, n in spans for _ in range(k)] == sizes
    assert all(a[2] != b[2] for a, b in zip(spans, spans[1:], strict=False))  # maximal
    at = 0
    for offset, k, n in spans:
        assert offset == at
        at += k * n


@settings(deadline=None)
@given(
    dtypes=st.lists(st.sampled_from(_DTYPES), max_size=4),
    guard=st.sampled_from([0, 4, 64]),
    data=st.data(),
)
def test_a_joined_buffer_puts_the_header_first_then_buckets_by_element_size(dtypes, guard, data):
    """The header (int32, if any), then the buckets by descending element
    size, in their order otherwise; each segment padded with zero bytes to a
    multiple of 8; ``order`` names each bucket's position among the live ones."""
    shapes = [
        data.draw(
            st.lists(st.lists(st.integers(0, 3), max_size=2).map(tuple), min_size=1, max_size=3)
        )
        for _ in dtypes
    ]
    positions = data.draw(st.permutations(range(10)))[: len(dtypes)]
    joined = _pack.Joined.of(dtypes, shapes, guard, positions)
    by_size = sorted(range(len(dtypes)), key=lambda k: -dtypes[k].itemsize)
    assert joined.order == tuple(positions[k] for k in by_size)
    head = [torch.int32] if guard else []
    assert list(joined.dtypes) == head + [dtypes[k] for k in by_size]
    assert list(joined.shapes) == ([((guard,),)] if guard else []) + [
        tuple(shapes[k]) for k in by_size
    ]
    assert _pack.Joined.of(dtypes, shapes, guard).order == tuple(by_size)
    for d, sizes, n, padded in zip(
        joined.dtypes, joined.sizes, joined.nbytes, joined.padded, strict=True
    ):
        assert n == sum(sizes) * d.itemsize and padded % 8 == 0 and 0 <= padded - n < 8
    assert joined.words * 4 == sum(joined.padded)


# Around torch's grain (32768 elements), where fill stops copying parts together
_SIZES = [0, 1, 7, 100, 32767, 32768, 32769, 40000]


@settings(deadline=None)
@given(
    sizes=st.lists(st.sampled_from(_SIZES), min_size=1, max_size=6), dtype=st.sampled_from(_DTYPES)
)
def test_concat_copies_every_part_in_order_whatever_its_size(sizes, dtype):
    """Parts copied together up to torch's grain and a larger part alone
    (:func:`xcoll._encode.pack.fill`): the concatenation of them all, whatever the sizes."""
    g = torch.Generator().manual_seed(len(sizes))
    parts = [(torch.randint(0, 100, (n,), generator=g)).to(dtype) for n in sizes]
    parts = [
        p.reshape(2, -1) if p.numel() % 2 == 0 and p.numel() else p for p in parts
    ]  # any shape
    got = _pack.concat(parts)
    assert got.dtype == dtype and torch.equal(got, torch.cat([p.reshape(-1) for p in parts]))
    out = torch.full((sum(sizes),), 1, dtype=dtype)
    _pack.fill(out, parts)
    assert torch.equal(out, got)


def test_cat_bytes_copies_each_part_and_resolves_a_negative_view():
    # a segment of one part is a view of it until the cat: never an alias;
    # a leaf with torch's negative bit set (torch._neg_view) cannot be viewed
    # as bytes, and travels as its values
    neg = torch._neg_view(torch.tensor([1.5, -2.0, 0.0]))
    ints = torch.tensor([7, -3], dtype=torch.int32)
    out = _pack.cat_bytes([[neg], [ints]], [12, 8], [16, 8])
    assert out.dtype == torch.uint8 and out.shape == (24,)
    assert torch.equal(out[:12].view(torch.float32), torch.tensor([-1.5, 2.0, -0.0]))
    assert torch.equal(out[12:16], torch.zeros(4, dtype=torch.uint8))  # the padding
    assert torch.equal(out[16:].view(torch.int32), ints)
    out[16:].view(torch.int32).zero_()
    assert ints.tolist() == [7, -3]  # a copy, not a view of the part
    # one element of stride 0 (an expanded 0-d tensor: the gradient of
    # ``out.sum()`` where ``out`` has one element), which torch will not view
    # as bytes, alone and negative
    one = torch.tensor(2.5).expand(1)
    for part, want in ((one, 2.5), (torch._neg_view(one), -2.5)):
        out = _pack.cat_bytes([[part]], [4], [8])
        assert torch.equal(out[:4].view(torch.float32), torch.tensor([want])), part


@pytest.mark.parametrize(
    "leaf",
    [
        True,
        -(2**63),
        2**40 + 3,
        -0.0,
        float("nan"),
        torch.tensor(7),
        torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        torch.arange(6, dtype=torch.int64).reshape(2, 3),
        torch.tensor([True, False]),
    ],
)
def test_a_leaf_round_trips_through_its_bytes_bit_for_bit(leaf):
    data = _pack.leaf_bytes(leaf)
    assert data.dtype == torch.uint8 and data.dim() == 1
    # (arriving at an odd offset of a larger buffer, as a collective's output does)
    got = _pack.from_leaf_bytes(torch.cat([torch.zeros(3, dtype=torch.uint8), data])[3:], leaf)
    if isinstance(leaf, torch.Tensor):
        assert got.dtype == leaf.dtype and got.shape == leaf.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), leaf.reshape(-1).view(torch.uint8))
    else:
        assert type(got) is type(leaf) and repr(got) == repr(leaf)  # (-0.0 and nan too)
