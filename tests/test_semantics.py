"""Documented semantics that once failed, on every world: half-precision means
rounded once, trees keyed by objects, outputs that never require grad, and
errors that come before any communication, name the path and reach every
replica. Reduce's documented edge cases (signed zeros, NaN) bit for bit."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

import xcoll
from tests.helpers import PROPERTY, assert_trees, same_bits
from tests.replicas import device, to_cpu, to_device

# ---- half-precision means ----------------------------------------------------


def _reduce(args):
    tree, op = args
    return to_cpu(xcoll.reduce(to_device(tree, device()), op))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_mean_does_not_overflow_where_the_sum_would(pool, dtype):
    big = torch.tensor([60000.0, -60000.0, 1.0], dtype=dtype)
    for out in pool.run(_reduce, [({"x": big}, "mean")] * pool.world_size):
        assert same_bits(out["x"], big), out


@st.composite
def _half_means(draw, world):
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16]), "dtype")
    # Two regimes whose float32 sums are exact (so the rule "sum in float32, divide
    # in float32, round once" has one answer): large multiples of 32, or tiny
    # multiples of 2**-24 (subnormal in float16, where rounding twice differs).
    step, top = draw(st.sampled_from([(32.0, 2040), (2.0**-24, 2**14)]), "regime")
    n = draw(st.integers(1, 12), "n")
    ks = st.lists(st.integers(-top, top), min_size=n, max_size=n)
    values = [torch.tensor(draw(ks), dtype=torch.float64) * step for _ in range(world)]
    return dtype, [v.to(dtype) for v in values]


@PROPERTY
@given(data=st.data())
def test_half_means_are_rounded_once(pool, data):
    dtype, values = data.draw(_half_means(pool.world_size))
    outs = pool.run(_reduce, [({"x": v}, "mean") for v in values])
    exact = sum(v.double() for v in values) / pool.world_size
    expected = exact.to(dtype)  # W is a power of two: float32 holds the exact quotient
    for out in outs:
        assert same_bits(out["x"], expected), (values, out["x"], expected)


# ---- reduce's edge cases, bit for bit ------------------------------------------

_NAN = float("nan")


def _edge_trees(w):
    """Per rank: values whose documented results are exact bit patterns."""
    trees = []
    for r in range(w):
        trees.append(
            {
                "negzero": torch.tensor([-0.0, -0.0, 0.0]),
                "nan": torch.tensor([_NAN, 1.0]).neg() if r == 0 else torch.tensor([2.0, 3.0]),
                "payload": torch.tensor([0x7FC1, -1], dtype=torch.int16).view(torch.bfloat16),
                "half": torch.tensor([-0.0, 1.0], dtype=torch.float16),
                "py": -0.0,
            }
        )
    return trees


def _expected_edges(op, w):
    nan, pos = float("nan"), 0.0
    if op == "sum":
        return {
            "negzero": torch.tensor([pos, pos, pos]),
            "nan": torch.tensor([nan, -1.0 + 3.0 * (w - 1)]),
            "payload": torch.tensor([nan, nan], dtype=torch.bfloat16),
            "half": torch.tensor([pos, float(w)], dtype=torch.float16),
            "py": pos,
        }
    if op == "max":
        return {
            "negzero": torch.tensor([-0.0, -0.0, 0.0]),
            "nan": torch.tensor([nan, 3.0 if w > 1 else -1.0]),
            "payload": torch.tensor([nan, nan], dtype=torch.bfloat16),
            "half": torch.tensor([-0.0, 1.0], dtype=torch.float16),
            "py": -0.0,
        }
    raise AssertionError(op)


@pytest.mark.parametrize("op", ["sum", "max"])
def test_reduce_edge_cases_bit_for_bit(pool, op):
    w = pool.world_size
    outs = pool.run(_reduce, [(t, op) for t in _edge_trees(w)])
    expected = _expected_edges(op, w)
    for out in outs:
        # NaN results are the quiet NaN float("nan"), whatever went in
        assert_trees(out, expected, same_bits, op)


def _mixed_ints(args):
    r, op = args
    tree = {
        "u8": torch.tensor([(100 + 100 * r) % 256, 7 * r], dtype=torch.uint8),
        "i8": torch.tensor([-100 + 50 * r, 3], dtype=torch.int8),
    }
    return tree, _reduce((tree, op))


@pytest.mark.parametrize("op", ["max", "min"])
def test_uint8_and_int8_leaves_keep_their_own_order(pool, op):
    # (of one width, neither dtype holds the other's values: merged into
    # one bucket, 200 as an int8 is -56, and the max of 100 and 200 is 100)
    runs = pool.run(_mixed_ints, [(r, op) for r in range(pool.world_size)])
    trees = [tree for tree, _ in runs]
    fold = torch.amax if op == "max" else torch.amin
    expected = {k: fold(torch.stack([t[k] for t in trees]), dim=0) for k in trees[0]}
    for _, out in runs:
        assert_trees(out, expected, same_bits, op)


# ---- trees keyed by objects ------------------------------------------------------


def _key_function():
    """A dict key whose repr holds its address, which differs between processes."""


class _Key:
    """A dict key without __repr__: its default repr holds its address."""

    def __eq__(self, other):
        return isinstance(other, _Key)

    def __hash__(self):
        return 1


def _keyed_by_objects(r):
    tree = {_key_function: torch.tensor([float(r)]), "n": r}
    with xcoll.consistency_checks("always"):
        first = xcoll.gather(to_device(tree, device()), to_cpu=True)
        again = xcoll.reduce(to_device({_Key(): torch.tensor([1.0])}, device()))
    return first[_key_function], first["n"], list(again.values())[0].cpu()


def test_trees_keyed_by_objects_pass_the_check(pool):
    w = pool.world_size
    for x, n, total in pool.run(_keyed_by_objects, list(range(w))):
        assert x.tolist() == [float(r) for r in range(w)] and n == list(range(w))
        assert total.tolist() == [float(w)]


# ---- requires_grad -----------------------------------------------------------------


def _grads(_):
    dev = device()
    x = torch.tensor([1.0, 2.0]).to(dev).requires_grad_()
    tree = {"x": x, "y": x * 2}
    outs = {
        "gather": xcoll.gather(tree),
        "stack": xcoll.gather(tree, stack=True, dim=1),
        "to_cpu": xcoll.gather(tree, to_cpu=True),
        "sum": xcoll.reduce(tree),
        "mean": xcoll.reduce(tree, "mean"),
        "max": xcoll.reduce(tree, "max"),
        "broadcast": xcoll.broadcast(tree),
        "uneven": xcoll.gather(tree, uneven=True),
        "max_size": xcoll.gather(tree, max_size=4),
    }
    return {k: [(t.requires_grad, t.grad_fn is None) for t in o.values()] for k, o in outs.items()}


def test_outputs_never_require_grad(pool):
    for report in pool.run(_grads, [None] * pool.world_size):
        for name, flags in report.items():
            assert flags == [(False, True)] * 2, (name, flags)


def _transposed(r: int, dev=None) -> torch.Tensor:
    """Rank ``r``'s leaf: a contiguous tensor's transposed view (non-contiguous)."""
    return (torch.arange(6.0).reshape(3, 2) + r).to(dev).t()


def _contiguity(_=None):
    x = _transposed(xcoll.rank(), device())
    outs = {
        "gather": xcoll.gather({"x": x}),
        "reduce": xcoll.reduce({"x": x}),
        "broadcast": xcoll.broadcast({"x": x}),
        "gather to_cpu": xcoll.gather({"x": x}, to_cpu=True),
    }
    return {k: (o["x"].is_contiguous(), o["x"].cpu()) for k, o in outs.items()}


def test_outputs_are_contiguous_whatever_the_inputs_strides(pool):
    # (in a world of one too, where each output is its leaf's own copy)
    w = pool.world_size
    every = [_transposed(r) for r in range(w)]
    want = {
        "gather": torch.cat(every),
        "reduce": sum(every[1:], every[0]),
        "broadcast": every[0],
        "gather to_cpu": torch.cat(every),
    }
    for report in pool.run(_contiguity, [None] * w):
        for k, (contiguous, got) in report.items():
            assert contiguous and torch.equal(got, want[k]), (k, contiguous, got)


# ---- errors before any communication, named, on every replica --------------------


def _deep():
    node = root = []
    for _ in range(1500):
        child = []
        node.append(child)
        node = child
    return {"ok": 1.0, "deep": root}


def _bad_input(args):
    case, bad = args
    dev = device()
    good = {"ok": torch.ones(2).to(dev)}
    with xcoll.consistency_checks("always"):
        if not bad:
            return xcoll.gather(good, to_cpu=True)["ok"]
        if case == "nested":
            nested = torch.nested.nested_tensor([torch.ones(2)])
            return xcoll.gather({"ok": 1.0, "nt": nested}, to_cpu=True)
        if case == "meta":
            return xcoll.gather({"ok": 1.0, "m": torch.ones(2, device="meta")}, to_cpu=True)
        if case == "dim":
            return xcoll.gather(good, dim=1.0, to_cpu=True)
        if case == "deep":
            return xcoll.gather(_deep(), to_cpu=True)
    raise AssertionError(case)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize(
    "case, kind, named",
    [
        ("nested", "TypeError", "tree['nt']: nested tensors"),
        ("meta", "TypeError", "tree['m']: a meta tensor"),
        ("dim", "TypeError", "dim must be an int"),
        ("deep", "ValueError", "tree['deep'][0][0][0]"),
    ],
)
def test_bad_input_raises_before_communicating_on_every_replica(pool, case, kind, named):
    w = pool.world_size
    failures = pool.run(
        _bad_input, [(case, r == 0) for r in range(w)], return_exceptions=True, timeout=120
    )
    assert failures[0].type_name == f"builtins.{kind}", failures[0]
    assert named in failures[0].message
    for f in failures[1:]:  # the others quote it instead of waiting for rank 0
        assert f.type_name == "xcoll.CollectiveMismatchError", f
        assert named in f.message and "rank 0" in f.message
    again = pool.run(_bad_input, [(case, False)] * w)  # the replicas go on
    assert all(t.tolist() == [1.0, 1.0] * w for t in again)


# ---- one program on every replica, whatever the leaves' values and aliasing ------


def _values_that_coincide(case):
    kind, r = case
    dev = device()
    if kind == "0-d uploads":  # 1.0 on rank 0 is torch_xla's cached scalar 1.0
        out = xcoll.reduce({"x": torch.tensor(float(r) + 1).to(dev)})
        return out["x"].cpu()
    if kind == "a natural metric":  # rank 0's count equals its seen, rank 1's does not
        correct = torch.tensor(5.0).to(dev)
        seen = torch.tensor(5.0 if r == 0 else 8.0).to(dev)
        out = xcoll.reduce({"correct": correct, "seen": seen})
        return torch.stack([out["correct"].cpu(), out["seen"].cpu()])
    if kind == "one tensor twice":  # under two keys on rank 0 only, even with the check
        t = torch.arange(3.0).to(dev)
        tree = {"a": t, "b": t if r == 0 else torch.arange(3.0).to(dev)}
        with xcoll.consistency_checks("always"):
            out = xcoll.gather(tree, to_cpu=True)
        return torch.cat([out["a"], out["b"]])
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["0-d uploads", "a natural metric", "one tensor twice"])
def test_values_and_aliases_never_change_the_program(pool, kind):
    w = pool.world_size
    results = pool.run(_values_that_coincide, [(kind, r) for r in range(w)], timeout=120)
    expected = {
        "0-d uploads": torch.tensor(float(sum(range(1, w + 1)))),
        "a natural metric": torch.tensor([5.0 * w, 5.0 + 8.0 * (w - 1)]),
        "one tensor twice": torch.arange(3.0).repeat(2 * w),
    }[kind]
    for got in results:
        assert torch.equal(got, expected), (got, expected)


_SAME_PROGRAM = """
import math, torch, torch_xla, xcoll
dev = torch_xla.device()
up = lambda v: torch.tensor(v).to(dev)  # a user's 0-d upload
base = torch.arange(3.0).to(dev)

