"""Replicas that make different calls: a clear error on every replica, naming
the first difference, and the pool works again afterwards."""

from __future__ import annotations

import pytest
import torch

import xcoll
from tests.replicas import device, shared_pool

MISMATCH = "xcoll.CollectiveMismatchError"


class _Odd:
    """A leaf type whose name holds a lone surrogate: the name reaches the
    description lines as it is, in the error's text (paths and structures
    are reprs, which escape it)."""


_Odd.__qualname__ = "Odd\ud800"


def _key():
    """A dict key whose repr holds its address, which the messages leave out."""


def case(name: str, rank: int, last: bool, dev):
    t = torch.ones(2, 3).to(dev)
    if name == "dict keys":
        return "gather", {"a": t, ("c" if last else "b"): t}, {}
    if name == "extra list element":
        return "gather", [t] * (2 if last else 1), {}
    if name == "tuple vs list":
        return "gather", (t, t) if last else [t, t], {}
    if name == "shape":
        return "gather", {"x": torch.ones(2, 4 if last else 3).to(dev)}, {}
    if name == "ndim":
        return "gather", {"x": torch.ones(6).to(dev) if last else t}, {}
    if name == "dtype":
        return "reduce", {"x": t.int() if last else t}, {}
    if name == "src":
        return "broadcast", {"x": t}, {"src": 1 if last else 0}
    if name == "op":
        return "reduce", {"x": t}, {"op": "max" if last else "sum"}
    if name == "empty on one replica":
        return "gather", {"x": torch.ones(0 if last else 2, 3).to(dev)}, {}
    if name == "non-tensor leaf":
        return "gather", {"x": t, "y": "oops" if last else t}, {}
    if name == "object key":
        return "gather", {_key: torch.ones(2, 4 if last else 3).to(dev)}, {}
    if name == "lone surrogate":
        return "gather", {"x": t, "y": _Odd() if last else t}, {}
    if name == "scatter dim":
        return "reduce_scatter", {"x": torch.ones(4, 12).to(dev)}, {"dim": 1 if last else 0}
    if name == "all_to_all vs gather":
        return "all_to_all" if last else "gather", {"x": torch.ones(4, 12).to(dev)}, {}
    if name in ("all_to_all shape", "reduce_scatter shape"):  # (the leaves' shapes, not their parts')
        return name.split()[0], {"x": torch.ones(4, 8 if last else 12).to(dev)}, {"dim": 1}
    if name == "indivisible":
        return "all_to_all", {"x": torch.ones(4, 11 if last else 12).to(dev)}, {"dim": 1}
    if name == "uneven dim":
        return "gather", {"x": t}, {"uneven": True, "dim": 1 if last else 0}
    if name == "uneven to_cpu":
        return "gather", {"x": t}, {"uneven": True, "to_cpu": last}
    if name == "mixed devices":
        return "gather", {"x": t, "y": torch.ones(1, device="meta") if last else t}, {}
    raise AssertionError(name)


# case -> (what the differing replica raises, what the others raise, text in every message)
EXPECTED = {
    "dict keys": (MISMATCH, MISMATCH, "tree["),
    "extra list element": (MISMATCH, MISMATCH, "tree[1]"),
    "tuple vs list": (MISMATCH, MISMATCH, "PyTreeSpec"),
    "shape": (MISMATCH, MISMATCH, "tree['x']"),
    "ndim": (MISMATCH, MISMATCH, "tree['x']"),
    "dtype": (MISMATCH, MISMATCH, "tree['x']"),
    "src": (MISMATCH, MISMATCH, "src="),
    "op": (MISMATCH, MISMATCH, "op="),
    "empty on one replica": (MISMATCH, MISMATCH, "shape (0, 3)"),
    "non-tensor leaf": ("builtins.TypeError", MISMATCH, "tree['y']"),
    "mixed devices": ("builtins.TypeError", MISMATCH, "tree['y']"),
    "scatter dim": (MISMATCH, MISMATCH, "dim="),
    "uneven dim": (MISMATCH, MISMATCH, "dim=1 stack=False uneven=True max_size=None"),
    "uneven to_cpu": (MISMATCH, MISMATCH, "uneven=True max_size=None to_cpu=True"),
    "all_to_all vs gather": (MISMATCH, MISMATCH, "xcoll.all_to_all"),
    "all_to_all shape": (MISMATCH, MISMATCH, "tree['x']"),
    "reduce_scatter shape": (MISMATCH, MISMATCH, "tree['x']"),
    "indivisible": ("builtins.ValueError", MISMATCH, "tree['x']"),
    "lone surrogate": ("builtins.TypeError", MISMATCH, "type Odd\ud800"),
    "object key": (MISMATCH, MISMATCH, "has tree[<function _key>]: float32 tensor of shape (2, "),
}


