"""Property tests of gather / reduce / broadcast / reduce_scatter / all_to_all
on real replicas.

Each example is drawn here, run on every replica of the pool at once, and its
results are checked here against what the per-rank inputs say they must be.
"""

from __future__ import annotations

import hypothesis.strategies as st
import optree
import pytest
import torch
from hypothesis import given

import xcoll
from tests import strategies as S
from tests.helpers import PROPERTY, assert_trees, leaves, same_bits, same_values
from tests.replicas import device, devices, to_cpu, to_device

# ---- replica side -----------------------------------------------------------


def _flip(tree):
    """Changes every bit pattern of every tensor leaf in place."""
    for t in leaves(tree):
        if isinstance(t, torch.Tensor):
            if t.dtype == torch.bool:
                t.logical_not_()
            elif t.dtype.is_floating_point:
                t.neg_()
            else:
                t.bitwise_not_()


def _call(args):
    """Runs ``xcoll.<name>(tree, ...)`` on this replica and reports what a test needs."""
    name, tree, kwargs, extra = args
    dev = device()
    x = to_device(tree, dev)
    out = getattr(xcoll, name)(x, **kwargs)
    report = {
        "out": to_cpu(out),
        "devices": devices(out),
        "rank": xcoll.rank(),
        "world": xcoll.world_size(),
    }
    if extra == "stacked":
        report["stacked"] = to_cpu(xcoll.gather(x, stack=True))
    report["inputs_after"] = to_cpu(x)
    _flip(out)  # if any output aliased an input, the input would change
    xcoll.sync()
    report["inputs_after_writes"] = to_cpu(x)
    return report


def _run(pool, name, trees, kwargs, extra=None, same=True):
    reports = pool.run(_call, [(name, t, kwargs, extra) for t in trees])
    for r, (rep, tree) in enumerate(zip(reports, trees, strict=True)):
        assert rep["rank"] == r and rep["world"] == pool.world_size
        assert_trees(rep["inputs_after"], tree, same_bits, "input mutated")
        assert_trees(rep["inputs_after_writes"], tree, same_bits, "output aliases input")
        if same:  # (every replica's result is the same)
            assert_trees(rep["out"], reports[0]["out"], same_bits, f"rank {r} differs from rank 0")
    return reports


def _expected_devices(pool, kwargs):
    return "cpu" if kwargs.get("to_cpu") else pool.device_type


def _draw_trees(data, world_size):
    skeleton = data.draw(S.skeletons(), "skeleton")
    return data.draw(S.rank_trees(skeleton, world_size), "trees")


# ---- gather -----------------------------------------------------------------


def _gathered(values, like, dim, stack):
    if not isinstance(like, torch.Tensor):
        return list(values)
    if like.dim() == 0:
        return torch.stack(values)
    return torch.stack(values, dim) if stack else torch.cat(values, dim)


@PROPERTY
@given(data=st.data())
def test_gather(pool, data):
    w = pool.world_size
    trees = _draw_trees(data, w)
    kwargs = {
        "dim": data.draw(st.sampled_from([0, -1]), "dim"),
        "stack": data.draw(st.booleans(), "stack"),
        "to_cpu": data.draw(st.booleans(), "to_cpu"),
    }
    reports = _run(pool, "gather", trees, kwargs)
    expected = optree.tree_map(
        lambda *vs: _gathered(vs, vs[0], kwargs["dim"], kwargs["stack"]), *trees, none_is_leaf=False
    )
    out = reports[0]["out"]
    assert_trees(out, expected, same_bits, "gather")
    assert set(reports[0]["devices"]) <= {_expected_devices(pool, kwargs)}


def _one_size(args):
    """A gather (to the device and to the host) of leaves whose slots all have
    one size, each rank's values its own."""
    mode, dtype, shapes = args
    r = xcoll.rank()
    tree = {
        f"x{i}": (torch.arange(_numel(s)) * 3 + 1000 * i + 100 * r).reshape(s).to(dtype)
        for i, s in enumerate(shapes)
    }
    x = to_device(tree, device())
    with xcoll.consistency_checks(mode):
        out = [to_cpu(xcoll.gather(x)), xcoll.gather(x, to_cpu=True)]
    return tree, out


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


