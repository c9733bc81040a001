"""The XLA:CPU side of the benchmark: xcoll and the algorithms people use today,
on W replica threads of one process.

Each method is ``prepare(tree) -> call``: ``prepare`` runs once per replica (it
may pre-pack, as the ideal does), ``call()`` makes one complete call, results
included. Every method syncs through xcoll's locked ``sync`` (the lock is what
lets W threads compile one graph instead of W racing ones on XLA:CPU; see
docs/design.md), which also waits for this replica's execution.

Where a peer's own function cannot run on XLA:CPU replicas, its algorithm is
reproduced here under a name that says so:

* accelerate's ``gather``/``reduce`` on XLA call ``xm.all_gather``/``xm.all_reduce``
  with the pinned layout, whose all-gather pads with the replica's ordinal and
  so compiles a different graph per replica (it hangs at W > 1 on XLA:CPU), and
  its ``PartialState`` is one object per process, not per replica thread. The
  baselines below are its per-leaf code with ``pin_layout=False``.
* ``xm.mesh_reduce`` goes through ``xm.rendezvous``, which uses the pinned
  all-gather too. The baseline is torch_xla's rendezvous algorithm with
  ``pin_layout=False``, and raw bytes in place of ``torch.save``/``torch.load``
  (xcoll never unpickles another replica's data; skipping pickle only makes the
  baseline faster).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

from . import xcoll_calls as ours
from .trees import SMALL
from .xcoll_calls import Call


def _device():
    import torch_xla

    return torch_xla.device()


def _sync() -> None:
    """A peer's ``torch_xla.sync()``, made safe for thread-per-device replicas
    as xcoll's is (under its lock, then a wait for this device), but stepping
    even with nothing pending, as the peer does (xcoll's skips that step)."""
    import torch_xla

    from xcoll._backends import _xlac, xla_step

    device = torch_xla.device()
    xla_step.step(device)
    _xlac.wait_device(device)
    _xlac.run_step_closures()


def _fetch(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One batched device-to-host transfer (what ``xm._maybe_convert_to_cpu`` does)."""
    import torch_xla

    return torch_xla._XLAC._xla_get_cpu_tensors(tensors)


def _packed(tree: dict) -> torch.Tensor:
    """The tree's bytes as one uint8 device buffer, built outside the timed call."""
    from .trees import nbytes

    return torch.zeros(nbytes(tree), dtype=torch.uint8).to(_device())


# ---- (a) accelerate's XLA gather: per-leaf all_gather, one mark_step --------------


def accelerate_gather(tree: dict) -> Call:
    import torch_xla.core.xla_model as xm
    from accelerate.utils import recursively_apply

    def one(tensor):  # accelerate.utils.operations._tpu_gather_one, pin_layout=False
        if tensor.ndim == 0:
            tensor = tensor.clone()[None]
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        return xm.all_gather(tensor, pin_layout=False)

    def call():
        res = recursively_apply(one, tree, error_on_other_type=True)
        _sync()  # xm.mark_step()
        return _fetch(optree.tree_leaves(res))

    return call


# ---- (b) accelerate's XLA reduce: per leaf, mark_step, all_reduce, mark_step -------


def accelerate_reduce(tree: dict) -> Call:
    import torch_xla.core.xla_model as xm
    from accelerate.utils import recursively_apply

    def one(tensor):  # accelerate.utils.operations.reduce._reduce_across_processes (XLA)
        cloned = tensor.clone()
        _sync()
        xm.all_reduce(xm.REDUCE_SUM, [cloned], 1.0, pin_layout=False)
        _sync()
        return cloned

    return lambda: recursively_apply(one, tree, error_on_other_type=True)


# ---- (c) xm.mesh_reduce per leaf: a host round trip per leaf ----------------------


def _rendezvous(payload: bytes) -> list[bytes]:
    """torch_xla.core.xla_model.xla_rendezvous, with pin_layout=False."""
    import torch_xla.core.xla_model as xm

    _sync()
    device = _device()
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    size = torch.tensor([data.shape[0]], dtype=torch.int, device=device)
    sizes = xm.all_gather(size, pin_layout=False)
    max_size = torch.max(sizes)
    _sync()
    padded = torch.nn.functional.pad(data, (0, max_size.item() - size.item())).to(device)
    raw = xm.all_gather(padded, pin_layout=False)
    data_list = torch.split(raw, max_size.item())
    payloads = [d[:sz] for d, sz in zip(data_list, sizes.cpu(), strict=True)]
    _sync()
    return [bytes(p.cpu().tolist()) for p in payloads]


def _mesh_reduce(data: torch.Tensor, reduce_fn: Callable[[list[torch.Tensor]], Any]):
    """torch_xla.core.xla_model.mesh_reduce, raw bytes instead of pickle: every
    replica's tensor has this one's shape and dtype."""
    cpu = _fetch([data])[0]
    payload = cpu.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    received = [
        torch.frombuffer(bytearray(x), dtype=torch.uint8).view(cpu.dtype).reshape(cpu.shape)
        for x in _rendezvous(payload)
    ]
    return reduce_fn(received)


def mesh_reduce_gather(tree: dict) -> Call:
    return lambda: optree.tree_map(lambda t: _mesh_reduce(t, torch.cat), tree)


def mesh_reduce_broadcast(tree: dict) -> Call:
    # accelerate.utils.operations._tpu_broadcast: mesh_reduce(name, t, lambda x: x[src])
    return lambda: optree.tree_map(lambda t: _mesh_reduce(t, lambda x: x[0]), tree)


# ---- (e) the floor under xcoll: its packing and collectives, nothing else ---------


def pack_floor_gather(tree: dict) -> Call:
    """xcoll.gather's own packing (its kernels' ``join``: one XLA node that
    joins every leaf's bytes into one buffer) and its one all_gather, the
    result fetched in one transfer; no flattening, planning, guard, cutting or
    output tensors. What is left of xcoll.gather(to_cpu=True) above this is
    the work per call that these skip."""
    from xcoll._backends import xla
    from xcoll._encode import pack as _pack

    backend = xla.transport(_device())
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for leaf in optree.tree_leaves(tree):
        by_dtype.setdefault(leaf.dtype, []).append(leaf)
    parts = list(by_dtype.values())
    joined = _pack.Joined.of([p[0].dtype for p in parts], [[t.shape for t in p] for p in parts], 0)
    segments = [parts[k] for k in joined.order]

    def call():
        out = backend.all_gather(backend.kernels.join(segments, joined))
        _sync()
        return _fetch([out])

    return call


# ---- (p) the plain engine call: one per leaf, one sync, one fetch ------------------


def plain_gather(tree: dict) -> Call:
    import torch_xla.core.xla_model as xm

    leaves = [t.reshape(1) if t.ndim == 0 else t for t in optree.tree_leaves(tree)]

    def call():
        outs = [xm.all_gather(t, pin_layout=False) for t in leaves]
        _sync()
        return _fetch(outs)

    return call


def plain_reduce(tree: dict) -> Call:
    import torch_xla.core.xla_model as xm

    leaves = optree.tree_leaves(tree)

    def call():
        outs = [xm.all_reduce(xm.REDUCE_SUM, t, pin_layout=False) for t in leaves]
        _sync()
        return _fetch(outs)

    return call


# ---- (d) the ideal: one collective of one pre-packed buffer -----------------------


def ideal_gather(tree: dict) -> Call:
    import torch_xla.core.xla_model as xm

    buf = _packed(tree)

    def call():
        out = xm.all_gather(buf, pin_layout=False)
        _sync()
        return _fetch([out])

    return call


def ideal_reduce(tree: dict) -> Call:
    import torch_xla.core.xla_model as xm

    buf = _packed(tree)

    def call():
        out = xm.all_reduce(xm.REDUCE_SUM, buf, pin_layout=False)
        _sync()
        return out

    return call


#: op -> method name -> prepare. The first method of each op is xcoll's, the one
#: the ratios are taken against.
METHODS: dict[str, dict[str, Callable[[dict], Call]]] = {
    "gather": {
        "xcoll.gather(to_cpu=True)": ours.gather_to_cpu,
        "xcoll.gather (device outputs)": ours.gather,
        "(a) accelerate XLA gather algorithm, pin_layout=False, one fetch": accelerate_gather,
        "(c) mesh_reduce + torch.cat per leaf, pin_layout=False, raw bytes": mesh_reduce_gather,
        "(d) ideal: one all_gather of a pre-packed buffer, one fetch": ideal_gather,
        "(e) floor: xcoll's packing and its one all_gather, one fetch": pack_floor_gather,
    },
    "reduce": {
        "xcoll.reduce": ours.reduce,
        "(b) accelerate XLA reduce algorithm, pin_layout=False": accelerate_reduce,
        "(d) ideal: one all_reduce of a pre-packed buffer": ideal_reduce,
    },
    "broadcast": {
        "xcoll.broadcast": ours.broadcast,
        "(c) accelerate XLA broadcast algorithm: mesh_reduce per leaf, pin_layout=False, raw bytes": mesh_reduce_broadcast,
        "(d) ideal: one all_reduce of a pre-packed buffer": ideal_reduce,
    },
    # small calls (bench.trees.SMALL), against the plain engine call
    "small gather": {
        "xcoll.gather(to_cpu=True)": ours.gather_to_cpu,
        "(p) plain: xm.all_gather per leaf, pin_layout=False, one sync, one fetch": plain_gather,
    },
    "small reduce": {
        "xcoll.reduce(to_cpu=True)": ours.reduce_to_cpu,
        "(p) plain: xm.all_reduce per leaf, pin_layout=False, one sync, one fetch": plain_reduce,
    },
    "metrics reduce": {
        "xcoll.reduce(to_cpu=True)": ours.reduce_to_cpu,
        "(p) plain: xm.all_reduce per leaf, pin_layout=False, one sync, one fetch": plain_reduce,
    },
}


#: What runs on one replica alone: xcoll's gather to the host, the ideal and the
#: floor; the small calls.
ALONE = {
    "gather": {
        k: v for k, v in METHODS["gather"].items() if k.startswith(("xcoll.gather(to_cpu", "(d)", "(e)"))
    },
    **{op: METHODS[op] for op in SMALL},
}


#: torch_xla's counters of traced collective ops.
COLLECTIVES = (
    "xla::AllGather",
    "xla::AllReduce",
    "xla::AllReduceInPlace",
    "xla::ReduceScatter",
    "xla::AllToAll",
    "xla::CollectivePermute",
)


def counters() -> dict[str, int]:
    """Process-wide torch_xla counts (all replica threads together): graph
    executions and compilations, collective ops traced, device-to-host
    transfers."""
    import torch_xla.debug.metrics as met

    from xcoll.testing import xla_counters

    data = met.metric_data("TransferFromDeviceTime")
    return {
        **xla_counters(),
        "collectives": sum(met.counter_value(name) or 0 for name in COLLECTIVES),
        "transfers": int(data[0]) if data else 0,
    }


def tree_for(n: int, op: str = "") -> dict:
    import xcoll

    from .trees import make, small

    return small(op, xcoll.rank(), _device()) if op in SMALL else make(n, xcoll.rank(), _device())
