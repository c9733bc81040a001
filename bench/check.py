"""Cost of xcoll's guard, of its full consistency check and of planning an op tree.

    python -m bench.check [--replicas 4] [--repeats 50] [--leaves 8 256]

Times, in one run, median ms per call on rank 0:

* ``xcoll.gather`` of float32 leaves of shape (8, 16) (8 and 256 leaves, or
  ``--leaves``) with
  the guard and the check off (``"never"``), with the guard (``"guard"``, the
  default) and with the check on every call (``"always"``), on XLA:CPU replicas
  (``--replicas``) and on gloo processes (``--replicas`` and 2), with the
  ratios, and (XLA) graph executions and collective ops per call per replica
  with the guard;
* the same for ``xcoll.reduce`` and ``xcoll.broadcast`` (``--replicas`` only);
* on gloo W=2, ``xcoll.reduce`` of 64 such leaves with ``op="sum"`` and with a
  dict holding an op per leaf (planned once per tree signature, like a str).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from xcoll.testing import GlooPool, XlaPool


def _device() -> torch.device:
    from xcoll import _backends

    if _backends.xla_runtime_running():
        import torch_xla

        return torch_xla.device()
    return torch.device("cpu")


def measure(args: tuple[tuple[tuple[str, str], ...], int, int]) -> list[float]:
    """Median seconds per call of each variant ``(what, check mode)``, ``what``
    one of "gather", "broadcast", "reduce-sum", "reduce-dict". The variants alternate call by
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
                elif what == "broadcast":
                    xcoll.broadcast(tree)["leaf000"].cpu()
                else:
                    out = xcoll.reduce(tree, ops if what == "reduce-dict" else "sum")
                    out["leaf000"].cpu()  # waits for the result, as a user reading it would
                t.append(time.perf_counter() - t0)
    return [statistics.median(t[3:]) for t in times]


def _time(pool, args, counted: bool) -> tuple[list[float], dict[str, float]]:
    """Rank 0's medians, and (``counted``) executions and collective ops per
    call per replica."""
    w = pool.world_size
    pool.run(measure, [(*args[:2], 1)] * w)  # compile, plan, first-call check
    c0 = pool.run(_counters)[0] if counted else None
    t = pool.run(measure, [args] * w)[0]
    if c0 is None:
        return t, {}
    c1 = pool.run(_counters)[0]
    calls = (3 + args[2]) * len(args[0]) * w
    return t, {k: (c1[k] - c0[k]) / calls for k in c0}


def _counters(_=None) -> dict[str, int]:
    from bench.xla import counters

    return counters()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--leaves", type=int, nargs="+", default=[8, 256])
    a = p.parse_args(argv)
    w, n = a.replicas, a.repeats
    print("float32 (8, 16) leaves; median ms per call on rank 0 (gather: to_cpu=True)\n")
    print(
        "| engine | W | call | leaves | never | guard | always | guard / never "
        "| always / never | executions, guard | collective ops, guard |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    pools = [("XLA:CPU", XlaPool(w))] + [("gloo", GlooPool(k)) for k in sorted({w, 2})]
    for name, pool in pools:
        xla = name == "XLA:CPU"
        calls = ["gather"] + (["reduce-sum", "broadcast"] if pool.world_size == w else [])
        with pool:
            for what in calls:
                for leaves in a.leaves:
                    modes = ("never", "guard", "always")
                    variants = tuple((what, m) for m in modes)
                    (never, guard, always), _ = _time(pool, (variants, leaves, n), False)
                    _, c = _time(pool, (((what, "guard"),), leaves, 5), True) if xla else (0, {})
                    ex = f"{c['executions']:g}" if c else ""
                    ops = f"{c['collectives']:g}" if c else ""
                    print(
                        f"| {name} | {pool.world_size} | {what.removesuffix('-sum')} | {leaves} | "
                        f"{never * 1e3:.2f} | {guard * 1e3:.2f} | {always * 1e3:.2f} | "
                        f"{guard / never:.2f}x | {always / never:.2f}x | {ex} | {ops} |"
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
