"""Run distributed code on W real replicas from an ordinary pytest process.

A pool is started once and reused for many calls, so property-based tests can
draw thousands of examples in the test process and run each on real replicas::

    from xcoll.testing import XlaPool

    def total(x):                 # runs on every replica, in its own thread
        import torch, torch_xla, xcoll
        return xcoll.reduce(torch.tensor(x).to(torch_xla.device())).item()

    with XlaPool(4) as pool:
        assert pool.run(total, [1, 2, 3, 4]) == [10, 10, 10, 10]

Functions and arguments travel to the pool's worker process by reference/pickle
(they must be importable module-level functions and picklable values); results
come back the same way, so return CPU values. This is the test driver talking to
the child it started, not data exchanged between replicas: xcoll's collectives
never pickle.

A replica that hangs, or an XLA abort of the worker, becomes an exception in
the caller within the timeout, with the tail of the worker's stderr; the next
call starts a fresh worker.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import queue
import tempfile
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ReplicaPool",
    "XlaPool",
    "RemoteFailure",
    "ReplicaError",
    "PoolCrashed",
    "xla_cpu_env",
    "xla_counters",
]


@dataclass(frozen=True)
class RemoteFailure:
    """What a replica raised (or that it never returned)."""

    rank: int
    type_name: str  # qualified name of the exception type, e.g. "builtins.TypeError"
    message: str
    traceback: str

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.type_name}: {self.message}"


class ReplicaError(RuntimeError):
    """One or more replicas raised; ``failures`` maps rank -> :class:`RemoteFailure`."""

    def __init__(self, failures: dict[int, RemoteFailure]):
        self.failures = failures
        raised = [f for f in failures.values() if f.traceback] or list(failures.values())
        first = raised[0]
        super().__init__(
            "\n".join(str(f) for f in failures.values())
            + f"\n--- rank {first.rank} traceback ---\n{first.traceback}"
        )


class PoolCrashed(RuntimeError):
    """The pool's worker died or did not answer in time; the message ends with
    the tail of its stderr. The next call starts a fresh worker."""


class ReplicaPool(ABC):
    """W replicas that run ``fn`` together. Subclasses bind a collectives engine."""

    world_size: int
    #: ``torch.device.type`` of the replicas' tensors, e.g. "xla".
    device_type: str

    @abstractmethod
    def run(
        self,
        fn: Callable[..., Any],
        per_rank_args: Sequence[Any] | None = None,
        *,
        timeout: float | None = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Calls ``fn(per_rank_args[r])`` (or ``fn()``) on every replica ``r`` at once
        and returns ``[result_0, ..., result_{W-1}]``.

        Raises :class:`ReplicaError` if any replica raised (or, with
        ``return_exceptions=True``, puts a :class:`RemoteFailure` in its place), and
        :class:`PoolCrashed` if the replicas died or did not finish within
        ``timeout`` seconds.
        """

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> ReplicaPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def xla_cpu_env(world_size: int) -> dict[str, str]:
    """The environment under which W XLA:CPU replicas can run collectives in one
    process (measured; see docs/design.md): W CPU devices, the asynchronous
    client, a thread pool large enough for every replica to reach a rendezvous,
    and no special-cased scalar constants (which make replicas' graphs differ)."""
    return {
        "PJRT_DEVICE": "CPU",
        "CPU_NUM_DEVICES": str(world_size),
        "PJRT_CPU_ASYNC_CLIENT": "true",
        "XLA_NO_SPECIAL_SCALARS": "1",
        "XLA_THREAD_POOL_SIZE": str(max(16, 2 * world_size)),
    }


def xla_counters() -> dict[str, int]:
    """Process-wide torch_xla counts: graph executions and compilations. Call it
    from a replica; in a thread-per-device pool it counts all replicas."""
    import torch_xla.debug.metrics as met

    def count(name: str) -> int:
        data = met.metric_data(name)
        return int(data[0]) if data else 0

    return {"executions": count("ExecuteTime"), "compiles": count("CompileTime")}