def trees():
    for a, b in [(0.0, 0.0), (-0.0, 0.0), (1.0, 1.0), (2.0, 3.0), (math.nan, 1.0), (1.0, 0.0)]:
        yield {"a": up(a), "b": up(b), "t": torch.arange(3.0).to(dev), "u": base}
    yield {"a": up(2.0), "b": up(2.0), "t": base, "u": base}             # one tensor twice
    yield {"a": up(2.0), "b": up(5.0), "t": base.detach(), "u": base}    # one buffer twice

for name, call in [
    ("gather", lambda t: xcoll.gather(t, sync=False)),
    ("sum", lambda t: xcoll.reduce(t, sync=False)),
    ("mean", lambda t: xcoll.reduce(t, "mean", sync=False)),
    ("max", lambda t: xcoll.reduce(t, "max", sync=False)),
    ("broadcast", lambda t: xcoll.broadcast(t, sync=False)),
]:
    programs = set()
    for tree in trees():
        out = call(tree)
        programs.add(torch_xla._XLAC._get_xla_tensors_hlo(list(out.values())))
        xcoll.sync()
    assert len(programs) == 1, (name, len(programs))
print("ok")
"""


def test_one_program_whatever_the_values_under_default_settings():
    # torch_xla's defaults (special scalars on), one replica, in a fresh process:
    # the traced program of each call must not depend on the values or aliasing
    pytest.importorskip("torch_xla")
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "PJRT_", "CPU_"))}
    env["PJRT_DEVICE"] = "CPU"
    result = subprocess.run(
        [sys.executable, "-c", _SAME_PROGRAM], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
