"""torch_xla's own counters prove the pipeline: one graph execution per replica
per call, no recompilation on repeat (a small call: none at all, whatever its
tree), no more collectives in the HLO than there are buckets, one
device-to-host transfer per packed buffer with to_cpu=True."""

from __future__ import annotations

import re

import pytest
import torch

import xcoll
from tests.replicas import counters, device, shared_pool

N_LEAVES = 64
# One replica's persistent state between pool.run calls, by rank.
_STATE: dict[int, dict] = {}


def make_tree(rank: int, n: int, width: int) -> dict:
    """``n`` tensor leaves of four dtypes (shape ``(width, 3)``) plus Python scalars."""
    g = torch.Generator().manual_seed(rank)
    dtypes = [torch.float32, torch.bfloat16, torch.int32, torch.bool]
    leaves = {}
    for i in range(n):
        dtype = dtypes[i % len(dtypes)]
        t = torch.randn(width, 3, generator=g) * 10
        leaves[f"t{i:03d}"] = t.to(dtype) if dtype != torch.bool else t > 0
    return {"tensors": leaves, "step": rank, "lr": 0.5 * rank}


def _setup(args):
    n, width = args
    dev = device()
    tree = make_tree(xcoll.rank(), n, width)
    _STATE[xcoll.rank()] = {
        "x": {
            "tensors": {k: v.to(dev) for k, v in tree["tensors"].items()},
            "step": tree["step"],
            "lr": tree["lr"],
        }
    }
    xcoll.sync()  # inputs become device data, not pending IR
    xcoll.gather(
        xcoll.rank()
    )  # a replica's first call is checked (xcoll._guard.check): not the measured one


def _wait(tree) -> None:
    """Waits for this replica's execution (counters are updated when it ends) by
    fetching one device output; ``xm.wait_device_ops()`` would deadlock here."""
    import torch_xla

    t = next(v for v in tree["tensors"].values())
    if t.device.type == "xla":
        torch_xla._XLAC._xla_get_cpu_tensors([t])


def _call(args):
    name, kwargs = args
    state = _STATE[xcoll.rank()]
    tree = (
        state["x"]
        if name != "reduce" or kwargs.get("op", "sum") != "sum"
        else _without_bools(state["x"])
    )
    state["out"] = getattr(xcoll, name)(tree, **kwargs)
    _wait(state["out"])


def _without_bools(tree):
    return {**tree, "tensors": {k: v for k, v in tree["tensors"].items() if v.dtype != torch.bool}}


def _traced(args):
    """Calls with sync=False; returns the number of collectives in the pending HLO."""
    import torch_xla

    name, kwargs = args
    state = _STATE[xcoll.rank()]
    tree = {"tensors": state["x"]["tensors"]}
    if name == "reduce" and kwargs.get("op", "sum") == "sum":
        tree = _without_bools(tree)
    # (the guard's header adds no collective: the mode only keeps the counts
    # of the group's first call, checked in full, out of this one)
    with xcoll.consistency_checks("never"):
        out = getattr(xcoll, name)(tree, sync=False, **kwargs)
    hlo = torch_xla._XLAC._get_xla_tensors_hlo(list(out["tensors"].values()))
    state["out"] = out
    return {op: len(re.findall(rf"\s{op}\(", hlo)) for op in ("all-gather", "all-reduce")}


def _sync(_=None):
    xcoll.sync()
    _wait(_STATE[xcoll.rank()]["out"])


def _step(mode):
    """A caller's step: pending work, a reduction folded in with sync=False, more work."""
    state = _STATE[xcoll.rank()]
    x = state["x"]["tensors"]["t000"]
    loss = (x * 2).sum()
    with xcoll.consistency_checks(mode):
        mean = xcoll.reduce({"loss": loss}, "mean", sync=False)["loss"]
    state["out"] = {"tensors": {"step": mean + 1}}
    xcoll.sync()
    _wait(state["out"])