# A gather's guard header is 8 bytes (2 int32 words): slots of that size
# make the buffer one run of equal slots, header included; with no header
# (mode "never") any one size does; slots larger than the header, too.
ONE_SIZE = [
    ("guard", torch.float32, [(2,), (2,)]),  # two float32 leaves of the header's size
    ("guard", torch.float32, [(1, 2), (2,), (2, 1)]),  # three shapes, one size
    ("guard", torch.int64, [(1,)] * 3),
    ("guard", torch.uint8, [(8,)] * 2),
    ("guard", torch.float32, [(16, 4), (64,), (8, 8)]),  # 256 bytes each
    ("never", torch.float32, [(5,), (5,)]),
    ("never", torch.int16, [(3, 4)] * 3),
    ("never", torch.float32, [(256,)] * 3),  # 1 KiB each
]


@pytest.mark.parametrize("case", ONE_SIZE, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}")
def test_a_gather_whose_slots_all_have_one_size(pool, case):
    w = pool.world_size
    reports = pool.run(_one_size, [case] * w)
    trees = [tree for tree, _ in reports]
    for r, (_, outs) in enumerate(reports):
        for out in outs:
            for k in trees[0]:
                expected = torch.cat([t[k] for t in trees])
                assert torch.equal(out[k], expected), (r, k, out[k], expected)


# ---- reduce -----------------------------------------------------------------

_FOLD = {
    "sum": lambda a, b: a + b,
    "mean": lambda a, b: a + b,
    "prod": lambda a, b: torch.logical_and(a, b) if a.dtype == torch.bool else a * b,
    "max": torch.maximum,
    "min": torch.minimum,
}
# The dtypes each op accepts (the rest are refused, see test_errors.py).
_OP_DTYPES = {
    "sum": [d for d in S.DTYPES if d != torch.bool],
    "mean": [d for d in S.DTYPES if d.is_floating_point],
    "prod": S.DTYPES,
    "max": S.DTYPES,
    "min": S.DTYPES,
}


def _as_tensor(v):
    """A leaf as a tensor: a Python scalar as the dtype it travels as (a float as float64)."""
    if isinstance(v, torch.Tensor):
        return v
    return torch.tensor(v, dtype=torch.float64 if isinstance(v, float) else None)


def _folded(op, values):
    like = values[0]
    ts = [_as_tensor(v) for v in values]
    acc = ts[0]
    for t in ts[1:]:
        acc = _FOLD[op](acc, t)
    if op == "mean":
        acc = acc / len(ts)
    return acc if isinstance(like, torch.Tensor) else type(like)(acc.item())


def _documented(op, values):
    """The reduction docs/design.md promises, bit for bit, for values whose sums and
    products are exact: float sums and products read -0.0 as +0.0; a mean is the
    sum divided by W, rounded once; max/min order -0.0 below +0.0; a NaN result is
    the quiet NaN float("nan")."""
    like = values[0]
    ts = [_as_tensor(v) for v in values]
    if not ts[0].dtype.is_floating_point:
        return _folded(op, values)
    dtype = ts[0].dtype
    x = torch.stack([t.double() for t in ts])
    if op in ("sum", "mean", "prod"):
        x = x + 0.0
        acc = x.sum(0) if op != "prod" else x.prod(0)
        acc = acc / len(ts) if op == "mean" else acc
    else:
        acc = x.amax(0) if op == "max" else x.amin(0)
        signed = torch.signbit(x)
        # at a zero result: +0.0 for max if any replica has +0.0, -0.0 for min if any has -0.0
        zero_sign = signed.all(0) if op == "max" else signed.any(0)
        acc = torch.where(acc == 0, torch.where(zero_sign, -0.0, 0.0).double(), acc)
    acc = acc.masked_fill(torch.isnan(x).any(0) | torch.isnan(acc), float("nan")).to(dtype)
    acc = acc.masked_fill(torch.isnan(acc), float("nan"))
    return acc if isinstance(like, torch.Tensor) else float(acc.item())


