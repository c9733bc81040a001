"""Python ints reduce as Python computes them: a sum exactly (it may exceed
int64: the result is a Python int), a product exactly or with an
OverflowError on every replica, max and min exactly; never a wrapped value.
Int tensors in the same call keep their dtype's wrap, and merge into the
Python ints' int64 bucket as before (docs/design.md, "Semantics").

Each test below failed before Python ints travelled as limbs: the sums
wrapped to -2**63 at W=2 and to 0 at W=4, the products to -2**63 and 0."""

from __future__ import annotations

import pytest
import torch

import xcoll
from tests.helpers import assert_trees, same_bits
from tests.replicas import device, shared_pool, to_cpu, to_device
from xcoll._base import tree as _tree_mod
from xcoll._core import ops as _ops

# W=2 and W=4 on gloo and on XLA:CPU, and a world of one
WORLDS = ["local-1", "gloo-2", "gloo-4", "xla-cpu-2", "xla-cpu-4"]


@pytest.fixture(scope="module", params=WORLDS)
def pool(request):
    return shared_pool(request.param)


# ---- as a user writes it ------------------------------------------------------


def _seen(args):
    r, host = args
    loss = torch.tensor(0.5 * (r + 1)).to(device())
    out = xcoll.reduce({"seen": 2**62, "loss": loss}, to_cpu=host)
    return type(out["seen"]), out["seen"], to_cpu(out["loss"])


@pytest.mark.parametrize("host", [False, True], ids=["device", "to_cpu"])
def test_a_python_int_count_sums_exactly(pool, host):
    w = pool.world_size
    for kind, seen, loss in pool.run(_seen, [(r, host) for r in range(w)]):
        assert kind is int and seen == 2**62 * w, seen
        assert loss.item() == sum(0.5 * (r + 1) for r in range(w)), loss


# ---- mixed with int tensors of every width (one merged int64 bucket) -----------


def _tree(r: int) -> dict:
    return {
        "top": 2**63 - 1 - r,  # sums above int64
        "bottom": -(2**63) + r,  # and below
        "minus_one": -1,  # hi limb -1, lo limb 2**32 - 1
        "split": -(2**40) * (r + 1) + 0xFFFFFFFF,  # both limbs matter
        "small": 3 * r,
        "zero": 0,
        "f": 0.25,
        "i64": torch.tensor([2**63 - 1, -(2**63), r], dtype=torch.int64),
        "i32": torch.tensor([2**31 - 1, -r], dtype=torch.int32),
        "i16": torch.tensor([-(2**15), 7], dtype=torch.int16),
        "i8": torch.tensor([127, -128], dtype=torch.int8),
        "u8": torch.tensor([255, r], dtype=torch.uint8),
        "loss": torch.tensor([0.5, -r]),
    }


def _fold(values, combine):
    acc = values[0]
    for v in values[1:]:
        acc = combine(acc, v)
    return acc


def _expected(trees: list[dict]) -> dict:
    """Python ints summed as Python sums them; tensors as their dtype wraps."""
    out = {}
    for k, like in trees[0].items():
        values = [t[k] for t in trees]
        if isinstance(like, torch.Tensor):
            out[k] = _fold(values, lambda a, b: a + b)  # (torch's integer add wraps)
        else:
            out[k] = type(like)(sum(values))
    return out


def _mixed(args):
    tree, host = args
    out = xcoll.reduce(to_device(tree, device()), to_cpu=host)
    return {k: v if isinstance(v, (int, float)) else to_cpu(v) for k, v in out.items()}


@pytest.mark.parametrize("host", [False, True], ids=["device", "to_cpu"])
def test_python_int_sums_are_exact_beside_int_tensors_that_wrap(pool, host):
    w = pool.world_size
    trees = [_tree(r) for r in range(w)]
    expected = _expected(trees)
    assert expected["top"] > 2**63 - 1 or w == 1  # (the sums leave int64)
    for out in pool.run(_mixed, [(t, host) for t in trees]):
        assert all(type(out[k]) is type(expected[k]) for k in expected), out
        assert_trees(out, expected, same_bits, "sum")