def _call(name):
    rank, world = xcoll.rank(), xcoll.world_size()
    fn, tree, kwargs = case(name, rank, rank == world - 1, device())
    with xcoll.consistency_checks("always"):
        getattr(xcoll, fn)(tree, **kwargs)
    return "no error"


def _ok(_):
    with xcoll.consistency_checks("always"):
        return xcoll.gather(xcoll.rank())


WORLDS = ["xla-cpu-2", "xla-cpu-4", "gloo-2", "gloo-4"]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", list(EXPECTED))
def test_every_replica_raises_and_the_pool_goes_on(world, name):
    pool = shared_pool(world)
    w = pool.world_size
    failures = pool.run(_call, [name] * w, return_exceptions=True)
    odd, others, text = EXPECTED[name]
    assert [f.type_name for f in failures] == [others] * (w - 1) + [odd], failures
    for r, f in enumerate(failures):
        assert text in f.message, (r, f.message)
        other = w - 1 if r < w - 1 else 0  # the last replica is the odd one
        if f.type_name == MISMATCH and odd == MISMATCH:  # names both replicas' calls
            assert f"this replica (rank {r}) has" in f.message, (r, f.message)
            assert f"; rank {other} has" in f.message, (r, f.message)
            if name.endswith("shape"):  # each replica's line as described, nothing added
                mine, theirs = ("(2, 4)", "(2, 3)") if r == w - 1 else ("(2, 3)", "(2, 4)")
                if name != "shape":
                    mine, theirs = ("(4, 8)", "(4, 12)") if r == w - 1 else ("(4, 12)", "(4, 8)")
                if name == "reduce_scatter shape":  # (a reduce's line ends with its op)
                    mine, theirs = f"{mine} op=sum", f"{theirs} op=sum"
                assert (
                    f"has tree['x']: float32 tensor of shape {mine}; rank {other} has "
                    f"tree['x']: float32 tensor of shape {theirs}"
                ) in f.message, (r, f.message)
        elif f.type_name == MISMATCH:  # quotes the odd replica's own error
            assert f": rank {other} raised before communicating ({odd.split('.')[-1]}: " in (
                f.message
            ), (r, f.message)
        elif odd != MISMATCH:  # the odd replica's own error, with what the others did
            assert f"this replica (rank {r}) raised before communicating; rank 0 did not" in (
                f.message
            ), (r, f.message)
    assert pool.run(_ok, [None] * w) == [list(range(w))] * w


def _uneven_empty(_):
    rank, world = xcoll.rank(), xcoll.world_size()
    x = torch.ones(0 if rank == world - 1 else 2, 3).to(device())
    with xcoll.consistency_checks("always"):
        return xcoll.gather({"x": x}, uneven=True, to_cpu=True)["x"].shape[0]


@pytest.mark.parametrize("world", WORLDS)
def test_an_empty_shard_is_valid_for_uneven_gathers(world):
    pool = shared_pool(world)
    assert (
        pool.run(_uneven_empty, [None] * pool.world_size)
        == [2 * (pool.world_size - 1)] * pool.world_size
    )


def test_modes():
    with pytest.raises(ValueError, match="mode must be one of"):
        with xcoll.consistency_checks("sometimes"):
            pass


def test_the_mode_is_read_from_xcoll_check_unless_a_block_sets_it(monkeypatch):
    monkeypatch.setenv("XCOLL_CHECK", "sometimes")
    with pytest.raises(ValueError, match="^XCOLL_CHECK must be one of .*, got 'sometimes'$"):
        xcoll.gather(torch.ones(1))
    with xcoll.consistency_checks("never"):
        assert xcoll.gather(torch.ones(1)).tolist() == [1.0]


