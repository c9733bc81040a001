"""Cost of xcoll's cross-replica consistency check, per call.

    python -m bench.check [--replicas 4] [--repeats 50]

Times ``xcoll.gather`` of a small tree (8 float32 leaves of shape (8, 16)) with
the check on every call (``"always"``) and off (``"never"``), on XLA:CPU replicas
and on gloo processes, in one run; prints the median ms per call on rank 0, the
difference, and (XLA) graph executions per call per replica.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from xcoll.testing import GlooPool, XlaPool, xla_counters


def measure(args: tuple[str, int]) -> float:
    import xcoll

    mode, repeats = args
    dev = torch.device("cpu")
    from xcoll import _backends

    if _backends._xla_runtime_running():
        import torch_xla

        dev = torch_xla.device()
    tree = {f"leaf{i}": torch.randn(8, 16).to(dev) for i in range(8)}
    times = []
    with xcoll.consistency_checks(mode):
        for _ in range(3 + repeats):
            t0 = time.perf_counter()
            xcoll.gather(tree, to_cpu=True)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[3:])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--repeats", type=int, default=50)
    a = p.parse_args(argv)
    w = a.replicas
    print(
        f"W={w}; xcoll.gather(8 float32 (8, 16) leaves, to_cpu=True); median ms per call on rank 0\n"
    )
    print(
        "| engine | check never | check always | cost of the check | executions per call, always |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, pool in (("XLA:CPU", XlaPool(w)), ("gloo", GlooPool(w))):
        with pool:
            t = {}
            for mode in ("never", "always"):
                pool.run(measure, [(mode, 1)] * w)  # compile
                c0 = pool.run(xla_counters)[0] if name == "XLA:CPU" else None
                t[mode] = pool.run(measure, [(mode, a.repeats)] * w)[0]
                c1 = pool.run(xla_counters)[0] if name == "XLA:CPU" else None
            ex = (
                ""
                if c0 is None
                else f"{(c1['executions'] - c0['executions']) / ((3 + a.repeats) * w):g}"
            )
            print(
                f"| {name} | {t['never'] * 1e3:.2f} | {t['always'] * 1e3:.2f} | "
                f"{(t['always'] - t['never']) * 1e3:+.2f} | {ex} |"
            )


if __name__ == "__main__":
    main()