CALLS = [
    ("gather", {}),
    ("gather", {"to_cpu": True}),
    ("gather", {"stack": True, "dim": 1}),
    ("reduce", {"op": "sum"}),
    ("reduce", {"op": "max"}),
    ("reduce", {"op": "max", "to_cpu": True}),
    ("broadcast", {"src": 1}),
    ("broadcast", {"src": 1, "to_cpu": True}),
]


def _delta(pool, fn, args=None, results=None):
    """The change in the pool's counters while every replica runs ``fn(args)``."""
    before = pool.run(counters)[0]  # (settled: xcoll.testing.xla_counters)
    out = pool.run(fn, [args] * pool.world_size)
    after = pool.run(counters)[0]
    if results is not None:
        results.extend(out)
    return {k: after[k] - before[k] for k in before}


@pytest.mark.parametrize("name,kwargs", CALLS, ids=[f"{n}-{k}" for n, k in CALLS])
def test_one_execution_per_replica_and_no_recompile(xla4, name, kwargs):
    w = xla4.world_size
    # fresh shapes: the first call must compile (64 leaves of (width, 3): a
    # large call, whose program is its own)
    width = 50 + CALLS.index((name, kwargs))
    xla4.run(_setup, [(N_LEAVES, width)] * w)
    first = _delta(xla4, _call, (name, kwargs))
    assert first["executions"] == w
    assert first["compiles"] == 1  # one thread compiles, the others hit the cache
    for _ in range(2):
        again = _delta(xla4, _call, (name, kwargs))
        assert again["executions"] == w
        assert again["compiles"] == 0


@pytest.mark.parametrize("name,kwargs", CALLS, ids=[f"{n}-{k}" for n, k in CALLS])
def test_a_small_call_runs_the_one_small_program_and_compiles_nothing(xla4, name, kwargs):
    # 8 leaves of (width, 3) and two Python scalars: at most SMALL bytes, so
    # packed on the host around the one all-gather of SMALL bytes that every
    # small call shares (compiled by _setup's first call): a tree never seen
    # compiles nothing. Two transfers per replica: its leaves, then the rows
    # (and _call's fetch of a device output, which waits for it).
    w = xla4.world_size
    xla4.run(_setup, [(8, 1 + CALLS.index((name, kwargs)))] * w)
    transfers = (2 if kwargs.get("to_cpu") else 3) * w
    for _ in range(3):
        again = _delta(xla4, _call, (name, kwargs))
        assert again == {"executions": w, "compiles": 0, "transfers_from_device": transfers}


def _half(args: tuple[int, str]) -> list[float]:
    n, op = args
    x = (torch.arange(n, dtype=torch.float16) % 8 + xcoll.rank()).to(device())  # (made on the host)
    return xcoll.reduce({"h": x}, op, to_cpu=True)["h"].tolist()


def test_a_half_precision_max_within_the_small_size_class_compiles_nothing(xla4):
    # 1500 float16 elements: a max keeps their width (their bits' keys, 3000
    # bytes: a small call, in the shared small program); a sum of them
    # travels in float32 (6000 bytes: a program of its own), every element exact
    w = xla4.world_size
    xla4.run(_setup, [(8, 1)] * w)
    got: list[list[float]] = []
    first = _delta(xla4, _half, (1500, "max"), got)
    assert got == [[i % 8 + w - 1.0 for i in range(1500)]] * w
    assert first["compiles"] == 0 and first["executions"] == w, first
    got = []
    summed = _delta(xla4, _half, (1500, "sum"), got)
    assert got == [[w * (i % 8) + w * (w - 1) / 2 for i in range(1500)]] * w
    assert summed["compiles"] > 0, summed


def _gather_words(n: int) -> list[float]:
    x = torch.full((n,), float(xcoll.rank()), dtype=torch.float32).to(device())
    return xcoll.gather({"g": x}, to_cpu=True)["g"].view(-1, n)[:, -1].tolist()


