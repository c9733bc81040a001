"""A call of many leaves on XLA: a move's segment (a reduce's bucket) of
more than ``CHUNKED_FROM`` leaves of one dtype is packed in chunks, each chunk's program compiled once
for every chunk of its shapes and run before the call's (XLA:CPU compiles
one computation of N parameters in time that grows faster than N: a first
gather of 10,000 leaves took minutes). The results are the same bits."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import optree
import pytest
import torch

import xcoll
from tests.replicas import counters, device, shared_pool, to_cpu, to_device


def _tree(n: int, width: int = 2) -> dict:
    """``n`` float32 leaves of ``width`` elements (one holding a NaN with a payload),
    and a few of other dtypes, shapes and sizes, per rank."""
    r = xcoll.rank()
    nan = torch.tensor([0x7FC01234], dtype=torch.int32).view(torch.float32)
    floats = {f"f{i}": torch.tensor([i + 0.5 * r, -i]).repeat(width // 2) for i in range(n)}
    floats["f0"] = torch.cat([nan, torch.tensor([1.0 + r])]).repeat(width // 2)
    other = {
        "b": torch.tensor([True, r == 0]),
        "h": torch.arange(3, dtype=torch.bfloat16) + r,
        "z": torch.tensor(7.0 + r),
        "e": torch.zeros(0, 4),
        "step": 10 + r,
    }
    # (a reduce widens the int16 leaves into the int32 bucket: merged)
    ints = {
        f"i{j}": torch.arange(3, dtype=torch.int32 if j < 3 else torch.int16) + r for j in range(5)
    }
    other["ints"] = ints
    return {"floats": floats, "other": other}


def _bits(tree) -> list[tuple[str, bytes]]:
    """Every leaf's path and bits (a Python value's repr)."""
    paths, leaves, _ = optree.tree_flatten_with_path(to_cpu(tree))
    return [
        (
            str(p),
            repr((v.dtype, tuple(v.shape))).encode()
            + v.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            if isinstance(v, torch.Tensor)
            else repr(v).encode(),
        )
        for p, v in zip(paths, leaves, strict=True)
    ]


@contextlib.contextmanager
def _chunks_of(size: int, above: int) -> Iterator[None]:
    """Within the block, chunks of ``size`` parts from ``above`` parts, on
    every replica: the replica threads share the module, so rank 0 sets the
    values and restores them, between barriers."""
    from xcoll._backends import xla_kernels

    saved = xla_kernels.CHUNK, xla_kernels.CHUNKED_FROM
    xcoll.barrier("chunks set")
    if xcoll.rank() == 0:
        xla_kernels.CHUNK, xla_kernels.CHUNKED_FROM = size, above
    xcoll.barrier("chunks in force")
    try:
        yield
    finally:
        xcoll.barrier("chunks done")
        if xcoll.rank() == 0:
            xla_kernels.CHUNK, xla_kernels.CHUNKED_FROM = saved


def _small_chunks(_):
    """Each call of a tree of 11 float32 leaves (and 5 integer ones that a
    reduce merges), packed whole and in chunks of 3 (``CHUNKED_FROM`` 4), on
    every replica: the same bits."""

    dev = device()
    tree = to_device(_tree(11, 128), dev)  # (above the hosted size)
    calls = [
        lambda: xcoll.gather(tree, to_cpu=True),
        lambda: xcoll.gather(tree),
        lambda: xcoll.gather(tree, stack=True, to_cpu=True),
        lambda: xcoll.broadcast(tree, src=1),
        lambda: xcoll.broadcast(tree, src=0, to_cpu=True),
        lambda: xcoll.reduce(tree, "max"),
        lambda: xcoll.reduce(tree["floats"], "mean", to_cpu=True),
        lambda: xcoll.reduce(tree["other"]["ints"], "sum"),
    ]
    whole = [_bits(f()) for f in calls]
    with _chunks_of(3, above=4):
        chunked = [_bits(f()) for f in calls]
    return [a == b for a, b in zip(whole, chunked, strict=True)]


def test_a_move_packed_in_chunks_gives_the_same_bits():
    pool = shared_pool("xla-cpu-2")
    assert pool.run(_small_chunks, [None, None]) == [[True] * 8] * 2


_STATE: dict[int, dict] = {}


def _first_call(args):
    n, op = args
    dev = device()
    tree = to_device(_tree(n), dev)
    if op == "reduce":  # (a sum: of the float leaves and the 0-d one)
        tree = {"floats": tree["floats"], "other": {"z": tree["other"]["z"]}}
    call = getattr(xcoll, op)
    xcoll.sync()
    xcoll.gather(xcoll.rank())  # (a replica's first call is checked: not the measured one)
    before = counters()
    out = call(tree, to_cpu=True)
    xcoll.barrier("counted")
    first = counters()
    call(tree, to_cpu=True)
    xcoll.barrier("counted again")
    second = counters()

    def expected(i: int) -> list[float]:
        return [i, -i, i + 0.5, -i] if op == "gather" else [2 * i + 0.5, -2 * i]

    exact = all(
        torch.equal(out["floats"][f"f{i}"], torch.tensor(expected(i))) for i in range(1, n)
    ) and torch.equal(out["other"]["z"], torch.tensor([7.0, 8.0] if op == "gather" else 15.0))
    diff = lambda a, b: {k: b[k] - a[k] for k in ("executions", "compiles")}  # noqa: E731
    from xcoll._backends import xla_kernels

    # (the call's own join, or encoding, took a chunk's buffer as a part)
    own = xla_kernels.Join if op == "gather" else xla_kernels.EncodeReduce
    keys = [k for k in list(xla_kernels._computations._values) if isinstance(k, own)]
    layouts = [k.joined.shapes if op == "gather" else k.shapes for k in keys]
    chunked = any((2 * xla_kernels.CHUNK,) in shapes for layout in layouts for shapes in layout)
    return exact, chunked, diff(before, first), diff(first, second)


@pytest.mark.parametrize("op", ["gather", "reduce"])
def test_a_first_call_of_thousands_of_leaves_compiles_a_few_programs(op):
    # 3,000 float32 leaves and a 0-d one (re-uploaded: pending): every full
    # chunk of xla_kernels.CHUNK packed ahead, each by one program; the last chunk's
    # leaves and the 0-d one stay parts of the call's own program (a pending
    # leaf stays in its chunk). At most three programs then (gather's and reduce's packs are
    # the same program), each compiled once (a replica may compile one that
    # the other compiled meanwhile: at most twice), and a second call
    # compiles nothing. (torch_xla counts an execution when it ends, so the
    # chunks' executions, run asynchronously, are not counted here.)
    pool = shared_pool("xla-cpu-2")
    for exact, chunked, first, second in pool.run(_first_call, [(3000, op)] * 2):
        assert exact and chunked
        assert first["compiles"] <= 2 * 3, first
        assert second["compiles"] == 0, second


def _pending(_):
    """A ``sync=False`` gather of 11 pending leaves, chunked from 4: nothing
    runs before the caller's sync (a chunk's program would run the caller's
    pending work again), and the values are right after it."""

    dev = device()
    tree = to_device(_tree(11, 128), dev)["floats"]
    xcoll.sync()
    with _chunks_of(3, above=4):
        pending = {k: v * 2 for k, v in tree.items()}
        before = counters()["executions"]
        out = xcoll.gather(pending, sync=False)
        ran = counters()["executions"] - before
        xcoll.sync()
    whole = xcoll.gather({k: v * 2 for k, v in tree.items()}, to_cpu=True)
    return ran, _bits(out) == _bits(whole)


def test_pending_leaves_are_joined_whole_without_an_execution():
    pool = shared_pool("xla-cpu-2")
    assert pool.run(_pending, [None, None]) == [(0, True)] * 2
