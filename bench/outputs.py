"""What each output tensor of one XLA program costs on XLA:CPU.

    python -m bench.outputs [--outputs 1 256 1024] [--calls 20]

Runs one XLA:CPU replica in this process (W=1) and, for each ``--outputs`` N,
applies the XLA computation that cuts a buffer of N * 128 float32 into N
outputs of shape (8, 16) (``XlaKernels.split``: what ``xcoll.reduce`` or
``xcoll.broadcast`` with device outputs does with the leaves of a tree), then syncs. It prints the
first call's time and torch_xla's compile time, and the median time per call
after it (the computation applied, the graph run, its outputs waited for).

Why it is here: XLA:CPU compiles a kernel per output, and one that cuts at a
constant offset is a kernel of its own (1024 outputs: 30 s to compile); this
shows what ``xla_kernels.Split``, which takes the offsets as parameters (one kernel
per shape), costs per output instead.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--outputs", type=int, nargs="+", default=[1, 256, 1024])
    p.add_argument("--calls", type=int, default=20)
    a = p.parse_args(argv)

    from xcoll.testing import xla_cpu_env

    os.environ.update(xla_cpu_env(1))
    import torch
    import torch_xla
    import torch_xla.debug.metrics as met

    from xcoll._backends.xla_kernels import XlaKernels
    from xcoll._backends.xla_step import sync

    device = torch_xla.device()
    print("| outputs | first call s | compile s | median ms per call |")
    print("|---:|---:|---:|---:|")
    for n in a.outputs:
        buf = torch.randn(n * 128).to(device)
        sync(device)
        compiled = met.metric_data("CompileTime")
        before = compiled[1] if compiled else 0.0
        times = []
        for _ in range(1 + a.calls):
            t0 = time.perf_counter()
            (outs,) = XlaKernels().split([buf], [((8, 16),) * n])
            sync(device)  # (runs the graph and waits for it)
            times.append(time.perf_counter() - t0)
        compile_s = (met.metric_data("CompileTime")[1] - before) / 1e9
        assert len(outs) == n
        print(f"| {n} | {times[0]:.3g} | {compile_s:.3g} | {1e3 * statistics.median(times[1:]):.3g} |")


if __name__ == "__main__":
    main()