def test_a_gather_of_exactly_the_small_size_class_compiles_nothing(xla4):
    # the guard's header words, then n float32 words: SMALL bytes in all is
    # still a small call (the shared small program); one word more is a
    # program of its own
    from xcoll._encode.pack import SMALL
    from xcoll._guard.header import own_size

    w = xla4.world_size
    xla4.run(_setup, [(8, 1)] * w)
    n = SMALL // 4 - own_size(torch.int32, "", w)
    got: list[list[float]] = []
    at = _delta(xla4, _gather_words, n, got)
    over = _delta(xla4, _gather_words, n + 1, got)
    assert got == [[float(r) for r in range(w)]] * (2 * w)
    assert at["compiles"] == 0 and at["executions"] == w, at
    assert over["compiles"] == 1, over


@pytest.mark.parametrize("name,op", [("gather", None), ("reduce", "max"), ("broadcast", None)])
def test_to_cpu_fetches_one_buffer_per_dtype_not_per_leaf(xla4, name, op):
    w = xla4.world_size
    xla4.run(_setup, [(N_LEAVES, 40)] * w)  # (a large call)
    kwargs = {"to_cpu": True, **({"op": op} if op else {})}
    _delta(xla4, _call, (name, kwargs))  # compile
    plain = _delta(xla4, _call, (name, kwargs))
    # the packed buffers (4 tensor dtypes, 2 scalar dtypes) and the guard's
    # header fetched in one call per replica; fetching leaf by leaf would make
    # it one per leaf, and a device output read on the host one more
    assert plain["transfers_from_device"] == w


@pytest.mark.parametrize(
    "name,kwargs,expected",
    [
        # a move is one collective whatever its dtypes; a reduce, one per (dtype,
        # op) once merged: sum: float32 with bfloat16, int32; min: float32,
        # bfloat16 (float max/min keep their own), int32 with bool
        ("gather", {}, {"all-gather": 1, "all-reduce": 0}),
        ("reduce", {"op": "sum"}, {"all-gather": 0, "all-reduce": 2}),
        ("reduce", {"op": "min"}, {"all-gather": 0, "all-reduce": 3}),
        ("broadcast", {"src": 3}, {"all-gather": 0, "all-reduce": 1}),
    ],
)
def test_one_collective_per_move_and_per_reduced_dtype_in_the_hlo(xla4, name, kwargs, expected):
    w = xla4.world_size
    xla4.run(_setup, [(N_LEAVES, 3)] * w)
    hlo = []
    counts = _delta(xla4, _traced, (name, kwargs), hlo)
    assert counts["executions"] == 0  # sync=False executes nothing
    assert hlo == [expected] * w
    assert _delta(xla4, _sync)["executions"] == w


def test_mean_and_sum_share_one_all_reduce(xla4):
    w = xla4.world_size
    xla4.run(_setup, [(4, 3)] * w)
    # t000 float32 mean and sum, t001 bfloat16 sum: one all-reduce, not one per
    # op or per dtype (a bfloat16 sum accumulates in float32 anyway)
    hlo = xla4.run(_traced_ops, [None] * w)
    assert hlo == [1] * w


def _traced_ops(_):
    import torch_xla

    x = _STATE[xcoll.rank()]["x"]["tensors"]
    tree = {"a": x["t000"], "b": x["t000"] * 3, "c": x["t001"]}
    out = xcoll.reduce(tree, {"a": "mean", "b": "sum", "c": "sum"}, sync=False)
    hlo = torch_xla._XLAC._get_xla_tensors_hlo(list(out.values()))
    xcoll.sync()
    return len(re.findall(r"\sall-reduce\(", hlo))


@pytest.mark.parametrize("mode", ["guard", "never"])
def test_sync_false_joins_the_callers_step(xla4, mode):
    # The call joins the caller's step: one execution per replica. Its guard
    # is read after the caller's sync (a step closure): one transfer of the
    # header, which is data by then, and no execution.
    w = xla4.world_size
    xla4.run(_setup, [(4, 7)] * w)
    _delta(xla4, _step, mode)
    k = 2 if mode == "guard" else 1
    assert _delta(xla4, _step, mode) == {
        "executions": w,
        "compiles": 0,
        "transfers_from_device": k * w,
    }


