"""The session's replica pools, and helpers that run inside a replica (or
inline, for a world of one).

(What the tests share in the test process is in tests/helpers.py.)
"""

from __future__ import annotations

import contextlib
import importlib.util
import os

import optree
import pytest
import torch

from xcoll import _backends
from xcoll.testing import GlooPool, LocalPool, ReplicaPool, XlaPool, xla_counters

_pools: dict[str, ReplicaPool] = {}


def shared_pool(name: str) -> ReplicaPool:
    """The session's pool of that name ("local-1", "xla-cpu-W", "gloo-W",
    "xla-tpu"), started on first use and reused by every test."""
    if name not in _pools:
        _pools[name] = _make(name)
    return _pools[name]


def close_pools() -> None:
    for p in _pools.values():
        p.close()
    _pools.clear()


def _make(name: str) -> ReplicaPool:
    if name == "local-1":
        return LocalPool()
    if name == "xla-tpu":
        if os.environ.get("PJRT_DEVICE") != "TPU":
            pytest.skip("tpu: no TPU here (set PJRT_DEVICE=TPU on a TPU host to run)")
        return XlaPool(int(os.environ.get("XCOLL_TPU_REPLICAS", "4")), device="TPU")
    kind, w = name.rsplit("-", 1)
    if kind == "xla-cpu" and importlib.util.find_spec("torch_xla") is None:
        # (.ci/run's newest-torch environment: torch.distributed and a world of one)
        pytest.skip("xla: torch_xla is not installed here (pip install 'xcoll[xla]')")
    return (XlaPool if kind == "xla-cpu" else GlooPool)(int(w), timeout=240)


def device() -> torch.device:
    if _backends.xla_runtime_running():
        import torch_xla

        return torch_xla.device()
    return torch.device("cpu")


def to_device(tree, dev):
    """Uploads CPU leaves as a user would (0-d ones as 0-d uploads, which
    torch_xla shares between equal values); a 2-d leaf that arrives transposed
    (non-contiguous) is uploaded contiguous and transposed on the device, so the
    replica holds a view. A tensor that appears twice in ``tree`` (one object
    under two keys) is uploaded once and appears twice on the device too."""
    done: dict[int, torch.Tensor] = {}

    def up(x):
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) not in done:
            if dev.type == "cpu":
                done[id(x)] = x.clone()
            elif x.dim() == 2 and not x.is_contiguous() and x.t().is_contiguous():
                done[id(x)] = x.t().to(dev).t()
            else:
                done[id(x)] = x.to(dev)
        return done[id(x)]

    return optree.tree_map(up, tree, none_is_leaf=False)


def to_cpu(tree):
    """CPU copies of every tensor leaf, bit for bit: XLA tensors through xcoll's
    own download (torch_xla's float16 ``.cpu()`` canonicalises NaN payloads)."""

    def down(x):
        if not isinstance(x, torch.Tensor):
            return x
        if x.device.type == "xla":
            from xcoll._backends import xla

            return xla.transport(x.device).to_host([x])[0].clone()
        return x.to("cpu", copy=True)

    return optree.tree_map(down, tree, none_is_leaf=False)


def devices(tree):
    return [x.device.type for x in optree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def counters() -> dict[str, int]:
    """:func:`xcoll.testing.xla_counters` and the device-to-host transfers, on an
    XLA replica (process-wide: in an XlaPool, all replicas together)."""
    import torch_xla.debug.metrics as met

    c = xla_counters()
    data = met.metric_data("TransferFromDeviceTime")
    c["transfers_from_device"] = int(data[0]) if data else 0
    return c


#: The process group's collectives that xcoll's torch.distributed backend
#: calls (:mod:`xcoll._backends.dist`), by method name.
PG_COLLECTIVES = ("allreduce", "_allgather_base", "allgather", "broadcast")


@contextlib.contextmanager
def engine_calls():
    """Within the block, every call of a process group's collective methods
    (:data:`PG_COLLECTIVES`, on every group of this process) is recorded, as
    ``(method name, first tensor)``, in the list the block gets: what the
    engine was asked to do, whichever path asked it."""
    import torch.distributed as dist

    calls: list[tuple[str, torch.Tensor]] = []
    # (restored from the class's own dict: newer torch's getattr gives the
    # unbound function, which set back on the class no longer binds the group)
    saved = {name: vars(dist.ProcessGroup)[name] for name in PG_COLLECTIVES}
    originals = {name: getattr(dist.ProcessGroup, name) for name in PG_COLLECTIVES}

    def recording(name):
        def call(pg, tensors, *args, **kwargs):
            first = tensors if isinstance(tensors, torch.Tensor) else tensors[0]
            calls.append((name, first))
            return originals[name](pg, tensors, *args, **kwargs)

        return call

    for name in PG_COLLECTIVES:
        setattr(dist.ProcessGroup, name, recording(name))
    try:
        yield calls
    finally:
        for name, descriptor in saved.items():
            setattr(dist.ProcessGroup, name, descriptor)


def processes(tmp_path, text: str, world: int, *args: str) -> list[tuple[str, str, int]]:
    """``text`` run as a script in ``world`` processes started as torchrun
    starts them: each one's stdout, stderr and exit status."""
    import os
    import socket
    import subprocess
    import sys

    script = tmp_path / "worker.py"
    script.write_text(text)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(world):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(world),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [p.communicate(timeout=120) for p in procs]
    return [(out, err, p.returncode) for (out, err), p in zip(outs, procs, strict=True)]