def test_an_empty_xcoll_check_is_unset(monkeypatch):
    # (tools treat an empty variable as unset: the default mode, "guard")
    from xcoll._guard import check as _check

    monkeypatch.setenv("XCOLL_CHECK", "")
    assert _check.mode() == "guard"
    assert xcoll.gather(torch.ones(1)).tolist() == [1.0]


def _layouts(_):
    rank, dev = xcoll.rank(), device()
    base = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5) + 100 * rank
    tree = {
        "expanded": (torch.arange(3.0) + rank).to(dev).expand(4, 3),
        "channels_last": base.to(memory_format=torch.channels_last).to(dev),
        "transposed": base[0, 0].to(dev).t(),
        # (one element of stride 0, which torch counts as contiguous; alone
        # in its dtype, as a segment of its own)
        "one expanded": (torch.tensor(7) + rank).expand(1).to(dev),
    }
    return {
        "gather": {k: v.cpu() for k, v in xcoll.gather(tree).items()},
        "sum": {k: v.cpu() for k, v in xcoll.reduce(tree).items()},
        "broadcast": {
            k: v.cpu() for k, v in xcoll.broadcast(tree, src=xcoll.world_size() - 1).items()
        },
    }


@pytest.mark.parametrize("world", WORLDS)
def test_expanded_channels_last_and_transposed_inputs(world):
    pool = shared_pool(world)
    w = pool.world_size
    base = [torch.arange(120, dtype=torch.float32).reshape(2, 3, 4, 5) + 100 * r for r in range(w)]
    want = {
        "expanded": [(torch.arange(3.0) + r).expand(4, 3) for r in range(w)],
        "channels_last": base,
        "transposed": [b[0, 0].t() for b in base],
        "one expanded": [torch.tensor([7 + r]) for r in range(w)],
    }
    for out in pool.run(_layouts, [None] * w):
        for k, parts in want.items():
            assert torch.equal(out["gather"][k], torch.cat(parts)), k
            assert torch.equal(out["sum"][k], sum(parts)), k
            assert torch.equal(out["broadcast"][k], parts[-1]), k


def _wrap(_):
    dev, r = device(), xcoll.rank()
    tree = {
        "int8": torch.tensor([127, -128], dtype=torch.int8),
        "uint8": torch.tensor([255, 1], dtype=torch.uint8),
        "int32": torch.tensor([2**31 - 1], dtype=torch.int32),
        "int64": torch.tensor([2**63 - 1], dtype=torch.int64),
    }
    return {
        k: v.cpu() for k, v in xcoll.reduce({k: v.to(dev) for k, v in tree.items()}, "sum").items()
    }, r


@pytest.mark.parametrize("world", WORLDS)
def test_integer_sums_wrap_as_the_dtype_does(world):
    pool = shared_pool(world)
    w = pool.world_size
    for out, _ in pool.run(_wrap, [None] * w):
        expected = {
            "int8": torch.tensor([127 * w, -128 * w]).to(torch.int8),  # two's complement wrap
            "uint8": torch.tensor([255 * w, w]).to(torch.uint8),
            "int32": torch.tensor([(2**31 - 1) * w]).to(torch.int32),
            "int64": torch.tensor([2**63 - 1], dtype=torch.int64) * w,
        }
        for k in expected:
            assert torch.equal(out[k], expected[k].to(out[k].dtype)), (k, out[k], expected[k])


def _downcast(kind):
    dev = device()
    tree = {"ok": torch.ones(2, dtype=torch.int32).to(dev)}
    if kind == "tensor":
        tree["x"] = torch.ones(2).to(dev)
    elif kind == "python float":
        tree["x"] = 0.5
    return xcoll.gather(tree, to_cpu=True)["ok"].tolist()


