"""Every private torch_xla call xcoll makes (``torch_xla._XLAC``, private
runtime functions), one named function each.

Each says which public API it replaces and why. If the installed torch_xla
lacks one of these bindings (they are not a stable API), the call raises a
RuntimeError that says so, instead of an AttributeError from deep inside a
collective. xcoll is tested with torch_xla 2.9.0.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch_xla

_MISSING = (
    f"this torch_xla ({getattr(torch_xla, '__version__', '?')}) has no "
    "torch_xla.{name}, which xcoll needs; xcoll is tested with torch_xla 2.9.0"
)


def _binding(name: str) -> Any:
    try:
        return getattr(torch_xla._XLAC, name)
    except AttributeError:
        raise RuntimeError(_MISSING.format(name=f"_XLAC.{name}")) from None


def runtime_is_initialized() -> bool:
    """Whether the XLA runtime runs in this process. Replaces
    ``torch_xla.runtime`` queries, which start the runtime when it is not running."""
    return _binding("_xla_runtime_is_initialized")()


def start_single_process_runtime() -> None:
    """Starts the PJRT runtime as process 0 of 1, for threads that each drive
    one device. Replaces what ``xmp.spawn`` does before it starts its
    thread-per-device runner (which owns the threads and so cannot serve a
    test pool's persistent ones)."""
    try:
        from torch_xla._internal import pjrt
    except ImportError:
        raise RuntimeError(_MISSING.format(name="_internal.pjrt")) from None
    pjrt.initialize_multiprocess(0, 1)


def start_replica_thread(device: Any) -> None:
    """Makes ``device`` this thread's default XLA device and sets the thread's
    world size and ordinal. Replaces what ``xmp.spawn``'s thread-per-device
    runner does for each of its threads (there is no public call for one
    thread)."""
    from torch_xla import runtime

    _binding("_xla_set_default_device")(device)
    init = getattr(runtime, "_init_world_size_ordinal", None)
    if init is None:
        raise RuntimeError(_MISSING.format(name="runtime._init_world_size_ordinal"))
    init()


def wait_device(device: torch.device) -> None:
    """Waits for the executions pending on ``device`` only. Replaces
    ``xm.wait_device_ops()``, which waits for every device of the process: in
    thread-per-device mode one replica would then wait on another replica's
    rendezvous (deadlock)."""
    devices = _binding("_xla_real_devices")([str(device)])
    _binding("_xla_wait_device_ops")(devices=devices)


def wait_devices(devices: Sequence[str]) -> None:
    """``xm.wait_device_ops(devices)`` itself: waits for the executions
    pending on ``devices`` (named as torch_xla names them)."""
    _binding("_xla_wait_device_ops")(devices=list(devices))


def user_computation(name: str, inputs: Sequence[torch.Tensor], computation: Any) -> list:
    """Applies a built XLA computation to ``inputs`` as one node of the lazy
    graph. No public API applies an ``xla_builder`` computation to tensors;
    xcoll's pack, unpack, split and bitcast are such computations (one node
    instead of a torch call per leaf; ``Tensor.view(dtype)`` is not lowered)."""
    return _binding("_xla_user_computation")(name, list(inputs), computation)


def reset_token(device: torch.device | str) -> None:
    """Clears ``device``'s collective token (torch_xla adds it to every
    collective's input and derives the next one from the result, so a NaN
    result poisons later collectives). ``torch_xla.sync()`` resets it too, but
    also runs the graph."""
    _binding("_set_all_reduce_token")(str(device), None)


def all_gather(buf: torch.Tensor, world_size: int) -> torch.Tensor:
    """One all-gather of the 1-d ``buf`` over every replica, along dim 0.
    Replaces ``xm.all_gather(buf, pin_layout=False)`` without its token lookup
    (this form of all-gather does not use it). The pinned default pads with the
    replica's ordinal, so replicas would compile different graphs."""
    return _binding("_xla_all_gather")(buf, 0, world_size, [], False, None, None)


def all_reduce(buf: torch.Tensor, reduce_type: str) -> torch.Tensor:
    """One all-reduce of ``buf`` over every replica (``reduce_type``: an
    ``xm.REDUCE_*``). Replaces ``xm.all_reduce(reduce_type, buf,
    pin_layout=False)`` without its Python wrapper, which reads the
    environment and the runtime's world size on every call (a world of one is
    the caller's to skip)."""
    return _binding("_xla_all_reduce")(reduce_type, buf, 1.0, [], False)


def reduce_scatter(buf: torch.Tensor, reduce_type: str, world_size: int, device: str) -> torch.Tensor:
    """One reduce-scatter of the 1-d ``buf`` over every replica: replica
    ``r`` gets the reduction of every replica's ``r``-th of ``world_size``
    parts. Replaces ``xm.reduce_scatter(reduce_type, buf, 1.0, 0,
    world_size, pin_layout=False)``; the caller resets ``device``'s
    collective token first (the fresh one it takes then is an input of
    this collective alone, and the one it returns is dropped)."""
    token = _binding("_get_all_reduce_token")(device)
    f = _binding("_xla_reduce_scatter")
    return f(reduce_type, buf, token, 1.0, 0, world_size, [], False, None, None)[0]


def all_to_all(buf: torch.Tensor, world_size: int, device: str) -> torch.Tensor:
    """One all-to-all of the 1-d ``buf`` over every replica: replica ``r``
    gets every replica's ``r``-th of ``world_size`` parts, in rank order.
    Replaces ``xm.all_to_all(buf, 0, 0, world_size, pin_layout=False)``, as
    :func:`reduce_scatter` does."""
    token = _binding("_get_all_reduce_token")(device)
    return _binding("_xla_all_to_all")(buf, token, 0, 0, world_size, [], False)[0]


def upload(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` (CPU) copied to ``device``, in one call. Replaces a
    ``.to(device)`` per tensor."""
    return list(_binding("_xla_tensors_from_aten")(list(tensors), [str(device)] * len(tensors)))


def get_cpu_tensors(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """CPU copies of device tensors, fetched in one call. Replaces a ``.cpu()``
    per tensor (one transfer each). No tensors: no call, which would wait
    for every device of the process (measured: a replica's uneven gather
    without tensor leaves then waited for another replica's execution, which
    waited for it, until XLA aborted)."""
    if not tensors:
        return []
    return list(_binding("_xla_get_cpu_tensors")(list(tensors)))


# torch_xla.sync()'s debugging settings that xcoll's step keeps: its step log
# line and its metrics file. Read when xcoll starts (set later, they take
# effect in torch_xla.sync() alone). Not XLA_SYNC_WAIT: its wait, under
# xcoll's lock, waits for the replicas queued behind that lock (measured: a
# hang, then XLA's abort, at W=2); xcoll's own calls wait once the lock is
# released (xla_step.sync).
_STEPLOG = os.environ.get("XLA_EMIT_STEPLOG", "0") not in ("", "0")
_METRICS_FILE = os.environ.get("XLA_METRICS_FILE") is not None


def step(device: torch.device) -> None:
    """``torch_xla.sync()`` from the thread whose default device is
    ``device``, but for its step closures and its wait: runs the pending
    graph (asynchronously) and clears the collective token. The closures are
    :func:`run_step_closures`' to run, once the caller has released the lock
    that it holds around this call: a closure that reads a result of the
    execution waits for it, and with it for every replica's collectives,
    which the other replicas cannot reach while they wait for that lock.
    Replaces ``torch_xla.sync()``, which also reads the environment, the
    ordinal and the metrics settings on every call (a third of a small call's
    host work at W=4)."""
    name = str(device)
    if _STEPLOG:
        print("torch_xla.torch_xla::sync", file=sys.stderr, flush=True)
    _binding("_xla_step_marker")(name, [], wait=False)
    if _METRICS_FILE:
        _save_metrics()
    _binding("_set_all_reduce_token")(name, None)


def _save_metrics() -> None:
    import torch_xla.core.xla_model as xm

    if xm.is_master_ordinal():  # (as torch_xla.sync(): one replica's metrics per host)
        xm.ms.save_metrics()


def pending(device: torch.device) -> bool:
    """Whether a tensor on ``device`` has work pending. A step with none
    would be no execution, but torch_xla's barrier for an empty step locks
    the default device (device 0), not ``device``: on thread-per-device
    replicas it waits for replica 0's execution, which may be waiting for
    this replica in a collective (measured: a deadlock, then XLA's abort)."""
    return any(_binding("_check_device_tensor_need_materialization")(str(device)))


def run_step_closures() -> None:
    """Runs the step closures registered for this thread's device (after
    :func:`step`, outside the lock). Replaces the part of ``torch_xla.sync()``
    that runs them."""
    import torch_xla.core.xla_model as xm

    closures = getattr(xm, "_run_step_closures", None)
    if closures is None:
        raise RuntimeError(_MISSING.format(name="core.xla_model._run_step_closures"))
    closures()


def sync_only(tensors: Sequence[torch.Tensor]) -> None:
    """Runs the graph of ``tensors`` alone, asynchronously. Replaces
    ``torch_xla.sync()``, which runs everything pending (the caller's work too,
    which differs between replicas exactly when their calls do)."""
    _binding("_xla_sync_multi")(list(tensors), devices=[], wait=False)


def data_handles(tensors: Sequence[torch.Tensor]) -> list[int] | None:
    """:func:`data_handle` of every tensor in one call, or None if any of them
    is pending computation."""
    try:
        return list(_binding("_get_tensors_handle")(list(tensors)))
    except RuntimeError:
        return None


def data_handle(t: torch.Tensor) -> int | None:
    """The device buffer that ``t`` holds, or None if ``t`` is pending
    computation (no public API tells them apart). Two tensors with one handle
    are one parameter of a traced graph."""
    try:
        return _binding("_get_tensors_handle")([t])[0]
    except RuntimeError:  # "XlaTensor does not have data handle"
        return None


def warm_up_fallbacks(device: Any) -> None:
    """Runs one ``.item()`` on ``device`` from this thread. Call it before
    starting replica threads (thread-per-device: XLA:CPU, TPU v2/v3).

    torch_xla counts its CPU-fallback ops in a global map without a lock
    (``xla_fallback`` in ``torch_xla/csrc/aten_fallback.cpp``): the first
    ``.item()`` inserts its counter, and replica threads that make their first
    ``.item()`` together can read it half made and crash (SIGSEGV,
    docs/design.md). One ``.item()`` first creates the counter. Other fallback
    ops race the same way on their first concurrent use."""
    torch.tensor([0]).to(device).item()


def scalars_as_data() -> None:
    """Makes torch_xla trace 0-d values of 0 and 1 as data, like every other
    value, as ``XLA_NO_SPECIAL_SCALARS=1`` does from the start. Its default makes
    them constants of the program, so replicas whose 0-d values differ only in
    being 0 or 1 would compile different programs. Public API: only the
    environment variable, which must be set before torch_xla starts."""
    if _binding("_get_xla_handle_special_scalars")():
        _binding("_set_xla_handle_special_scalars")(False)


def scalar_data_unshared() -> None:
    """Makes torch_xla upload each Python scalar of a traced op as data of its
    own. Its device-data cache gives scalars of equal value one buffer, and so
    one parameter of the program: replicas whose per-replica scalars coincide
    with other values differently (``x + 10 * rank`` is 0 on rank 0 only)
    trace different programs (measured: XLA's abort at W=2; with the cache
    off, the values). Public API: only ``XLA_ENABLE_DEVICE_DATA_CACHE``,
    read when torch_xla starts."""
    _binding("_set_xla_enable_device_data_cache")(False)
