"""The pools, as the calling process sees them: start workers, send them calls,
collect what the replicas returned, and turn hangs and crashes into exceptions."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import socket
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from xcoll._backends._launch import pool_size
from xcoll.testing._remote import RemoteFailure, _failure, _Results, _task
from xcoll.testing._workers import _gloo_worker, _xla_worker


class ReplicaError(RuntimeError):
    """One or more replicas raised in :meth:`ReplicaPool.run`.

    The message lists every failed rank's exception and ends with the first
    one's traceback.

    Attributes:
        failures: rank -> :class:`RemoteFailure`, for every rank that raised
            (or did not return after another one raised).
    """

    def __init__(self, failures: dict[int, RemoteFailure]):
        self.failures = failures
        raised = [f for f in failures.values() if f.traceback] or list(failures.values())
        first = raised[0]
        super().__init__(
            "\n".join(str(f) for f in failures.values())
            + f"\n--- rank {first.rank} traceback ---\n{first.traceback}"
        )


class PoolCrashed(RuntimeError):
    """The pool's worker died (an XLA abort, a segfault, a killed process) or
    did not answer within the timeout (a hang). The message ends with the tail
    of the workers' stderr. The next :meth:`ReplicaPool.run` starts fresh
    workers."""


class ReplicaPool(ABC):
    """W replicas that run a function together: the interface of
    :class:`XlaPool`, :class:`GlooPool` and :class:`LocalPool`.

    A pool is a context manager: leaving the ``with`` block closes it.

    Attributes:
        world_size: the number of replicas, W.
        device_type: ``torch.device.type`` of the replicas' tensors, e.g. "xla".
    """

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
        """Calls ``fn`` on every replica at once and returns what each returned.

        ``fn`` and the arguments travel to the replicas by reference and pickle
        (a module-level function, picklable values; in :class:`LocalPool`
        nothing is pickled). A replica that hangs or a worker that dies
        becomes an exception within ``timeout``.

        Args:
            fn: a module-level function, called as ``fn(per_rank_args[r])`` on
                replica ``r`` (or ``fn()``); it makes the replicas' xcoll calls.
            per_rank_args: one argument per replica, or None to call ``fn()``.
            timeout: seconds to wait for every replica (default: the pool's).
            return_exceptions: put a :class:`RemoteFailure` in place of a
                failed replica's result instead of raising.

        Returns:
            ``[result_0, ..., result_{W-1}]``, in rank order (results travel back
            by pickle: return CPU values).

        Raises:
            ReplicaError: some replica raised (unless ``return_exceptions``).
            PoolCrashed: the replicas died or did not finish within ``timeout``.
            ValueError: ``per_rank_args`` does not have one entry per replica.
        """

    @abstractmethod
    def close(self) -> None:
        """Stops the replicas; the next :meth:`run` starts them afresh.

        Raises:
            Nothing; a worker that does not stop within 5 s is killed.
        """

    def __enter__(self) -> ReplicaPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalPool(ReplicaPool):
    """A world of one, run inline in the calling process with no collectives
    engine: ``fn`` sees what xcoll does in a single process (rank 0 of 1, CPU
    tensors). Nothing is pickled, and ``timeout`` is ignored.

    >>> from xcoll.testing import LocalPool
    >>> LocalPool().run(abs, [-3])
    [3]
    >>> LocalPool().run(int, ["x"], return_exceptions=True)[0].type_name
    'builtins.ValueError'
    """

    world_size = 1
    device_type = "cpu"

    def run(
        self,
        fn: Callable[..., Any],
        per_rank_args: Sequence[Any] | None = None,
        *,
        timeout: float | None = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        _check_args(per_rank_args, 1)
        try:
            return [fn() if per_rank_args is None else fn(per_rank_args[0])]
        except Exception as e:
            if return_exceptions:
                return [_failure(0, e)]
            raise ReplicaError({0: _failure(0, e)}) from e

    def close(self) -> None:
        pass


def _check_args(per_rank_args: Sequence[Any] | None, world_size: int) -> None:
    """Refuses ``per_rank_args`` without one entry per replica (every pool's
    :meth:`ReplicaPool.run`)."""
    if per_rank_args is not None and len(per_rank_args) != world_size:
        raise ValueError(f"per_rank_args has {len(per_rank_args)} entries for {world_size} replicas")


def xla_cpu_env(world_size: int) -> dict[str, str]:
    """The environment under which W XLA:CPU replicas can run collectives in
    one process (measured; see docs/design.md): W CPU devices, the
    synchronous client (with the asynchronous one, torch_xla's default, a
    training step's sync deadlocked: docs/launchers.md), a thread pool large enough for every replica to
    reach a rendezvous, and no special-cased scalar constants (which make
    replicas' graphs differ). :class:`XlaPool` starts its worker with it.

    Args:
        world_size: the number of replicas, W.

    Returns:
        Environment variables and their values, to set before torch_xla starts.

    Raises:
        Nothing; it only builds the dict.

    >>> from xcoll.testing import xla_cpu_env
    >>> xla_cpu_env(4)["CPU_NUM_DEVICES"], xla_cpu_env(4)["XLA_THREAD_POOL_SIZE"]
    ('4', '16')
    """
    return {
        "PJRT_DEVICE": "CPU",
        "CPU_NUM_DEVICES": str(world_size),
        "PJRT_CPU_ASYNC_CLIENT": "false",
        "XLA_NO_SPECIAL_SCALARS": "1",
        "XLA_THREAD_POOL_SIZE": str(pool_size(world_size)),
    }


def xla_counters() -> dict[str, int]:
    """Process-wide torch_xla counts: graph executions and compilations.

    Call it from a replica (``pool.run(xla_counters)``); in a thread-per-device
    pool it counts all replicas together. Read once they stop moving (two
    reads 50 ms apart agree, within 1 s): torch_xla counts an execution when it
    ends, on the device's thread, which can be just after the fetch that
    waited for it has returned, so a read right after a call could miss it and
    the next read count it (seen in the tests and the benchmark, under load).

    Returns:
        ``{"executions": n, "compiles": m}`` since the process started.

    Raises:
        ImportError: torch_xla is not installed.
    """
    import torch_xla.debug.metrics as met

    def count(name: str) -> int:
        data = met.metric_data(name)
        return int(data[0]) if data else 0

    def read() -> dict[str, int]:
        return {"executions": count("ExecuteTime"), "compiles": count("CompileTime")}

    now = read()
    for _ in range(20):
        time.sleep(0.05)
        now, before = read(), now
        if now == before:
            break
    return now


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
        """Starts one worker: ``target(conn, log, *args)``, a module-level function
        of :mod:`xcoll.testing._workers` (spawn pickles it by reference)."""
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

    def stderr_tail(self, n: int = 8000) -> str:
        """The end of each worker's stderr, as the pool's errors quote it.

        After a fatal signal: the end of what came before faulthandler's dump
        (the native library's own message, e.g. XLA's abort) and the start of
        the dump (every thread's stack).

        Args:
            n: about how many characters in all, shared between the workers.

        Returns:
            The workers' tails, one after the other ("" before the first run).

        Raises:
            Nothing; a log that cannot be decoded is read with replacements.
        """
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
        _check_args(per_rank_args, self.world_size)
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
        """Stops the workers; the next :meth:`run` starts them afresh.

        Args:
            kill: kill them at once, instead of after their current call.

        Raises:
            Nothing; a worker that does not stop within 5 s is killed.
        """
        for proc, conn in zip(self._procs, self._conns, strict=True):
            if proc.is_alive() and not kill:
                try:
                    conn.send(None)
                except OSError:
                    pass
        for proc, conn in zip(self._procs, self._conns, strict=True):
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
    the calling process never initialises XLA. The worker starts at the first
    :meth:`run`, and again after a crash; README.md has an example.

    Test your own code with it as it runs under ``torch_xla.launch`` on a CPU
    host: the replicas are threads of one process, as there. What works on
    them, from xcoll's first call on (tested in ``tests/test_xla_steps.py`` at
    W=2 and 4): ``xcoll.sync()``, ``torch_xla.sync()``, ``xm.mark_step()``
    and ``MpDeviceLoader`` (``torch_xla.sync`` is xcoll's on these threads),
    a lock of your own around them, training steps of ``sync=False`` calls
    with one sync each, per-replica Python scalars in pending work (each is
    data of its own). What does not: an ``.item()``, ``.cpu()`` or ``print``
    of a ``sync=False`` call's output before a sync has run it (each thread
    compiles that graph apart, and XLA aborts the process; xcoll prints a
    hint first: sync first), plain torch_xla collectives synced before
    xcoll's first call (the same race), and training steps under torch_xla's
    asynchronous CPU client (``env={"PJRT_CPU_ASYNC_CLIENT": "true"}``).
    docs/launchers.md has the reasons. Between runs the pool collects
    garbage, with every replica idle: a run's reference cycles that hold
    pending tensors (a dropped metric object) never join some replicas' next
    steps and not others' (within a run, the README's "On XLA" rule holds).

    Args:
        world_size: the number of replicas, W.
        device: ``"CPU"`` or ``"TPU"``.
        timeout: seconds a :meth:`run` waits for every replica by default.
        grace: seconds the other replicas get to return after one raised
            (they may wait forever in a collective it never reached), before
            they are reported as not having returned.
        env: more environment variables for the worker.

    Raises:
        ValueError: ``world_size`` is less than 1.
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

    def run(
        self,
        fn: Callable[..., Any],
        per_rank_args: Sequence[Any] | None = None,
        *,
        timeout: float | None = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
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
    main thread. The processes start at the first :meth:`run`, and again after
    a crash or a call that some ranks failed while others went on.

    Args:
        world_size: the number of processes, W.
        timeout: seconds a :meth:`run` waits for every process by default.
        grace: as in :class:`XlaPool`.
        collective_timeout: gloo's own timeout, in seconds, for a collective
            that some rank never joins.

    Raises:
        ValueError: ``world_size`` is less than 1.
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

    def run(
        self,
        fn: Callable[..., Any],
        per_rank_args: Sequence[Any] | None = None,
        *,
        timeout: float | None = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
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
