"""Peak memory of one call on one large leaf, xcoll against the same
out-of-place operation done directly with torch.distributed, on W gloo
processes.

    python -m bench.memory [--mib 1024] [--replicas 2]

Each cell runs in fresh processes (a process's peak resident size only grows):
a float32 leaf of ``--mib`` MiB is made and touched, then one call; the cell is
the rise of rank 0's peak resident size over the leaf (``ru_maxrss``), so the
input itself is not counted.
"""

from __future__ import annotations

import argparse

from xcoll.testing import GlooPool

#: The peer: the same operation with torch.distributed, into a new tensor.
DIRECT = "torch.distributed, out of place"


def _run(args: tuple[str, str, int]) -> float:
    import resource

    import torch
    import torch.distributed as dist

    import xcoll

    op, method, n = args
    x = torch.empty(n).fill_(1.0 + dist.get_rank())
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if method == "xcoll":
        out = {"gather": xcoll.gather, "reduce": xcoll.reduce, "broadcast": xcoll.broadcast}[op](x)
    elif op == "gather":
        out = torch.empty(dist.get_world_size() * n)
        dist.all_gather_into_tensor(out, x)
    elif op == "reduce":
        out = x.clone()
        dist.all_reduce(out)
    else:
        out = x.clone() if dist.get_rank() == 0 else torch.empty_like(x)
        dist.broadcast(out, 0)
    assert out.numel() in (n, dist.get_world_size() * n)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 2**20  # KiB -> GiB


OPS = ("gather", "reduce", "broadcast")


def measure(mib: int, world: int, ops: tuple[str, ...] = OPS, log=print) -> list[dict]:
    """One row per op of ``ops``: the peak rise of each method, in GiB, and
    their ratio."""
    n = mib * 2**20 // 4
    rows = []
    for op in ops:
        row = {"op": op, "mib": mib, "world": world}
        for method in ("xcoll", DIRECT):
            with GlooPool(world, timeout=1800) as pool:
                row[method] = pool.run(_run, [(op, method, n)] * world)[0]
        row["ratio"] = row["xcoll"] / max(row[DIRECT], 1e-9)
        log(
            f"memory {op:>9}: xcoll {row['xcoll']:.2f} GiB, direct {row[DIRECT]:.2f} GiB, "
            f"{row['ratio']:.2f}x"
        )
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--replicas", type=int, default=2)
    a = p.parse_args(argv)
    measure(a.mib, a.replicas)


if __name__ == "__main__":
    main()
