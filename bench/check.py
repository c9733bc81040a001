"""Cost of xcoll's cross-replica consistency check and of planning an op tree.

    python -m bench.check [--replicas 4] [--repeats 50]

Times, in one run, median ms per call on rank 0:

* ``xcoll.gather`` of float32 leaves of shape (8, 16) (8 and 256 leaves) with the
  check on every call (``"always"``) and off (``"never"``), on XLA:CPU replicas
  (``--replicas``) and on gloo processes (``--replicas`` and 2), with the ratio,
  and (XLA) graph executions per call per replica;
* on gloo W=2, ``xcoll.reduce`` of 64 such leaves with ``op="sum"`` and with a
  dict holding an op per leaf (planned once per tree signature, like a str).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from xcoll.testing import GlooPool, XlaPool, xla_counters


def _device() -> torch.device:
    from xcoll import _backends

    if _backends.xla_runtime_running():
        import torch_xla

        return torch_xla.device()
    return torch.device("cpu")


def measure(args: tuple[tuple[tuple[str, str], ...], int, int]) -> list[float]:
    """Median seconds per call of each variant ``(what, check mode)``, ``what``
    one of "gather", "reduce-sum", "reduce-dict". The variants alternate call by
    call, so that each sees the same conditions (on 2 cores a gloo call's time
    drifts by 2x over seconds)."""
    import xcoll

    variants, leaves, repeats = args
    dev = _device()
    g = torch.Generator().manual_seed(xcoll.rank())
    tree = {f"leaf{i:03d}": torch.randn(8, 16, generator=g).to(dev) for i in range(leaves)}
    ops = {k: "sum" for k in tree}
    times: list[list[float]] = [[] for _ in variants]
    for _ in range(3 + repeats):
        for (what, mode), t in zip(variants, times, strict=True):
            with xcoll.consistency_checks(mode):
                t0 = time.perf_counter()
                if what == "gather":
                    xcoll.gather(tree, to_cpu=True)
                else:
                    out = xcoll.reduce(tree, ops if what == "reduce-dict" else "sum")
                    out["leaf000"].cpu()  # waits for the result, as a user reading it would
                t.append(time.perf_counter() - t0)
    return [statistics.median(t[3:]) for t in times]


def _time(pool, args, counted: bool) -> tuple[list[float], str]:
    """Rank 0's medians, and (``counted``) executions per call per replica."""
    w = pool.world_size
    pool.run(measure, [(*args[:2], 1)] * w)  # compile, plan, first-call check
    c0 = pool.run(xla_counters)[0] if counted else None
    t = pool.run(measure, [args] * w)[0]
    if c0 is None:
        return t, ""
    c1 = pool.run(xla_counters)[0]
    calls = (3 + args[2]) * len(args[0]) * w
    return t, f"{(c1['executions'] - c0['executions']) / calls:g}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--repeats", type=int, default=50)
    a = p.parse_args(argv)
    w, n = a.replicas, a.repeats
    print("xcoll.gather(float32 (8, 16) leaves, to_cpu=True); median ms per call on rank 0\n")
    print(
        "| engine | W | leaves | check never | check always | always / never "
        "| executions per call, always |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    pools = [("XLA:CPU", XlaPool(w))] + [("gloo", GlooPool(k)) for k in sorted({w, 2})]
    for name, pool in pools:
        with pool:
            for leaves in (8, 256):
                (never, always), _ = _time(
                    pool, ((("gather", "never"), ("gather", "always")), leaves, n), False
                )
                _, ex = (
                    _time(pool, ((("gather", "always"),), leaves, 5), True)
                    if name == "XLA:CPU"
                    else (None, "")
                )
                print(
                    f"| {name} | {pool.world_size} | {leaves} | {never * 1e3:.2f} | "
                    f"{always * 1e3:.2f} | {always / never:.2f}x | {ex} |"
                )
            if name == "gloo" and pool.world_size == 2:
                variants = (("reduce-sum", "never"), ("reduce-dict", "never"))
                (summed, per_leaf), _ = _time(pool, (variants, 64, n), False)
                reduce_line = (
                    f'\ngloo W=2, xcoll.reduce of 64 float32 (8, 16) leaves: op="sum" '
                    f"{summed * 1e3:.2f} ms, a dict of 64 ops {per_leaf * 1e3:.2f} ms "
                    f"({per_leaf / summed:.2f}x)"
                )
    print(reduce_line)


if __name__ == "__main__":
    main()
