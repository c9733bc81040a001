"""What runs in the pools' spawned worker processes.

The targets (:func:`_xla_worker`, :func:`_gloo_worker`) are module-level
functions: ``multiprocessing``'s spawn start method pickles them by reference,
and the child imports this module to find them. This module imports
:mod:`xcoll.testing._remote` (and, in a replica, xcoll's private torch_xla
bindings), never :mod:`xcoll.testing._pools`.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import os
import queue
import threading
from multiprocessing.connection import Connection
from typing import Any

from xcoll.testing._remote import Task, _call, _failure, _Results, _task


def _replica(
    device: Any, inbox: queue.Queue[Task | None], outbox: queue.Queue[tuple[int, bool, Any]]
) -> None:
    """One replica's thread: it is the replica's main thread for every call."""
    import torch_xla.runtime as xr

    from xcoll._backends import _xlac

    _xlac.start_replica_thread(device)
    rank = xr.global_ordinal()
    while (task := inbox.get()) is not None:
        outbox.put(_call(rank, task))


def _to_log(log: str) -> None:
    """Sends this process's stdout and stderr to the file ``log``."""
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    # A crash inside a native library (XLA) then leaves every thread's Python
    # stack in the log, which PoolCrashed quotes.
    faulthandler.enable(all_threads=True)


def _xla_worker(conn: Connection, log: str, world_size: int, env: dict[str, str], grace: float) -> None:
    """XlaPool's worker: one thread per XLA device, serving calls until ``None``."""
    _to_log(log)
    os.environ.update(env)  # before the XLA runtime starts in this process

    import torch_xla.core.xla_model as xm

    from xcoll._backends import _xlac

    _xlac.start_single_process_runtime()
    devices = xm.get_xla_supported_devices()
    if len(devices) != world_size:
        raise RuntimeError(f"expected {world_size} XLA devices, found {len(devices)}: {devices}")
    _xlac.warm_up_fallbacks(devices[0])
    # What runs until here stays: frozen, the collections between calls below
    # scan only what the calls make (a few objects, not the runtime's 400k).
    gc.collect()
    gc.freeze()
    inboxes: list[queue.Queue[Task | None]] = [queue.Queue() for _ in devices]
    outbox: queue.Queue[tuple[int, bool, Any]] = queue.Queue()
    for device, inbox in zip(devices, inboxes, strict=True):
        threading.Thread(target=_replica, args=(device, inbox, outbox), daemon=True).start()

    while (task := conn.recv()) is not None:
        fn, per_rank_args = task
        for r, inbox in enumerate(inboxes):
            inbox.put(_task(fn, per_rank_args, r))
        results = _Results(world_size, grace)
        while not results.done():
            try:
                results.add(*outbox.get(timeout=results.wait_time()))
            except queue.Empty:
                pass
        complete, ordered = results.finish()
        # Every replica is idle: a call's garbage (objects in reference cycles,
        # as torchmetrics' metrics are) goes now, on all of them at once. Left
        # to the collector, it went on some replicas before their next step
        # and not on others, and pending tensors it held joined the steps of
        # those others only: their programs differed, and XLA aborted.
        gc.collect()
        try:
            conn.send((complete, ordered))
        except Exception as e:  # an unpicklable result
            conn.send((complete, [(False, _failure(r, e)) for r in range(world_size)]))
        if not complete:
            os._exit(0)  # stuck replica threads cannot be recovered


def _gloo_worker(conn: Connection, log: str, rank: int, world_size: int, port: int, timeout: float) -> None:
    """GlooPool's worker for one rank: joins the gloo group, serves calls until ``None``."""
    _to_log(log)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout),
    )
    while (task := conn.recv()) is not None:
        result = _call(rank, task)
        try:
            conn.send(result)
        except Exception as e:  # an unpicklable result
            conn.send((rank, False, _failure(rank, e)))
    dist.destroy_process_group()