def _scalar_kinds(op):
    return {"sum": [int, float], "mean": [float]}.get(op, [bool, int, float])


@st.composite
def _reduce_case(draw, world_size, dim=None):
    """An op and the replicas' trees; with ``dim``, a reduce-scatter's: no
    Python scalars, each tensor leaf cut along ``dim`` into the replicas' parts."""
    op = draw(st.sampled_from(["sum", "mean", "prod", "max", "min"]), "op")
    leaf = S._tensor_specs(_OP_DTYPES[op])
    if dim is None:
        leaf = leaf | st.builds(S.ScalarSpec, st.sampled_from(_scalar_kinds(op)))
    skeleton = draw(
        st.recursive(
            leaf,
            lambda c: (
                st.lists(c, max_size=3)
                | st.dictionaries(st.text("xyz", min_size=1, max_size=2), c, max_size=3)
            ),
            max_leaves=6,
        ),
        "skeleton",
    )
    if dim is not None:
        skeleton = S.scatterable(skeleton, world_size, dim)
    # (max and min are exact for any values: every bit pattern and integer)
    exact = op in ("sum", "mean", "prod")
    return op, draw(S.rank_trees(skeleton, world_size, exact=exact), "trees")


@PROPERTY
@given(case=st.data())
def test_reduce(pool, case):
    op, trees = case.draw(_reduce_case(pool.world_size))
    kwargs = {"op": op, "to_cpu": case.draw(st.booleans(), "to_cpu")}
    reports = _run(pool, "reduce", trees, kwargs, extra="stacked" if op == "sum" else None)
    expected = optree.tree_map(lambda *vs: _documented(op, vs), *trees, none_is_leaf=False)
    out = reports[0]["out"]
    assert_trees(out, expected, same_bits, f"reduce {op}")
    assert set(reports[0]["devices"]) <= {_expected_devices(pool, kwargs)}
    if op == "sum":  # reduce(t, "sum") == gather(t, stack=True) summed over axis 0
        summed = optree.tree_map(
            lambda like, g: (
                g.sum(0, dtype=g.dtype) if isinstance(g, torch.Tensor) else type(like)(sum(g))
            ),
            trees[0],
            reports[0]["stacked"],
            none_is_leaf=False,
        )
        assert_trees(out, summed, same_values, "sum vs gather")


# ---- reduce_scatter, all_to_all ----------------------------------------------------


def _part(t: torch.Tensor, dim: int, world: int, r: int) -> torch.Tensor:
    """Part ``r`` of ``world`` of ``t``, cut along ``dim``."""
    n = t.shape[dim] // world
    return t.narrow(dim, r * n, n)


@PROPERTY
@given(case=st.data())
def test_reduce_scatter(pool, case):
    w = pool.world_size
    dim = case.draw(st.sampled_from([0, -1]), "dim")
    op, trees = case.draw(_reduce_case(w, dim))
    kwargs = {"op": op, "dim": dim, "to_cpu": case.draw(st.booleans(), "to_cpu")}
    reports = _run(pool, "reduce_scatter", trees, kwargs, same=False)
    reduced = optree.tree_map(lambda *vs: _documented(op, vs), *trees, none_is_leaf=False)
    for r, rep in enumerate(reports):
        expected = optree.tree_map(lambda t, r=r: _part(t, dim, w, r), reduced, none_is_leaf=False)
        assert_trees(rep["out"], expected, same_bits, f"reduce_scatter {op} on rank {r}")
        assert set(rep["devices"]) <= {_expected_devices(pool, kwargs)}


