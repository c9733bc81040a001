"""Host work per call on XLA, counted: Python-level function calls (``sys.setprofile``
'call' and 'c_call' events) of one warm call on rank 0 of an XLA:CPU pool of 2
replicas, small calls hosted (the default) and forced into the caller's program
(``pack.SMALL = 0``), beside a plain ``xm.all_reduce`` with its sync and fetch.
Deterministic, unlike wall time on a shared machine (gloo's counterpart:
``../shared/tools/host_work.py``).

    python -m bench.host_work
"""

from __future__ import annotations

import sys

import torch

import xcoll
from xcoll.testing import XlaPool


def _count(small: int) -> dict[str, int]:
    import torch_xla
    import torch_xla.core.xla_model as xm

    from xcoll._encode import pack

    pack.SMALL = small
    rank, dev = xcoll.rank(), torch_xla.device()
    one = torch.tensor([1.5 + rank]).to(dev)
    metrics = {k: torch.tensor(v + rank).to(dev) for k, v in (("loss", 0.25), ("correct", 3.0), ("n", 8.0))}

    def plain():
        out = xm.all_reduce(xm.REDUCE_SUM, one.clone(), pin_layout=False)
        torch_xla.sync()  # (xcoll's own step on XLA:CPU replica threads, from its first call)
        return torch_xla._XLAC._xla_get_cpu_tensors([out])

    cells = {
        "reduce, 1 leaf": lambda: xcoll.reduce(one),
        "gather, 1 leaf": lambda: xcoll.gather(one),
        "broadcast, 1 leaf": lambda: xcoll.broadcast(one, src=0),
        "reduce, 3-leaf metrics": lambda: xcoll.reduce(metrics),
        "plain xm.all_reduce + sync + fetch": plain,
    }
    counts = {}
    for name, call in cells.items():
        for _ in range(5):
            call()
        n = [0]
        if rank == 0:
            sys.setprofile(lambda frame, event, arg, n=n: _tick(n, event))
        call()
        sys.setprofile(None)
        counts[name] = n[0]
    return counts


def _tick(n: list[int], event: str) -> None:
    if event in ("call", "c_call"):
        n[0] += 1


def main() -> None:
    for small, label in ((4096, "small calls hosted"), (0, "in the caller's program")):
        with XlaPool(2) as pool:
            print(label, pool.run(_count, [small, small])[0], flush=True)


if __name__ == "__main__":
    main()
