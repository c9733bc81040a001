"""Per-call cost of gathering a tree on W XLA:CPU replicas: xcoll against the
per-leaf patterns it replaces, measured side by side in one run.

    python -m bench.core [--replicas 4] [--leaves 8 64 256] [--repeats 20]

For each tree size (float32 leaves of shape (8, 16)) and method it prints the
median wall time per call on replica 0 after warm-up, and torch_xla's graph
executions and compilations per call (process-wide counts divided by W, i.e. per
replica). Methods:

* ``xcoll.gather``: device outputs, one call for the tree.
* ``xcoll.gather(to_cpu)``: the same, results on the host.
* ``per-leaf all_gather, one sync``: ``xm.all_gather(pin_layout=False)`` per leaf
  and one sync, the algorithm of accelerate's XLA gather (pinned layout cannot
  run on XLA:CPU replicas, see docs/design.md).
* ``per-leaf all_gather + sync``: one sync per leaf, the one-leaf-at-a-time pattern.
* ``one packed all_gather (ideal)``: one ``xm.all_gather`` of one pre-packed
  buffer of the same bytes: no packing or unpacking work at all.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from xcoll.testing import XlaPool, xla_counters

METHODS = [
    "xcoll.gather",
    "xcoll.gather(to_cpu)",
    "per-leaf all_gather, one sync",
    "per-leaf all_gather + sync",
    "one packed all_gather (ideal)",
]


def _wait(t: torch.Tensor) -> None:
    import torch_xla

    torch_xla._XLAC._xla_get_cpu_tensors([t])  # waits for this replica's execution only


def _once(method: str, tree: dict, packed: torch.Tensor):
    import torch_xla.core.xla_model as xm

    import xcoll
    from xcoll._backends.xla import sync  # the lock and one execution in flight

    if method == "xcoll.gather":
        out = xcoll.gather(tree)
        _wait(next(iter(out.values())))
    elif method == "xcoll.gather(to_cpu)":
        xcoll.gather(tree, to_cpu=True)
    elif method == "per-leaf all_gather, one sync":
        out = {k: xm.all_gather(v, pin_layout=False) for k, v in tree.items()}
        sync()
        _wait(next(iter(out.values())))
    elif method == "per-leaf all_gather + sync":
        for v in tree.values():
            out = xm.all_gather(v, pin_layout=False)
            sync()
        _wait(out)
    else:
        out = xm.all_gather(packed, pin_layout=False)
        sync()
        _wait(out)


def measure(args: tuple[str, int, int]) -> float:
    """Runs on every replica; returns the median seconds per call."""
    import torch_xla

    import xcoll

    method, n, repeats = args
    dev = torch_xla.device()
    g = torch.Generator().manual_seed(xcoll.rank())
    tree = {f"leaf{i:04d}": torch.randn(8, 16, generator=g).to(dev) for i in range(n)}
    packed = torch.randn(n * 8 * 16, generator=g).to(dev)
    for _ in range(3):
        _once(method, tree, packed)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _once(method, tree, packed)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--leaves", type=int, nargs="+", default=[8, 64, 256])
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args(argv)
    w = a.replicas
    print(f"W={w} XLA:CPU replicas, float32 leaves of shape (8, 16); per call, on replica 0\n")
    print("| leaves | method | median ms | executions | compiles | vs xcoll.gather |")
    print("|---:|---|---:|---:|---:|---:|")
    with XlaPool(w) as pool:
        for n in a.leaves:
            base = None
            for method in METHODS:
                pool.run(measure, [(method, n, 1)] * w)  # compile outside the count
                c0 = pool.run(xla_counters)[0]
                t = pool.run(measure, [(method, n, a.repeats)] * w)[0]
                c1 = pool.run(xla_counters)[0]
                calls = (3 + a.repeats) * w
                ex = (c1["executions"] - c0["executions"]) / calls
                co = (c1["compiles"] - c0["compiles"]) / calls
                base = base or t
                print(f"| {n} | {method} | {t * 1e3:.2f} | {ex:g} | {co:g} | {t / base:.2f}x |")


if __name__ == "__main__":
    main()
