"""Where one replica's time goes in ``xcoll.gather(tree, to_cpu=True)``.

    python -m bench.profile [--leaves 256] [--calls 200]

Runs one XLA:CPU replica in this process (W=1: no other replica thread competes
for the GIL) on a :mod:`bench.trees` tree, and prints the wall time per call of
xcoll, of its packing floor (:func:`bench.xla.pack_floor_gather`) and of the ideal
(:func:`bench.xla.ideal_gather`), then cProfile's top entries for xcoll.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--leaves", type=int, default=256)
    p.add_argument("--calls", type=int, default=200)
    a = p.parse_args(argv)

    from xcoll.testing import xla_cpu_env

    os.environ.update(xla_cpu_env(1))
    import torch_xla

    import xcoll
    from bench import trees, xla

    tree = trees.make(a.leaves, 0, torch_xla.device())
    calls = {
        "xcoll.gather(to_cpu=True)": lambda: xcoll.gather(tree, to_cpu=True),
        "(e) floor": xla.pack_floor_gather(tree),
        "(d) ideal": xla.ideal_gather(tree),
    }
    print(f"one XLA:CPU replica, {a.leaves} leaves, median of {a.calls} calls:")
    for name, call in calls.items():
        for _ in range(5):
            call()
        times = []
        for _ in range(a.calls):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        print(f"  {name:28s} {1e3 * sorted(times)[len(times) // 2]:.3f} ms")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(a.calls):
        calls["xcoll.gather(to_cpu=True)"]()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