def _tensors_only(mode):
    # (an upload: data, not pending work, so the call's step is its own; of
    # 8,000 bytes, beyond the small calls that run on the host)
    x = torch.full((2000,), float(xcoll.rank() + 1)).to(device())
    with xcoll.consistency_checks(mode):
        _STATE[xcoll.rank()] = {"out": xcoll.reduce({"x": x})}


def _read(_=None) -> list[float]:
    return _STATE[xcoll.rank()]["out"]["x"].cpu().tolist()


@pytest.mark.parametrize("world,mode", [(1, "guard"), (2, "never")])
def test_a_call_without_a_header_runs_its_program_before_it_returns(world, mode):
    # A call with sync (the default) whose outputs stay on the device runs
    # its program within the call even when no header or Python scalar is
    # read back from it (a world of one, or checks off): its outputs are data
    # when it returns, not work left pending for the caller's next step.
    pool = shared_pool(f"xla-cpu-{world}")
    pool.run(_tensors_only, [mode] * world)  # (compiles)
    during = _delta(pool, _tensors_only, mode)
    assert during["executions"] == world, during
    total = float(sum(range(1, world + 1)))
    assert pool.run(_read) == [[total] * 2000] * world


def _back_to_back(n):
    x = _STATE[xcoll.rank()]["x"]["tensors"]
    for _ in range(n):
        out = xcoll.gather({"a": x["t000"]})
        total = xcoll.reduce({"b": x["t000"]}, "max")
    return out["a"].cpu().shape[0], total["b"].cpu().shape


def test_back_to_back_calls_without_reading_results_do_not_hang(xla4):
    # Regression: replicas running ahead with several executions in flight joined
    # each other's collectives and XLA aborted after a few dozen calls.
    w = xla4.world_size
    xla4.run(_setup, [(2, 2)] * w)
    assert xla4.run(_back_to_back, [150] * w) == [(2 * w, torch.Size([2, 3]))] * w



def _alone_call(args):
    """One to_cpu call on leaves that are data, or pending (the caller's own
    work, which the call's sync runs); returns its outputs."""
    name, kwargs, pending = args
    x = _STATE[xcoll.rank()]["x"]
    tensors = {k: v.clone() if pending else v for k, v in x["tensors"].items()}
    tree = {"tensors": tensors, "lr": x["lr"]}
    if name == "reduce" and kwargs.get("op", "sum") == "sum":
        tree = _without_bools(tree)
    return getattr(xcoll, name)(tree, to_cpu=True, **kwargs)


@pytest.mark.parametrize(
    "name,kwargs",
    [("gather", {}), ("reduce", {"op": "sum"}), ("reduce", {"op": "max"}), ("broadcast", {})],
)
def test_a_world_of_one_to_the_host_runs_no_program_of_its_own(name, kwargs):
    # Its collectives are identities: the call fetches the leaves (one
    # transfer) and runs on the host, after the caller's pending work (one
    # execution, only if there is some).
    from tests.replicas import shared_pool

    one = shared_pool("xla-cpu-1")
    one.run(_setup, [(8, 3)])
    tree = make_tree(0, 8, 3)
    for pending in (False, True):
        out: list = []
        counts = _delta(one, _alone_call, (name, kwargs, pending), out)
        assert counts["executions"] == int(pending)
        assert counts["compiles"] <= int(pending)
        assert counts["transfers_from_device"] == 1
        got = out[0]["tensors"]
        for k, want in tree["tensors"].items():
            if k in got:
                assert got[k].device.type == "cpu" and torch.equal(got[k], want), k
        assert len(got) == (6 if name == "reduce" and kwargs["op"] == "sum" else 8)
        assert out[0]["lr"] == ([0.0] if name == "gather" else 0.0)
