"""Run distributed code on W real replicas from an ordinary pytest process.

A pool is started once and reused for many calls, so property-based tests can
draw thousands of examples in the test process and run each on real replicas::

    from xcoll.testing import XlaPool

    def total(x):                 # runs on every replica, in its own thread
        import torch, torch_xla, xcoll
        return xcoll.reduce(torch.tensor(x).to(torch_xla.device())).item()

    if __name__ == "__main__":  # the pool's worker imports this module
        with XlaPool(4) as pool:
            assert pool.run(total, [1, 2, 3, 4]) == [10, 10, 10, 10]

Functions and arguments travel to the pool's worker process by reference/pickle
(they must be importable module-level functions and picklable values); results
come back the same way, so return CPU values. This is the test driver talking to
the child it started, not data exchanged between replicas: xcoll's collectives
never pickle.

Two pools: :class:`XlaPool` (W XLA replicas, one thread per device in one
worker process) and :class:`GlooPool` (W torch.distributed processes with the gloo
backend). A replica that hangs, or a worker that aborts, becomes an exception in
the caller within the timeout, with the tail of the workers' stderr; the next
call starts fresh workers.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import queue
import socket
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
    "GlooPool",
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


class _SpawnedPool(ReplicaPool):
    """Replicas in spawned worker processes, each writing its stderr to a file."""

    def __init__(self, world_size: int, timeout: float, grace: float) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size, self.timeout, self.grace = world_size, timeout, grace
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._logs: list[str] = []

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        """Starts one worker: ``target(conn, log, *args)``."""
        ctx = multiprocessing.get_context("spawn")
        fd, log = tempfile.mkstemp(prefix="xcoll-pool-", suffix=".log")
        os.close(fd)
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(child, log, *args), daemon=True)
        proc.start()
        child.close()
        self._procs.append(proc)
        self._conns.append(conn)
        self._logs.append(log)

    def stderr_tail(self, n: int = 4000) -> str:
        """The end of each worker's stderr. After a fatal signal, the end of what
        came before faulthandler's dump (the native library's own message, e.g.
        XLA's abort) and the start of the dump (every thread's stack)."""
        tails = []
        budget = n // max(1, len(self._logs))
        for log in self._logs:
            if os.path.exists(log):
                with open(log, errors="replace") as f:
                    text = f.read()
                before, fatal, dump = text.partition("Fatal Python error")
                if fatal:
                    text = before[-budget // 2 :] + fatal + dump[: budget // 2]
                tails.append(text[-budget:])
        return "\n".join(tails)

    def _crash(self, why: str) -> PoolCrashed:
        tail = self.stderr_tail()
        self.close(kill=True)
        return PoolCrashed(f"{why}\n--- tail of the worker's stderr ---\n{tail}")

    def _prepare(self, per_rank_args: Sequence[Any] | None) -> None:
        """Checks the arguments and (re)starts the workers if they are not running."""
        if per_rank_args is not None and len(per_rank_args) != self.world_size:
            raise ValueError(
                f"per_rank_args has {len(per_rank_args)} entries for {self.world_size} replicas"
            )
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close(kill=True)
            self._start()

    @abstractmethod
    def _start(self) -> None: ...

    @staticmethod
    def _outcome(results: list[tuple[bool, Any]], return_exceptions: bool) -> list[Any]:
        failures = {r: v for r, (ok, v) in enumerate(results) if not ok}
        if failures and not return_exceptions:
            raise ReplicaError(failures)
        return [v for _, v in results]

    def close(self, kill: bool = False) -> None:
        """Stops the workers (at once with ``kill=True``, else after their current call)."""
        for proc, conn in zip(self._procs, self._conns):
            if proc.is_alive() and not kill:
                try:
                    conn.send(None)
                except OSError:
                    pass
        for proc, conn in zip(self._procs, self._conns):
            if not kill:
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
            conn.close()
        for log in self._logs:
            if os.path.exists(log):
                os.unlink(log)
        self._procs, self._conns, self._logs = [], [], []


class XlaPool(_SpawnedPool):
    """W XLA replicas: one spawned worker process with one thread per device.

    ``device="CPU"`` gives W XLA:CPU replicas on any machine. ``device="TPU"``
    runs one thread per addressable TPU device of this host (the world size is
    then the number of devices, and ``world_size`` must match it).

    The XLA runtime starts in the worker with :func:`xla_cpu_env` (plus ``env``), so
    the calling process never initialises XLA.
    """

    device_type = "xla"

    def __init__(
        self,
        world_size: int,
        *,
        device: str = "CPU",
        timeout: float = 300.0,
        grace: float = 5.0,
        env: dict[str, str] | None = None,
    ):
        super().__init__(world_size, timeout, grace)
        self._env = xla_cpu_env(world_size) if device == "CPU" else {"PJRT_DEVICE": device}
        self._env.update(env or {})

    def _start(self) -> None:
        self._spawn(_xla_worker, self.world_size, self._env, self.grace)

    def run(self, fn, per_rank_args=None, *, timeout=None, return_exceptions=False):
        self._prepare(per_rank_args)
        timeout = self.timeout if timeout is None else timeout
        conn, proc = self._conns[0], self._procs[0]
        conn.send((fn, per_rank_args))
        if not multiprocessing.connection.wait([conn, proc.sentinel], timeout):
            raise self._crash(f"{_name(fn)}: the replicas did not finish within {timeout:.0f} s")
        try:
            complete, results = conn.recv()
        except (EOFError, OSError):
            raise self._crash(
                f"{_name(fn)}: the pool's worker died (exit code {proc.exitcode})"
            ) from None
        if not complete:  # some replica is stuck in a collective: start afresh next time
            self.close(kill=True)
        return self._outcome(results, return_exceptions)


class GlooPool(_SpawnedPool):
    """W torch.distributed processes on loopback with the gloo backend.

    Each process runs ``init_process_group("gloo")`` once (with the usual
    ``MASTER_ADDR``/``RANK``/``WORLD_SIZE`` variables set, so libraries that read
    them, such as accelerate, find the same group) and then serves calls on its
    main thread. ``collective_timeout`` is gloo's own timeout for a collective that
    some rank never joins.
    """

    device_type = "cpu"

    def __init__(
        self,
        world_size: int,
        *,
        timeout: float = 300.0,
        grace: float = 5.0,
        collective_timeout: float = 60.0,
    ):
        super().__init__(world_size, timeout, grace)
        self.collective_timeout = collective_timeout

    def _start(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for rank in range(self.world_size):
            self._spawn(_gloo_worker, rank, self.world_size, port, self.collective_timeout)

    def run(self, fn, per_rank_args=None, *, timeout=None, return_exceptions=False):
        self._prepare(per_rank_args)
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        for r, conn in enumerate(self._conns):
            conn.send(_task(fn, per_rank_args, r))
        results = _Results(self.world_size, self.grace)
        waiting = dict(enumerate(self._conns))
        while not results.done():
            ready = multiprocessing.connection.wait(
                list(waiting.values()) + [p.sentinel for p in self._procs],
                results.wait_time(deadline),
            )
            if not ready and time.monotonic() >= deadline:
                raise self._crash(f"{_name(fn)}: the replicas did not finish within {limit:.0f} s")
            for r, conn in list(waiting.items()):
                if conn in ready:
                    try:
                        results.add(*conn.recv())
                    except (EOFError, OSError):
                        raise self._crash(f"{_name(fn)}: rank {r} died") from None
                    del waiting[r]
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
            if dead:
                raise self._crash(f"{_name(fn)}: rank(s) {dead} died")
        complete, ordered = results.finish()
        failed = sum(not ok for ok, _ in ordered)
        if not complete or 0 < failed < self.world_size:
            # Some ranks failed while others went on: a collective may be left
            # half done (gloo closes the connections on a timeout), so start afresh.
            # When every rank raised, the group is consistent and is kept.
            self.close(kill=True)
        return self._outcome(ordered, return_exceptions)


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", repr(fn))


def _failure(rank: int, e: BaseException) -> RemoteFailure:
    t = type(e)
    return RemoteFailure(rank, f"{t.__module__}.{t.__qualname__}", str(e), traceback.format_exc())


def _task(fn: Callable[..., Any], per_rank_args: Sequence[Any] | None, rank: int) -> tuple:
    """What one replica runs: ``fn(per_rank_args[rank])``, or ``fn()``."""
    return (fn, per_rank_args is not None, None if per_rank_args is None else per_rank_args[rank])


def _call(rank: int, task: tuple) -> tuple[int, bool, Any]:
    """Runs a task on this replica: ``(rank, True, result)`` or ``(rank, False, failure)``."""
    fn, has_arg, arg = task
    try:
        return rank, True, fn(arg) if has_arg else fn()
    except BaseException as e:  # noqa: BLE001 - reported to the caller
        return rank, False, _failure(rank, e)


class _Results:
    """One call's per-rank results. After the first failure the others get
    ``grace`` seconds: they may be waiting forever in a collective that the
    failed rank never reached, so they are reported instead of waited for."""

    def __init__(self, world_size: int, grace: float):
        self.world_size, self.grace = world_size, grace
        self.by_rank: dict[int, tuple[bool, Any]] = {}
        self.grace_ends: float | None = None

    def add(self, rank: int, ok: bool, value: Any) -> None:
        self.by_rank[rank] = (ok, value)
        if not ok and self.grace_ends is None:
            self.grace_ends = time.monotonic() + self.grace

    def done(self) -> bool:
        return len(self.by_rank) == self.world_size or (
            self.grace_ends is not None and time.monotonic() >= self.grace_ends
        )

    def wait_time(self, deadline: float | None = None) -> float | None:
        ends = [t for t in (deadline, self.grace_ends) if t is not None]
        return max(0.0, min(ends) - time.monotonic()) if ends else None

    def finish(self) -> tuple[bool, list[tuple[bool, Any]]]:
        """(whether every rank returned, ``[(ok, value)]`` in rank order)."""
        complete = len(self.by_rank) == self.world_size
        failed = sorted(r for r, (ok, _) in self.by_rank.items() if not ok)
        for r in range(self.world_size):
            if r not in self.by_rank:
                why = (
                    f"did not return within {self.grace:.0f} s after rank(s) {failed} failed "
                    "(probably waiting in a collective they never reached)"
                )
                self.by_rank[r] = (False, RemoteFailure(r, "xcoll.testing.DidNotReturn", why, ""))
        return complete, [self.by_rank[r] for r in range(self.world_size)]


def _replica(device: Any, inbox: queue.Queue, outbox: queue.Queue) -> None:
    """One replica's thread: it is the replica's main thread for every call."""
    import torch_xla
    import torch_xla.runtime as xr
    from torch_xla import runtime

    torch_xla._XLAC._xla_set_default_device(device)
    runtime._init_world_size_ordinal()
    rank = xr.global_ordinal()
    while (task := inbox.get()) is not None:
        outbox.put(_call(rank, task))


def _to_log(log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    # A crash inside a native library (XLA) then leaves every thread's Python
    # stack in the log, which PoolCrashed quotes.
    faulthandler.enable(all_threads=True)


def _xla_worker(conn, log: str, world_size: int, env: dict[str, str], grace: float) -> None:
    _to_log(log)
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
            inbox.put(_task(fn, per_rank_args, r))
        results = _Results(world_size, grace)
        while not results.done():
            try:
                results.add(*outbox.get(timeout=results.wait_time()))
            except queue.Empty:
                pass
        complete, ordered = results.finish()
        try:
            conn.send((complete, ordered))
        except Exception as e:  # an unpicklable result
            conn.send((complete, [(False, _failure(r, e)) for r in range(world_size)]))
        if not complete:
            os._exit(0)  # stuck replica threads cannot be recovered


def _gloo_worker(conn, log: str, rank: int, world_size: int, port: int, timeout: float) -> None:
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