def test_dtypes_the_device_narrows_are_refused_on_every_replica():
    pytest.importorskip("torch_xla")
    from xcoll.testing import XlaPool

    with XlaPool(2, env={"XLA_USE_BF16": "1"}) as pool:
        for kind in ("tensor", "python float"):
            failures = pool.run(_downcast, [kind] * 2, return_exceptions=True)
            assert [f.type_name for f in failures] == ["builtins.TypeError"] * 2
            assert all("tree['x']" in f.message and "XLA_USE_BF16" in f.message for f in failures)
        assert pool.run(_downcast, ["none"] * 2) == [[1, 1, 1, 1]] * 2


def _last_rank_skips(_):
    if xcoll.rank() != xcoll.world_size() - 1:
        xcoll.gather(torch.ones(2).to(device()))
    return xcoll.rank()


@pytest.mark.parametrize("engine", ["xla", "gloo"])
def test_a_replica_that_skips_the_call_is_an_error_within_bounds(engine):
    # XLA aborts after its 10 s rendezvous timeout (reported with its stderr);
    # gloo raises in the waiting ranks after the group's timeout (5 s here).
    import time

    from xcoll.testing import GlooPool, PoolCrashed, ReplicaError, XlaPool

    pool = XlaPool(4, grace=2) if engine == "xla" else GlooPool(4, grace=2, collective_timeout=5)
    with pool:
        pool.run(_ok, [None] * 4)  # each replica's first (checked) call is done
        t0 = time.monotonic()
        with pytest.raises(
            (PoolCrashed, ReplicaError), match="Termination timeout|imed out|timeout"
        ) as e:
            pool.run(_last_rank_skips, [None] * 4)
        assert time.monotonic() - t0 < 60
        if engine == "gloo":  # the waiting replicas name the operation
            assert "xcoll.gather: a collective did not complete" in str(e.value)
        assert pool.run(_ok, [None] * 4) == [list(range(4))] * 4


def _parameters_differ(args):
    """A later call (header-guarded) of ``name`` made with ``sync=`` or
    ``to_cpu=`` True on rank 0 only."""
    name, which = args
    x = torch.ones(2)
    xcoll.reduce(x)
    try:
        getattr(xcoll, name)(x, **{which: xcoll.rank() == 0})
        xcoll.sync()
    except xcoll.CollectiveMismatchError as e:
        return str(e)
    return "no error"


_PARAMETERS = {
    "gather": "dim=0 stack=False uneven=False max_size=None ",
    "reduce_scatter": "dim=0 ",
    "all_to_all": "dim=0 ",
}


@pytest.mark.parametrize("name", sorted(_PARAMETERS))
@pytest.mark.parametrize("which", ["sync", "to_cpu"])
def test_replicas_whose_sync_or_to_cpu_differ_raise_naming_them(name, which):
    # (on XLA a call in flight on one replica alone is another program: its
    # wait is diagnosed, then XLA aborts the process)
    def head(value):
        flags = {"to_cpu": False, "sync": True} | {which: value}
        return f"{_PARAMETERS[name]}to_cpu={flags['to_cpu']} sync={flags['sync']}"

    for rank, text in enumerate(shared_pool("gloo-2").run(_parameters_differ, [(name, which)] * 2)):
        assert text == (
            f"xcoll.{name}: replicas made different calls; the first difference: this replica "
            f"(rank {rank}) has parameters: {head(rank == 0)}; rank {1 - rank} has parameters: "
            f"{head(rank != 0)}"
        ), text


# ---- small calls of different kinds on gloo --------------------------------------


def _kinds(w: int, r: int) -> dict:
    """One small call of each kind, on rank ``r`` of ``w``."""
    x = (torch.arange(2.0 * w) + r).to(device())
    return {
        "gather": lambda: xcoll.gather(x),
        "reduce": lambda: xcoll.reduce(x),
        "broadcast": lambda: xcoll.broadcast(x),
        "reduce_scatter": lambda: xcoll.reduce_scatter(x),
        "all_to_all": lambda: xcoll.all_to_all(x),
        "gather_object": lambda: xcoll.gather_object({"r": r}),
        "broadcast_object": lambda: xcoll.broadcast_object({"r": r}),
        "barrier": lambda: xcoll.barrier("b"),
        "sync_rng_state": lambda: xcoll.sync_rng_state(),
    }


