"""The first call of a gather and of a reduce of many leaves, on XLA:CPU W=2.

    python -m bench.first_calls [--leaves 1000 10000] [--replicas 2]

For each ``--leaves`` N and each op, a fresh pool of XLA:CPU replicas gathers
(or sum-reduces) a dict of N float32 leaves of 2 elements to the host
(``to_cpu=True``), twice. It
prints the first call's time (its programs compiled: XLA:CPU compiles a
computation of N parameters in time that grows faster than N, so a move's
(or a reduce's bucket) of more than ``xla.CHUNKED_FROM`` leaves is packed in chunks whose
program is compiled once), the second call's, and torch_xla's counts of
compilations and executions in each (both replicas together, as torch_xla
counts them in one process).
"""

from __future__ import annotations

import argparse
import time

import torch

import xcoll
from xcoll.testing import XlaPool, xla_counters


def _calls(args: tuple[int, str]) -> dict:
    import torch_xla

    n, op = args
    call = getattr(xcoll, op)

    dev = torch_xla.device()
    r = xcoll.rank()
    tree = {f"k{i}": torch.full((2,), float(i + r)).to(dev) for i in range(n)}
    xcoll.sync()
    xcoll.gather(r)  # (a replica's first call is checked in full: not the measured one)
    out: dict = {}
    for name in ("first", "second"):
        before = xla_counters()
        t0 = time.perf_counter()
        got = call(tree, to_cpu=True)
        out[name] = time.perf_counter() - t0
        xcoll.barrier(name)
        after = xla_counters()
        out[f"{name} counts"] = {k: after[k] - before[k] for k in after}

    # (every leaf's rows, in rank order; or its sum over the 2 replicas)
    def expected(i: int) -> list[float]:
        return [i, i, i + 1, i + 1] if op == "gather" else [2 * i + 1, 2 * i + 1]

    out["exact"] = all(
        torch.equal(got[f"k{i}"], torch.tensor(expected(i), dtype=torch.float32)) for i in range(n)
    )
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--leaves", type=int, nargs="+", default=[1000, 10000])
    p.add_argument("--replicas", type=int, default=2)
    a = p.parse_args(argv)
    print(
        f"XLA:CPU W={a.replicas}: xcoll.<op>(tree, to_cpu=True) of N float32 leaves of 2 elements"
    )
    print(
        "| op | leaves | first call s | compiles, executions | second call ms | compiles, executions |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    rows = []
    for op, n in [(op, n) for op in ("gather", "reduce") for n in a.leaves]:
        with XlaPool(a.replicas, timeout=1200) as pool:
            got = pool.run(_calls, [(n, op)] * a.replicas)[0]
        assert got["exact"], f"{op} of {n} leaves: the results differ from the leaves'"
        c1, c2 = got["first counts"], got["second counts"]
        print(
            f"| {op} | {n} | {got['first']:.2f} | {c1['compiles']}, {c1['executions']} "
            f"| {1000 * got['second']:.1f} | {c2['compiles']}, {c2['executions']} |",
            flush=True,
        )
        rows.append({"op": op, "leaves": n, **got})
    return rows


if __name__ == "__main__":
    main()
