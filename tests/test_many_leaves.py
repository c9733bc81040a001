"""A move of many leaves on XLA: a segment of more than ``CHUNKED_FROM``
leaves of one dtype is packed in chunks, each chunk's program compiled once
for every chunk of its shapes and run before the call's (XLA:CPU compiles
one computation of N parameters in time that grows faster than N: a first
gather of 10,000 leaves took minutes). The results are the same bits."""

from __future__ import annotations

import math

import optree
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


def _small_chunks(_):
    """Each call of a tree of 11 float32 leaves, packed whole and in chunks of
    3 (``CHUNKED_FROM`` 4), on every replica: the same bits."""
    from xcoll._backends import xla

    dev = device()
    tree = to_device(_tree(11, 128), dev)  # (above the hosted size)
    calls = [
        lambda: xcoll.gather(tree, to_cpu=True),
        lambda: xcoll.gather(tree),
        lambda: xcoll.gather(tree, stack=True, to_cpu=True),
        lambda: xcoll.broadcast(tree, src=1),
        lambda: xcoll.broadcast(tree, src=0, to_cpu=True),
    ]
    whole = [_bits(f()) for f in calls]
    saved = xla.CHUNKED_FROM, xla.CHUNK
    xla.CHUNKED_FROM, xla.CHUNK = 4, 3
    try:
        chunked = [_bits(f()) for f in calls]
    finally:
        xla.CHUNKED_FROM, xla.CHUNK = saved
    return [a == b for a, b in zip(whole, chunked, strict=True)]


def test_a_move_packed_in_chunks_gives_the_same_bits():
    pool = shared_pool("xla-cpu-2")
    assert pool.run(_small_chunks, [None, None]) == [[True] * 5] * 2


_STATE: dict[int, dict] = {}


def _first_call(n):
    dev = device()
    tree = to_device(_tree(n), dev)
    xcoll.sync()
    xcoll.gather(xcoll.rank())  # (a replica's first call is checked: not the measured one)
    before = counters()
    out = xcoll.gather(tree, to_cpu=True)
    xcoll.barrier("counted")
    first = counters()
    xcoll.gather(tree, to_cpu=True)
    xcoll.barrier("counted again")
    second = counters()
    r = xcoll.rank()
    exact = (
        all(
            torch.equal(out["floats"][f"f{i}"], torch.tensor([i, -i, i + 0.5, -i]))
            for i in range(1, n)
        )
        and out["other"]["step"] == [10, 11]
        and r in (0, 1)
    )
    diff = lambda a, b: {k: b[k] - a[k] for k in ("executions", "compiles")}  # noqa: E731
    return exact, diff(before, first), diff(first, second)


def test_a_first_gather_of_thousands_of_leaves_compiles_a_few_programs():
    # 3,000 float32 leaves: 6 chunks (5 of 512, one of 440), so at most three
    # programs, each compiled once (a replica may compile one that the other
    # compiled meanwhile: at most twice), run with the call's own; a second
    # call compiles nothing.
    from xcoll._backends import xla

    n = 3000
    pool = shared_pool("xla-cpu-2")
    chunks = math.ceil(n / xla.CHUNK)
    results = pool.run(_first_call, [n, n])
    for exact, first, second in results:
        assert exact
        assert first["compiles"] <= 2 * 3, first
        assert second["compiles"] == 0, second
        # (process-wide counts: both replicas' executions, and barriers')
        assert first["executions"] >= 2 * (chunks + 1), first


def _pending(_):
    """A ``sync=False`` gather of 11 pending leaves, chunked from 4: nothing
    runs before the caller's sync (a chunk's program would run the caller's
    pending work again), and the values are right after it."""
    from xcoll._backends import xla

    dev = device()
    tree = to_device(_tree(11, 128), dev)["floats"]
    xcoll.sync()
    saved = xla.CHUNKED_FROM, xla.CHUNK
    xla.CHUNKED_FROM, xla.CHUNK = 4, 3
    try:
        pending = {k: v * 2 for k, v in tree.items()}
        before = counters()["executions"]
        out = xcoll.gather(pending, sync=False)
        ran = counters()["executions"] - before
    finally:
        xla.CHUNKED_FROM, xla.CHUNK = saved
    xcoll.sync()
    r = xcoll.rank()
    whole = xcoll.gather({k: v * 2 for k, v in tree.items()}, to_cpu=True)
    return ran, _bits(out) == _bits(whole) and r in (0, 1)


def test_pending_leaves_are_joined_whole_without_an_execution():
    pool = shared_pool("xla-cpu-2")
    assert pool.run(_pending, [None, None]) == [(0, True)] * 2