def test_the_limbs_travel_in_the_int64_bucket_the_int_tensors_merge_into():
    """Decided once per signature: one int64 sum bucket holds the int tensors
    of every width (merged, as before) and each Python int as two limbs; a
    Python float takes one element, as any float does (a Python int against
    a float at one path: small calls meet in one size class, the guard names it)."""
    plan = _ops.Reduce("sum").plan(_tree_mod.flatten(_tree(0)), 4)
    ints, floats, f32 = plan.buckets
    assert [b.key for b in plan.buckets] == [
        (torch.int64, "sum"),
        (torch.float64, "sum"),
        (torch.float32, "sum"),
    ]
    merged = {torch.int32, torch.int16, torch.int8, torch.uint8}  # (and int64, its own: None)
    assert {s.dtype for s in ints.tensors} == {None} | merged
    assert ints.exact == "sum" and [s.shape for s in ints.scalars] == [(2,)] * 6
    assert ints.size == 3 + 2 * 4 + 2 * 6 and ints.part_shapes[-1] == (12,)
    assert floats.size == 1 and f32.size == 2
    assert _ops.Reduce({"a": "max"}).plan(_tree_mod.flatten({"a": 5}), 4).buckets[0].size == 1


# ---- an op tree: sums, products, max and min of Python ints in one call ---------

_OPS = {"n": "sum", "neg": "sum", "p": "prod", "q": "prod", "z": "prod", "hi": "max", "lo": "min"}


def _ops_tree(r: int, w: int) -> dict:
    return {
        "n": 2**62 + r,
        "neg": -(2**62) - r,
        # 2**62 * 2 * 1 * 1 = 2**63: above int64, exact
        "p": 2**62 if r == 0 else 2 if r == 1 else 1,
        # -(2**62) * 2 * (-1) * (-1) = -2**63 at W=2 and W=4: the bottom of int64
        "q": -(2**62) if r == 0 else 2 if r == 1 else -1,
        # a zero factor makes the product 0 whatever the others' sizes
        "z": 0 if r == w - 1 else 2**62,
        "hi": 2**63 - 1 - r,
        "lo": -(2**63) + r,
        "t": torch.tensor([r + 1, -2], dtype=torch.int32),  # (a prod bucket's tensor)
    }


def _with_ops(args):
    tree, host = args
    ops = {**_OPS, "t": "prod"}
    out = xcoll.reduce(to_device(tree, device()), ops, to_cpu=host)
    return {k: v if isinstance(v, int) else to_cpu(v) for k, v in out.items()}


@pytest.mark.parametrize("host", [False, True], ids=["device", "to_cpu"])
def test_python_int_products_and_extremes_are_exact(pool, host):
    w = pool.world_size
    trees = [_ops_tree(r, w) for r in range(w)]
    expected = {
        "n": sum(2**62 + r for r in range(w)),
        "neg": -sum(2**62 + r for r in range(w)),
        "p": 2**63 if w > 1 else 2**62,
        "q": -(2**63) if w > 1 else -(2**62),
        "z": 0,
        "hi": 2**63 - 1,
        "lo": -(2**63),
        "t": _fold([t["t"] for t in trees], lambda a, b: a * b),
    }
    for out in pool.run(_with_ops, [(t, host) for t in trees]):
        assert all(type(out[k]) is type(expected[k]) for k in expected), out
        assert_trees(out, expected, same_bits, "ops")


# ---- a product that may not fit: OverflowError on every replica ----------------


def _overflow(args):
    r, host = args
    dev = device()
    big = {"ok": torch.ones(2).to(dev), "counts": [3, 2**62 - r]}
    try:
        xcoll.reduce(big, "prod", to_cpu=host)
    except OverflowError as e:
        error = str(e)
    else:
        error = None
    after = xcoll.reduce({"n": 2**62, "t": torch.ones(1).to(dev)})  # the replicas go on
    return error, after["n"]


@pytest.mark.parametrize("host", [False, True], ids=["device", "to_cpu"])
def test_a_python_int_product_that_may_not_fit_raises_on_every_replica(pool, host):
    w = pool.world_size
    results = pool.run(_overflow, [(r, host) for r in range(w)], timeout=120)
    for error, after in results:
        if w == 1:  # (a product of one value is that value)
            assert error is None
        else:
            assert error is not None, "returned a wrapped product"
            assert error == (
                "tree['counts'][1]: the product of the replicas' Python ints may not fit "
                "in int64 (their magnitudes, each rounded up to a power of two, multiply "
                "past 2**63), and xcoll returns no wrapped value; reduce a tensor instead "
                "(torch.tensor(v): its product wraps as int64 does), or multiply the values "
                "of xcoll.gather(v) in Python"
            ), error
        assert after == 2**62 * w
