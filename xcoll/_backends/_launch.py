"""What the environment says about how this process was launched, for errors
that name the cause of a launch that went wrong (docs/launchers.md)."""

from __future__ import annotations

import os
import sys

#: The variables in which launchers tell a process how many processes they
#: started and which one it is, and whose environment that is. The first one
#: set is the one that counts: WORLD_SIZE (torch.distributed's own) wins.
_LAUNCHERS = (
    ("WORLD_SIZE", "RANK", "torchrun's environment"),
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "Open MPI's environment (mpirun)"),
    ("PMI_SIZE", "PMI_RANK", "MPICH's or Intel MPI's environment (mpirun)"),
)


def launched_as(variable: bool) -> str:
    """``"rank R of W (whose environment)"`` where a launcher's environment says
    this process is one of W > 1 processes, else ``""``; with ``variable``, the
    variable that says so too (``WORLD_SIZE=2``)."""
    for size, rank, source in _LAUNCHERS:
        world = os.environ.get(size, "")
        if world:
            if not world.isdigit() or int(world) <= 1:
                return ""
            said = f"{source}: {size}={world}" if variable else source
            return f"rank {os.environ.get(rank, '?')} of {world} ({said})"
    return ""


def without_group() -> str:
    """Why this process cannot be a world of one, for a ``RuntimeError``, where
    a launcher started it as one of several but torch.distributed is not
    initialised (and no XLA runtime runs it): else ``""``. Each process would
    return its own values alone, without an error."""
    started = launched_as(variable=True)
    if not started:
        return ""
    return (
        f"this process was started as {started}, but torch.distributed is not "
        'initialised: call torch.distributed.init_process_group first ("gloo"; "nccl" '
        "with CUDA leaves), or every xcoll call would run as a world of one and return "
        "this process's values alone (docs/launchers.md)"
    )


def launch_hint(xla_leaves: bool) -> str:
    """Where a launcher's environment says this process is one of several but
    XLA's runtime runs it as a world of one: the likely cause, for an error.
    A process group initialised first serves CPU leaves only: XLA leaves still
    go to XLA's world of one (seen with accelerate's XLA path under torchrun)."""
    started = launched_as(variable=False)
    if not started:
        return ""
    return (
        f". This process was started as {started}, but XLA's runtime runs it as a "
        "world of one: something started the XLA runtime instead of torch.distributed "
        "(accelerate does when torch_xla is installed: set USE_TORCH_XLA=0)"
        + ("" if xla_leaves else ", or call torch.distributed.init_process_group first")
        + " (docs/launchers.md)"
    )


def thread_pool() -> int:
    """The XLA:CPU thread pool's size as the runtime reads it:
    ``XLA_THREAD_POOL_SIZE``, or where that is unset (or not a number) the
    number of cores. xcoll sets it when imported before the runtime starts
    (:func:`default_cpu_env`); a runtime started earlier has its own."""
    setting = os.environ.get("XLA_THREAD_POOL_SIZE", "")
    return int(setting) if setting.strip().isdigit() else (os.cpu_count() or 1)


def pool_size(replicas: int) -> int:
    """The XLA:CPU thread pool xcoll asks for, for ``replicas`` replica
    threads: at least one thread per replica, with room for torch_xla's own."""
    return max(16, 2 * replicas)


def default_cpu_env() -> None:
    """Makes XLA:CPU's synchronous PJRT client, and a thread pool of
    :func:`pool_size` threads for ``CPU_NUM_DEVICES=W`` replicas, the defaults
    of an XLA runtime that starts after xcoll is imported
    (``PJRT_CPU_ASYNC_CLIENT=false``, ``XLA_THREAD_POOL_SIZE``: each where it
    is unset and no runtime runs yet; the replicas that ``torch_xla.launch``
    starts inherit them). Under torch_xla's default, the asynchronous client,
    thread-per-device replicas aborted training steps
    (:mod:`xcoll._backends.xla_step`, docs/launchers.md); with fewer pool
    threads than replicas (the default: one per core), only that many reach
    a collective and XLA aborts the process (the docs' snippet at W=4 on 2
    cores: 5 runs of 5). ``PJRT_CPU_ASYNC_CLIENT`` is read by XLA:CPU alone;
    the pool's size is set only where ``CPU_NUM_DEVICES`` (XLA:CPU's) is."""
    # (else no runtime runs: torch_xla is not imported here, or cannot be: None)
    if sys.modules.get("torch_xla") is not None:
        from . import _xlac

        if _xlac.runtime_is_initialized():
            return
    os.environ.setdefault("PJRT_CPU_ASYNC_CLIENT", "false")  # (else the caller's choice)
    replicas = os.environ.get("CPU_NUM_DEVICES", "")
    if replicas.isdigit() and int(replicas) > 1:
        os.environ.setdefault("XLA_THREAD_POOL_SIZE", str(pool_size(int(replicas))))