@PROPERTY
@given(data=st.data())
def test_all_to_all(pool, data):
    w = pool.world_size
    dim = data.draw(st.sampled_from([0, -1]), "dim")
    skeleton = S.scatterable(data.draw(S.skeletons(scalars=False), "skeleton"), w, dim)
    trees = data.draw(S.rank_trees(skeleton, w), "trees")
    kwargs = {"dim": dim, "to_cpu": data.draw(st.booleans(), "to_cpu")}
    reports = _run(pool, "all_to_all", trees, kwargs, same=False)
    for r, rep in enumerate(reports):
        expected = optree.tree_map(
            lambda *vs, r=r: torch.cat([_part(v, dim, w, r) for v in vs], dim),
            *trees,
            none_is_leaf=False,
        )
        assert_trees(rep["out"], expected, same_bits, f"all_to_all on rank {r}")
        assert set(rep["devices"]) <= {_expected_devices(pool, kwargs)}


def test_reduce_prefix_ops(pool):
    w = pool.world_size
    trees = [
        {
            "loss": torch.tensor([1.5 * r, -2.0]),
            "count": torch.tensor(r + 1, dtype=torch.int64),
            "best": {"acc": torch.tensor([0.25 * r]), "flag": torch.tensor([r % 2 == 1])},
            "steps": 10 * r,
        }
        for r in range(w)
    ]
    ops = {"loss": "mean", "count": "sum", "best": "max", "steps": "sum"}
    out = _run(pool, "reduce", trees, {"op": ops})[0]["out"]
    expected = {
        "loss": torch.tensor([1.5 * sum(range(w)) / w, -2.0]),
        "count": torch.tensor(sum(range(1, w + 1))),
        "best": {"acc": torch.tensor([0.25 * (w - 1)]), "flag": torch.tensor([w > 1])},
        "steps": 10 * sum(range(w)),
    }
    assert_trees(out, expected, same_values)


# ---- broadcast --------------------------------------------------------------


def _poison(tree):
    """The same tree with every float tensor full of NaN."""
    return optree.tree_map(
        lambda t: (
            torch.full_like(t, float("nan"))
            if isinstance(t, torch.Tensor) and t.dtype.is_floating_point
            else t
        ),
        tree,
        none_is_leaf=False,
    )


@PROPERTY
@given(data=st.data())
def test_broadcast(pool, data):
    w = pool.world_size
    trees = _draw_trees(data, w)
    src = data.draw(st.integers(0, w - 1), "src")
    if data.draw(st.booleans(), "others hold NaN"):
        trees = [t if r == src else _poison(t) for r, t in enumerate(trees)]
    kwargs = {"src": src, "to_cpu": data.draw(st.booleans(), "to_cpu")}
    reports = _run(pool, "broadcast", trees, kwargs)
    assert_trees(reports[0]["out"], trees[src], same_bits, "broadcast")
    assert set(reports[0]["devices"]) <= {_expected_devices(pool, kwargs)}


@pytest.mark.parametrize("name", ["gather", "reduce", "broadcast"])
def test_empty_tree(pool, name):
    tree = {"a": None, "b": [], "c": ()}
    reports = _run(pool, name, [tree] * pool.world_size, {})
    assert reports[0]["out"] == tree


@PROPERTY
@given(data=st.data())
def test_float_reductions_agree_on_every_replica(pool, data):
    """Arbitrary floats (rounding differs with summation order): every replica
    still gets the same bits, close to the fold over ranks."""
    w = pool.world_size
    op = data.draw(st.sampled_from(["sum", "mean", "prod"]), "op")
    dtype = data.draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), "dtype")
    n = data.draw(st.integers(1, 40), "n")
    values = st.floats(-10, 10, width=16)
    trees = [
        {"x": torch.tensor(data.draw(st.lists(values, min_size=n, max_size=n)), dtype=dtype)}
        for _ in range(w)
    ]
    out = _run(pool, "reduce", trees, {"op": op})[0]["out"]["x"]  # _run checks identity
    expected = _folded(op, [t["x"].double() for t in trees])
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    assert torch.allclose(out.double(), expected, rtol=tol, atol=tol * 10), (out, expected)