KINDS = list(_kinds(1, 0))


def _another_kind(pair):
    """Rank 0 makes a call of one kind, the others of another: each returns
    its error's text (or "returned"), then a consistent call's result."""
    mine, theirs = pair
    w, r = xcoll.world_size(), xcoll.rank()
    xcoll.barrier()  # (a group's first call is checked in full: this one is not)
    try:
        _kinds(w, r)[mine if r == 0 else theirs]()
        text = "returned"
    except xcoll.CollectiveMismatchError as e:
        text = str(e)
    return text, xcoll.reduce(torch.ones(1).to(device())).item()


@pytest.mark.parametrize("pair", [(a, b) for a in KINDS for b in KINDS if a != b], ids="-".join)
@pytest.mark.parametrize("world", ["gloo-2", "gloo-4", "xla-cpu-2"])
def test_small_calls_of_different_kinds_raise_on_every_replica(world, pair):
    # every small call is one all-gather of the same size on gloo (and on
    # XLA), whatever its kind: the replicas meet, and each names both calls
    pool = shared_pool(world)
    w = pool.world_size
    for r, (text, after) in enumerate(pool.run(_another_kind, [pair] * w, timeout=60)):
        mine, theirs = pair if r == 0 else pair[::-1]
        assert f"has call xcoll.{mine}; rank " in text and f"has call xcoll.{theirs}" in text, (r, text)
        assert after == w, (r, text)  # (the group goes on)


def _uneven_batches(_=None):
    """An eval loop whose last rank has one batch fewer: a small gather per
    batch, then a metrics reduce."""
    w, r = xcoll.world_size(), xcoll.rank()
    xcoll.barrier()  # (as above)
    try:
        for i in range(3 if r < w - 1 else 2):
            xcoll.gather({"preds": torch.full((4,), float(i + r))})
        xcoll.reduce({"loss": torch.tensor(0.5), "seen": torch.tensor(8)})
        text = "returned"
    except xcoll.CollectiveMismatchError as e:
        text = str(e)
    xcoll.barrier("realigned")
    return text, xcoll.reduce(torch.ones(1)).item()


@pytest.mark.parametrize("world", ["gloo-2", "gloo-4"])
def test_ranks_with_different_batch_counts_raise_on_every_replica(world):
    pool = shared_pool(world)
    w = pool.world_size
    for r, (text, after) in enumerate(pool.run(_uneven_batches, [None] * w, timeout=30)):
        assert "has call xcoll.gather; rank " in text or "has call xcoll.reduce; rank " in text, (r, text)
        assert after == w, (r, text)


_LEAVES = """
import datetime, sys, time, torch, torch.distributed as dist, xcoll
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
rank, world = dist.get_rank(), dist.get_world_size()
xcoll.barrier()
start = time.monotonic()
try:
    # the last rank's shard has one batch fewer, and its script ends there
    for i in range(3 if rank < world - 1 else 2):
        xcoll.gather({"preds": torch.full((4,), float(i + rank))})
    if rank == world - 1:
        print(f"rank {rank}: left", flush=True)
    else:
        xcoll.reduce({"loss": torch.tensor(0.5)})
        print(f"rank {rank}: returned normally", flush=True)
except Exception as e:
    print(f"rank {rank}: raised {type(e).__name__} after {time.monotonic() - start:.0f} s: {e}", flush=True)
dist.destroy_process_group()  # (a clean exit: docs/launchers.md)
"""


@pytest.mark.parametrize("world", [2, 4])
def test_a_replica_that_left_is_named_with_its_last_call_by_every_replica_waiting(tmp_path, world):
    # under torchrun (whose agent keeps the job's store), the replicas still
    # in the loop raise within seconds (the group's timeout is 90 s), naming
    # the replica that left and its last call
    import subprocess
    import sys

    script = tmp_path / "leaves.py"
    script.write_text(_LEAVES)
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    done = subprocess.run([*run, str(script)], capture_output=True, text=True, timeout=180)
    said = {int(line.split(":")[0][5:]): line.split(": ", 1)[1] for line in done.stdout.splitlines() if line.startswith("rank ")}
    assert said.get(world - 1) == "left", done.stdout + done.stderr[-3000:]
    for r in range(world - 1):
        text = said.get(r, "")
        assert text.startswith("raised RuntimeError after "), (r, done.stdout, done.stderr[-3000:])
        assert int(text.split(" after ", 1)[1].split(" s:", 1)[0]) < 30, (r, text)
        assert f"xcoll.gather: a collective did not complete on rank {r}: " in text, (r, text)
        assert f"rank {world - 1} has left (its process exited) after its call 3 on the group, xcoll.gather (" in text, (r, text)