class XlaPool(ReplicaPool):
    """W XLA replicas: one spawned worker process with one thread per device.

    ``device="CPU"`` gives W XLA:CPU replicas on any machine. ``device="TPU"``
    runs one thread per addressable TPU device of this host (the world size is
    then the number of devices, and ``world_size`` must match it).

    The XLA runtime starts in the worker with :func:`xla_cpu_env` (plus ``env``), so
    the calling process never initialises XLA.
    """

    def __init__(
        self,
        world_size: int,
        *,
        device: str = "CPU",
        timeout: float = 300.0,
        grace: float = 5.0,
        env: dict[str, str] | None = None,
    ):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.device_type = "xla"
        self.timeout = timeout
        self.grace = grace
        self._env = xla_cpu_env(world_size) if device == "CPU" else {"PJRT_DEVICE": device}
        self._env.update(env or {})
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._conn: multiprocessing.connection.Connection | None = None
        self._log: str | None = None

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        fd, self._log = tempfile.mkstemp(prefix="xcoll-pool-", suffix=".log")
        os.close(fd)
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_xla_worker,
            args=(child, self.world_size, self._env, self._log, self.grace),
            daemon=True,
            name=f"xcoll-xla-pool-{self.world_size}",
        )
        self._proc.start()
        child.close()

    def stderr_tail(self, n: int = 4000) -> str:
        if not self._log or not os.path.exists(self._log):
            return ""
        with open(self._log, errors="replace") as f:
            return f.read()[-n:]

    def _crash(self, why: str) -> PoolCrashed:
        tail = self.stderr_tail()
        self.close(kill=True)
        return PoolCrashed(f"{why}\n--- tail of the worker's stderr ---\n{tail}")

    def run(self, fn, per_rank_args=None, *, timeout=None, return_exceptions=False):
        if per_rank_args is not None and len(per_rank_args) != self.world_size:
            raise ValueError(
                f"per_rank_args has {len(per_rank_args)} entries for {self.world_size} replicas"
            )
        if self._proc is None or not self._proc.is_alive():
            self.close()
            self._start()
        timeout = self.timeout if timeout is None else timeout
        assert self._conn is not None and self._proc is not None
        self._conn.send((fn, per_rank_args))
        ready = multiprocessing.connection.wait([self._conn, self._proc.sentinel], timeout)
        if not ready:
            raise self._crash(f"{_name(fn)}: the replicas did not finish within {timeout:.0f} s")
        try:
            complete, results = self._conn.recv()
        except (EOFError, OSError):
            raise self._crash(
                f"{_name(fn)}: the pool's worker died (exit code {self._proc.exitcode})"
            ) from None
        if not complete:  # some replica is stuck in a collective: start afresh next time
            self.close()
        failures = {r: v for r, (ok, v) in enumerate(results) if not ok}
        if failures and not return_exceptions:
            raise ReplicaError(failures)
        return [v for _, v in results]

    def close(self, kill: bool = False) -> None:
        """Stops the worker (at once with ``kill=True``, else after its current call)."""
        if self._proc is not None:
            if self._proc.is_alive() and not kill:
                try:
                    self._conn.send(None)
                    self._proc.join(5)
                except (OSError, BrokenPipeError):
                    pass
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
            self._conn.close()
        if self._log and os.path.exists(self._log):
            os.unlink(self._log)
        self._proc = self._conn = self._log = None


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", repr(fn))


def _failure(rank: int, e: BaseException) -> RemoteFailure:
    t = type(e)
    return RemoteFailure(rank, f"{t.__module__}.{t.__qualname__}", str(e), traceback.format_exc())


_NO_ARG = object()


def _replica(device: Any, inbox: queue.Queue, outbox: queue.Queue) -> None:
    """One replica's thread: it is the replica's main thread for every call."""
    import torch_xla
    import torch_xla.runtime as xr
    from torch_xla import runtime

    torch_xla._XLAC._xla_set_default_device(device)
    runtime._init_world_size_ordinal()
    rank = xr.global_ordinal()
    while (task := inbox.get()) is not None:
        fn, arg = task
        try:
            outbox.put((rank, True, fn() if arg is _NO_ARG else fn(arg)))
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            outbox.put((rank, False, _failure(rank, e)))


def _xla_worker(conn, world_size: int, env: dict[str, str], log: str, grace: float) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)  # before the XLA runtime starts in this process

    import torch_xla.core.xla_model as xm
    from torch_xla._internal import pjrt

    pjrt.initialize_multiprocess(0, 1)
    devices = xm.get_xla_supported_devices()
    if len(devices) != world_size:
        raise RuntimeError(f"expected {world_size} XLA devices, found {len(devices)}: {devices}")
    inboxes = [queue.Queue() for _ in devices]
    outbox: queue.Queue = queue.Queue()
    for device, inbox in zip(devices, inboxes):
        threading.Thread(target=_replica, args=(device, inbox, outbox), daemon=True).start()

    while (task := conn.recv()) is not None:
        fn, per_rank_args = task
        for r, inbox in enumerate(inboxes):
            inbox.put((fn, _NO_ARG if per_rank_args is None else per_rank_args[r]))
        results: dict[int, tuple[bool, Any]] = {}
        deadline = None
        while len(results) < world_size:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                rank, ok, value = outbox.get(timeout=wait)
            except queue.Empty:
                break
            results[rank] = (ok, value)
            if not ok and deadline is None:
                # The others may wait forever in a collective this one never
                # reached; report after a grace period instead of hanging.
                deadline = time.monotonic() + grace
        complete = len(results) == world_size
        failed = sorted(k for k, (ok, _) in results.items() if not ok)
        for r in range(world_size):
            if r not in results:
                results[r] = (
                    False,
                    RemoteFailure(
                        r,
                        "xcoll.testing.DidNotReturn",
                        f"did not return within {grace:.0f} s after rank(s) {failed} failed "
                        "(probably waiting in a collective they never reached)",
                        "",
                    ),
                )
        ordered = [results[r] for r in range(world_size)]
        try:
            conn.send((complete, ordered))
        except Exception as e:  # an unpicklable result
            conn.send((complete, [(False, _failure(r, e)) for r in range(world_size)]))
        if not complete:
            os._exit(0)  # stuck replica threads cannot be recovered
