"""The first call of a gather, a reduce or a broadcast of many leaves, on XLA:CPU.

    python -m bench.first_calls [--leaves 1000 10000] [--replicas 2]
        [--ops gather reduce] [--outputs host]

For each op, each ``--outputs`` (``host``: ``to_cpu=True``; ``device``: the
results stay on the device) and each ``--leaves`` N, a fresh pool of XLA:CPU
replicas moves the benchmark's tree of N leaves (``bench.trees``: mixed dtypes
and shapes, different on every replica), twice, and checks the result. It
prints the first call's time (its programs compiled: XLA:CPU compiles a
computation of N parameters in time that grows faster than N, so a move's (or
a reduce's bucket) of more than ``xla_kernels.CHUNKED_FROM`` leaves is packed in
chunks whose program is compiled once; and a kernel per output, so device
outputs are cut at offsets that are parameters, one kernel per shape), the
second call's, and torch_xla's counts of compilations and executions in each
(all replicas together, as torch_xla counts them in one process).

Issue 36's check of device outputs (at most 2x the gather to the host)::

    python -m bench.first_calls --replicas 4 --leaves 1024 \\
        --ops gather reduce broadcast --outputs host device
"""

from __future__ import annotations

import argparse
import time

import torch

import xcoll
from xcoll.testing import XlaPool, xla_counters

from . import trees


def _expected(op: str, n: int, world: int) -> dict:
    """What ``op`` gives on the host: rows in rank order, replica 0's tree, or
    the sum (in float64: exact for 4 replicas of float16, close for float32)."""
    all_trees = [trees.make(n, r) for r in range(world)]
    if op == "broadcast":
        return all_trees[0]
    how = torch.cat if op == "gather" else lambda ts: torch.stack(ts).double().sum(0)
    return {
        g: {k: how([t[g][k] for t in all_trees]).to(leaf.dtype) for k, leaf in group.items()}
        for g, group in all_trees[0].items()
    }


def _same(op: str, got: torch.Tensor, want: torch.Tensor) -> bool:
    if op != "reduce" or not want.is_floating_point():
        return torch.equal(got, want)
    # (a float32 sum's order is the engine's: within a few ulps of the largest term)
    return torch.allclose(got.double(), want.double(), rtol=0, atol=1e-3)


def _calls(args: tuple[int, str, bool]) -> dict:
    import torch_xla

    n, op, to_cpu = args
    call = getattr(xcoll, op)
    tree = trees.make(n, xcoll.rank(), torch_xla.device())
    xcoll.sync()
    xcoll.gather(xcoll.rank())  # (a replica's first call is checked in full: not the measured one)
    out: dict = {}
    for name in ("first", "second"):
        before = xla_counters()
        t0 = time.perf_counter()
        got = call(tree, to_cpu=to_cpu)
        if not to_cpu:
            xcoll.sync()  # (the outputs made: the call's one execution)
        out[name] = time.perf_counter() - t0
        xcoll.barrier(name)
        after = xla_counters()
        out[f"{name} counts"] = {k: after[k] - before[k] for k in after}
    want = _expected(op, n, xcoll.world_size())
    out["differ"] = [
        f"{g}.{k}"
        for g, group in want.items()
        for k, w in group.items()
        if not _same(op, got[g][k].cpu(), w)
    ]
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--leaves", type=int, nargs="+", default=[1000, 10000])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--ops", nargs="+", default=["gather", "reduce"],
                   choices=["gather", "reduce", "broadcast"])
    p.add_argument("--outputs", nargs="+", default=["host"], choices=["host", "device"])
    a = p.parse_args(argv)
    print(f"XLA:CPU W={a.replicas}: xcoll.<op>(tree) of N leaves (bench.trees)")
    print(
        "| op | outputs | leaves | first call s | compiles, executions "
        "| second call ms | compiles, executions |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    rows = []
    for op in a.ops:
        for outputs in a.outputs:
            for n in a.leaves:
                with XlaPool(a.replicas, timeout=1200) as pool:
                    got = pool.run(_calls, [(n, op, outputs == "host")] * a.replicas)[0]
                assert not got["differ"], f"{op} of {n} leaves: {got['differ'][:5]} differ"
                c1, c2 = got["first counts"], got["second counts"]
                print(
                    f"| {op} | {outputs} | {n} | {got['first']:.2f} "
                    f"| {c1['compiles']}, {c1['executions']} "
                    f"| {1000 * got['second']:.1f} | {c2['compiles']}, {c2['executions']} |",
                    flush=True,
                )
                rows.append({"op": op, "outputs": outputs, "leaves": n, **got})
    return rows


if __name__ == "__main__":
    main()