def _two_said_they_left(_):
    """Ranks 2 and 3 of a group of its own say they left (in the job's real
    store, as their exit hook does); rank 0 reads who left."""
    import torch.distributed as dist

    from xcoll._backends import current
    from xcoll._guard import leaving

    group = dist.new_group()  # (its keys are its own: the pool's world is left alone)
    t = current(group)
    if t.rank() >= 2:
        t.say_left(f"its call {t.rank()} on the group")
    xcoll.barrier(group=group)
    said = leaving.who_left(t) if t.rank() == 0 else None
    xcoll.barrier(group=group)
    dist.destroy_process_group(group)
    return said


def test_every_replica_that_said_it_left_is_named_once():
    said = shared_pool("gloo-4").run(_two_said_they_left, [None] * 4)[0]
    assert said == (
        "rank 2 of the group (global rank 2) has left (its process exited) after its call 2 on the group; "
        "rank 3 of the group (global rank 3) has left (its process exited) after its call 3 on the group; "
    ), said


def test_a_store_that_cannot_be_read_names_no_one():
    # (the store's host may be the replica that left: who_left then says
    # nothing, and the engine's own error stands)
    from xcoll._guard import leaving

    class StoreGone:
        def left(self):
            raise RuntimeError("connection reset by peer")

    assert leaving.who_left(StoreGone()) == ""


# ---- small calls whose sizes differ, in either direction ---------------------------

_SIZED = ["gather", "reduce", "broadcast", "reduce_scatter", "all_to_all"]


def _sizes_differ(args):
    """Every replica calls ``name`` on a float32 leaf of ``sizes[rank]``
    elements, one after another: each call's error text (or "returned"),
    then a consistent call's result."""
    name, sizes = args
    dev = device()
    xcoll.barrier()  # (a group's first call is checked in full: these are not)
    texts = []
    for per_rank in sizes:
        x = torch.arange(float(per_rank[xcoll.rank()])).to(dev)
        try:
            getattr(xcoll, name)({"x": x})
            texts.append("returned")
        except xcoll.CollectiveMismatchError as e:
            texts.append(str(e))
    return texts, xcoll.reduce(torch.ones(1).to(dev)).item()


@pytest.mark.parametrize("name", _SIZED)
@pytest.mark.parametrize("world", ["gloo-2", "gloo-4", "xla-cpu-2"])
def test_small_calls_whose_sizes_differ_raise_on_every_replica_in_either_direction(world, name):
    # 8 elements against 4 B more, 8 B, 1 KiB, and up to the size class
    # (960 elements: 3840 bytes and the header, which a reduce-scatter's
    # wire holds W times); rank 0 (a broadcast's src) holding the larger
    # tree, then the last rank. (A reduce-scatter's and an all-to-all's leaf
    # is cut into W parts: their sizes differ by W elements at least.)
    pool = shared_pool(world)
    w = pool.world_size
    step = w if name in ("reduce_scatter", "all_to_all") else 1
    base = 8 * step
    more = [max(d, step) for d in (1, 2, 256)] + [960 - base]
    sizes = []
    for m in more:
        for big in (0, w - 1):
            sizes.append([base + m if r == big else base for r in range(w)])
    for r, (texts, after) in enumerate(pool.run(_sizes_differ, [(name, sizes)] * w, timeout=120)):
        assert after == w, (r, texts)  # (the group goes on)
        for per_rank, text in zip(sizes, texts, strict=True):
            assert text.startswith(f"xcoll.{name}: replicas made different calls"), (r, per_rank, text)
            assert "tree['x']: float32 tensor of shape" in text, (r, per_rank, text)
