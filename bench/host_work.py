"""Host work per call, counted: Python-level function calls (``sys.setprofile``
'call' and 'c_call' events) of one warm call on rank 0 of a world of 2, on gloo
and on XLA:CPU (small calls hosted, the default), each beside its plain engine
call: ``dist.all_reduce``, and ``xm.all_reduce`` with its sync and fetch.
Deterministic, unlike wall time on a shared machine (the least of three
calls: see :func:`_counted`); ``tests/test_host_work.py`` asserts the counts.

    python -m bench.host_work
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import xcoll
from xcoll.testing import GlooPool, XlaPool

#: The cells, in the order printed; the plain engine call's is "plain".
CELLS = (
    "reduce, 1 leaf",
    "gather, 1 leaf",
    "broadcast, 1 leaf",
    "reduce, 3-leaf metrics",
    "gather grad=True, 1 leaf",
    "reduce in a step, 1 leaf",
    "plain",
)


def _calls(dev: torch.device, plain: Callable[[torch.Tensor], Any]) -> dict[str, Callable]:
    rank = xcoll.rank()
    one = torch.tensor([1.5 + rank]).to(dev)
    metrics = {
        k: torch.tensor(v + rank).to(dev) for k, v in (("loss", 0.25), ("correct", 3.0), ("n", 8.0))
    }
    x = torch.randn(4, 3).to(dev).requires_grad_()
    calls = (
        lambda: xcoll.reduce(one),
        lambda: xcoll.gather(one),
        lambda: xcoll.broadcast(one, src=0),
        lambda: xcoll.reduce(metrics),
        lambda: xcoll.gather(x, grad=True),
        lambda: _in_a_step(one),
        lambda: plain(one),
    )
    return dict(zip(CELLS, calls, strict=True))


def _in_a_step(one: torch.Tensor) -> Any:
    """A reduce tagged by its step block: its place is read each call."""
    with xcoll.step("eval"):
        return xcoll.reduce(one)


def _plain_xla(one: torch.Tensor) -> Any:
    import torch_xla
    import torch_xla.core.xla_model as xm

    out = xm.all_reduce(xm.REDUCE_SUM, one.clone(), pin_layout=False)
    torch_xla.sync()  # (xcoll's own step on XLA:CPU replica threads, from its first call)
    return torch_xla._XLAC._xla_get_cpu_tensors([out])


def _plain_dist(one: torch.Tensor) -> Any:
    import torch.distributed as dist

    return dist.all_reduce(one.clone())


def count(_: Any = None) -> dict[str, int]:
    """Rank 0's count per cell (the other ranks' calls are not counted), in
    a replica of a gloo or an XLA pool."""
    if xcoll.rank() == 0 and sys.getprofile() is not None:
        raise RuntimeError("a profiler or debugger is attached: it would be counted")
    dev = _device()
    cells = _calls(dev, _plain_dist if dev.type == "cpu" else _plain_xla)
    counts = {}
    for name, call in cells.items():
        for _ in range(5):
            call()
        counts[name] = min(_counted(call) for _ in range(3))
    return counts


#: torch_xla's collectives, as xcoll calls them (a torch.distributed process
#: group's methods are not seen by a profiler: for them the frame that calls
#: them, ``DistTransport._start``, is counted).
ENGINE = {"_xla_all_gather", "_xla_all_reduce", "_xla_all_to_all", "_xla_reduce_scatter"}
_XCOLL = str(Path(xcoll.__file__).parent)
_POOLS = str(Path(xcoll.__file__).parent / "testing")
_DIST = str(Path(xcoll.__file__).parent / "_backends" / "dist.py")


def frames(_: Any = None) -> dict[str, int]:
    """Rank 0's most xcoll frames on the stack when a warm call reaches its
    engine's collective, per cell: from the public function (its frame
    included) to the frame that calls the engine. A large gather (64 KiB,
    not a small call) is counted too."""
    dev = _device()
    cells = _calls(dev, _plain_dist if dev.type == "cpu" else _plain_xla)
    del cells["plain"]
    big = torch.zeros(16384).to(dev)
    cells["gather, 64 KiB"] = lambda: xcoll.gather(big)
    out = {}
    for name, call in cells.items():
        for _ in range(3):
            call()
        out[name] = _depth(call)
    return out


def _depth(call: Callable[[], Any]) -> int:
    deepest = [0]
    if xcoll.rank() == 0:
        sys.setprofile(lambda frame, event, arg: _deepest(deepest, frame, event, arg))
    call()
    sys.setprofile(None)
    return deepest[0]


def _deepest(deepest: list[int], frame: Any, event: str, arg: Any) -> None:
    code = frame.f_code
    xla = event == "c_call" and getattr(arg, "__name__", "") in ENGINE
    dist = event == "call" and code.co_name == "_start" and code.co_filename == _DIST
    if not (xla or dist):
        return
    n = 0
    while frame is not None:  # (the pool's own frames, which call the cell, aside)
        name = frame.f_code.co_filename
        n += name.startswith(_XCOLL) and not name.startswith(_POOLS)
        frame = frame.f_back
    deepest[0] = max(deepest[0], n)


def _counted(call: Callable[[], Any]) -> int:
    """One call's count. (The least of a few is the call's own: on XLA:CPU a
    replica thread that finds the other holding the step lock waits for it,
    and its wait is counted too.)"""
    n = [0]
    if xcoll.rank() == 0:
        sys.setprofile(lambda frame, event, arg: _tick(n, event))
    call()
    sys.setprofile(None)
    return n[0]


def _device() -> torch.device:
    from xcoll._backends import xla_runtime_running

    if not xla_runtime_running():
        return torch.device("cpu")
    import torch_xla

    return torch_xla.device()


def _tick(n: list[int], event: str) -> None:
    if event in ("call", "c_call"):
        n[0] += 1


def main() -> None:
    results, depths = {}, {}
    for engine, make in (("gloo", GlooPool), ("XLA:CPU", XlaPool)):
        with make(2) as pool:
            results[engine] = pool.run(count, [None, None])[0]
            depths[engine] = pool.run(frames, [None, None])[0]
    print(
        f"{'Python-level calls of a warm call, rank 0, W=2':48s}"
        + "".join(f"{e:>10s}" for e in results)
    )
    for cell in CELLS:
        label = "the plain engine call" if cell == "plain" else cell
        print(f"  {label:46s}" + "".join(f"{r[cell]:10d}" for r in results.values()), flush=True)
    print(f"{'xcoll frames from the public call to the engine':48s}")
    for cell in depths["gloo"]:
        print(f"  {cell:46s}" + "".join(f"{d[cell]:10d}" for d in depths.values()), flush=True)


if __name__ == "__main__":
    main()
