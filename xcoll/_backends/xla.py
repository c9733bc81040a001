"""PyTorch/XLA backend: collectives are traced into the replica's lazy graph
(:class:`XlaTransport`), and buffers are packed and cut by XLA computations
(:mod:`.xla_kernels`), in steps run under a lock (:mod:`.xla_step`).

Imported only when a leaf is on an XLA device (or the XLA runtime is running).
Facts this module relies on, measured on XLA:CPU (see docs/design.md):

* ``xm.all_gather(pin_layout=False)`` lowers to one real all-gather; the pinned
  default pads with the replica's ordinal, so replicas compile different graphs.
* Every collective adds torch_xla's numeric token to its input and derives the
  next token from its result, so a float collective turns -0.0 into +0.0 and a
  NaN result poisons later ones. The token is reset before each collective
  and once after a call's last one (``wait``), and xcoll's moves carry
  integers (see ``_wire``).
* ``Tensor.view(dtype)`` is not lowered (it runs on the CPU, outside the graph),
  so bitcasts are built as small XLA computations.
* XLA:CPU cannot all-reduce bfloat16 (``_wire`` sums half precision in float32).
* When thread-per-device replicas reach ``torch_xla.sync()`` together with a
  graph not yet compiled, each thread compiles its own executable and their
  collectives never meet. A process-wide lock around the step lets the first
  thread compile and the others hit the cache (:mod:`.xla_step` says how it
  is held). In a one-replica process it costs nothing. See :func:`sync` for why a step then
  waits.
* A ``sync=False`` call's verdict is read once its header is data, at this
  device's next xcoll call or sync (held here, :meth:`XlaTransport.ready`;
  read by :func:`xcoll._guard.verdict.settle`), never
  inside someone else's step: a read waits for the execution, and so for
  every replica's step.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr

from .._base import tree as _tree
from . import _xlac
from ._launch import launch_hint, pool_size, thread_pool
from .base import Deferred, Transport
from .xla_kernels import Keep, XlaKernels
from .xla_step import step, sync

# From the first XLA call on, 0-d values of 0 and 1 are data, not constants
# (docs/design.md, "One program on every replica").
_xlac.scalars_as_data()

_REDUCE_TYPES = {
    "sum": xm.REDUCE_SUM,
    "prod": xm.REDUCE_MUL,
    "max": xm.REDUCE_MAX,
    "min": xm.REDUCE_MIN,
}


# Settings under which the device keeps some dtypes in a narrower one: values of
# those dtypes would change in transit, so such leaves are refused.
_DOWNCASTS = {
    "XLA_USE_BF16": ((torch.float32, torch.float64), "bfloat16"),
    "XLA_DOWNCAST_BF16": ((torch.float32, torch.float64), "bfloat16"),
    "XLA_USE_32BIT_LONG": ((torch.int64,), "int32"),
}


_set_up = False
_cpu_threads = False  # (XLA:CPU replica threads: set up once per process)


def _set_up_process(device: torch.device) -> None:
    """Raises, naming the fix, where a launch would fail in XLA: several
    devices in a process that was not started as their replicas, or more
    XLA:CPU replica threads than torch_xla's thread pool has threads (only that many
    reach a collective, and XLA aborts the process after 10 s: "only 2 of
    them arrived", measured with ``torch_xla.launch`` at W=4 on 2 cores).
    Then, on XLA:CPU replica threads, makes ``torch_xla.sync`` xcoll's
    (:func:`own_sync`) and each traced scalar data of its own
    (:func:`_xlac.scalar_data_unshared`). Once per process."""
    global _set_up, _cpu_threads
    if _set_up:
        return
    hint = launch_hint(xla_leaves=True)
    if hint and xr.world_size() == 1:  # results would be W times too small
        raise RuntimeError("xcoll: XLA runs this process as a world of one" + hint)
    replicas = xr.addressable_runtime_device_count()
    cpu = replicas > 1 and xm.xla_device_hw(device) == "CPU"  # (measured there only)
    if cpu and xr.world_size() == 1:
        # XLA compiles collectives for every device it sees, with one replica
        # running them: its verifier then fails ("subgroup_size == 1 ||
        # shard_count == subgroup_size")
        raise RuntimeError(
            f"this process sees {replicas} XLA devices but runs as a world of one: start "
            "the function with torch_xla.launch(fn) (or xmp.spawn), which runs one replica "
            "per device, or make one device visible (CPU: CPU_NUM_DEVICES=1) "
            "(docs/launchers.md)"
        )
    if cpu:
        pool = thread_pool()
        if pool < replicas:
            raise RuntimeError(
                f"this process runs {replicas} XLA:CPU replicas as threads, but torch_xla's "
                f"thread pool has {pool} (XLA_THREAD_POOL_SIZE, default: the number of cores), "
                f"so only {pool} can reach a collective and XLA would abort the process; set "
                f"XLA_THREAD_POOL_SIZE={pool_size(replicas)} in the environment that starts "
                "the program, or import xcoll before the XLA runtime starts, which makes that "
                "the default (docs/launchers.md)"
            )
    if cpu:
        torch_xla.sync = own_sync
        xm.wait_device_ops = own_wait_device_ops
        _xlac.scalar_data_unshared()
    _set_up, _cpu_threads = True, cpu


def own_sync(wait: bool = False, reset_scope: bool = True) -> None:
    """``torch_xla.sync`` (what ``xm.mark_step()`` and ``MpDeviceLoader``
    call) on thread-per-device XLA:CPU replicas, from xcoll's first call
    there on: :func:`sync` of the calling thread's device (``reset_scope``
    is torch_xla's default). torch_xla's own, called by W replica threads at
    once, compiles a new graph once per thread, and the collectives never
    meet (measured: plain ``xm.all_reduce`` then ``torch_xla.sync()`` at W=2
    aborted 3 runs of 3); with nothing pending, its step locks device 0 as
    its barrier and waits for replica 0's execution. It waits for nothing
    (``wait`` too is moot), and verdicts of ``sync=False`` calls are read at
    the next xcoll call: a caller may sync under a lock of its own, and a
    wait there would wait for the replicas that wait for that lock. (The
    device's next step waits for this one's execution, before it takes
    xcoll's lock: :mod:`.xla_step`.)"""
    sync(torch_xla.device(), wait=False)


def own_wait_device_ops(devices: list[str] | None = None) -> None:
    """``xm.wait_device_ops`` on thread-per-device XLA:CPU replicas, from
    xcoll's first call there on: without ``devices``, a wait for the calling
    thread's device only (:func:`_xlac.wait_device`). torch_xla's own waits
    for every device of the process, and so for the other replica threads'
    collectives, which wait for this thread: torch.compile's openxla bridge
    calls it as it compiles a graph, on one replica thread while another is
    in an xcoll call, and XLA aborted the process."""
    if devices:
        _xlac.wait_devices(devices)
    else:
        _xlac.wait_device(torch_xla.device())


class XlaTransport(Transport):
    kernels = XlaKernels()
    lazy = True

    def __init__(self, device: torch.device | None):
        self.device = torch.device(device) if device is not None else torch_xla.device()
        self._key = str(self.device)
        _set_up_process(self.device)
        # What a call asks of its replica and of the device, fixed for the
        # process: its rank and world size, and the dtypes that the device
        # keeps narrower (torch_xla reads those settings when it starts).
        self._rank = xr.global_ordinal()
        self.world = xr.world_size()
        self._narrowed = _narrowed(self.device)
        self.replica_threads = _cpu_threads

    def validate(self, flat) -> None:
        if not self._narrowed:
            return
        for i, leaf in enumerate(flat.leaves):
            dtype = _tree.dtype_of(leaf)
            if dtype in self._narrowed:
                why, to = self._narrowed[dtype]
                raise TypeError(
                    f"{flat.path(i)}: {dtype} is kept as {to} on this device ({why}), so its "
                    f"values would change in transit; convert the leaf yourself (e.g. to {to})"
                )

    def own_buffers(self, flat):
        # A traced program has one parameter per device buffer, so a leaf whose
        # buffer is shared gives its replica a program of its own: a 0-d upload
        # (torch_xla caches those by value and shares them with equal scalars
        # anywhere in the graph, its collective token included), or one buffer
        # passed twice (t, t.detach()). Each such leaf is fetched (a transfer:
        # it is data, so nothing runs) and uploaded again (a 0-d one as 1-d:
        # torch_xla shares no upload of more than 0 dims), all in one call. A
        # pending tensor passed twice runs its graph alone first
        # (_run_repeated), then is split the same way. In a world of one too:
        # its program would depend on its values, and be compiled again for
        # each pattern of them.
        leaves = flat.leaves
        tensors, zero_d = flat.tensors, set(flat.zero_d)
        handles: Sequence[int | None] | None = _xlac.data_handles([leaves[i] for i in tensors])
        if handles is None:  # (one call if all are data) some are pending: asked one by one
            twice = len({id(leaves[i]) for i in tensors}) < len(tensors)
            if twice:
                _run_repeated(self.device, [leaves[i] for i in tensors])
            handles = [
                _xlac.data_handle(leaves[i]) if twice or i in zero_d else None for i in tensors
            ]
        if not zero_d and len(set(handles)) == len(handles):  # (no leaf shares a buffer)
            return leaves
        seen: set[int | None] = set()
        redo = []
        for i, h in zip(tensors, handles, strict=True):
            if h is not None and (i in zero_d or h in seen):
                redo.append(i)
            seen.add(h)
        if not redo:
            return leaves
        leaves = list(leaves)
        # (0-d: as 1-d, then a view, the same on every replica whose leaf is data)
        hosts = [h if h.dim() else h.reshape(1) for h in self.to_host([leaves[i] for i in redo])]
        for i, up in zip(redo, _xlac.upload(hosts, self.device), strict=True):
            leaves[i] = up if leaves[i].dim() else up[0]
        return leaves

    def upload_all(self, cpus):
        return _xlac.upload(cpus, self.device) if cpus else []

    def rank(self) -> int:
        return self._rank

    # The token is reset before each collective, which isolates it from NaN in
    # the results of earlier ones (the caller's, when sync=False, or this
    # call's), and once after the last (wait), which isolates the caller's
    # later collectives from this call's.

    def all_gather(self, buf: torch.Tensor) -> torch.Tensor:
        _xlac.reset_token(self.device)
        return _xlac.all_gather(buf, self.world)

    def all_reduce(self, buf: torch.Tensor, reduction: str) -> torch.Tensor:
        if self.world == 1:  # (``buf`` is the call's own: nothing to reduce)
            return buf
        _xlac.reset_token(self.device)
        return _xlac.all_reduce(buf, _REDUCE_TYPES[reduction])

    def reduce_scatter(self, buf: torch.Tensor, reduction: str) -> torch.Tensor:
        if self.world == 1:
            return buf
        _xlac.reset_token(self.device)
        return _xlac.reduce_scatter(buf, _REDUCE_TYPES[reduction], self.world, str(self.device))

    def all_to_all(self, buf: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return buf
        _xlac.reset_token(self.device)
        return _xlac.all_to_all(buf, self.world, str(self.device))

    def wait(self) -> None:
        _xlac.reset_token(self.device)

    def broadcast(self, buf: torch.Tensor, src: int, guard: int = 0) -> torch.Tensor:
        # Integer sum with zeros from every other replica: exact, and nothing of
        # theirs (NaN included: the wire is integer) reaches the result, except
        # the guard header, which every replica adds to. The mask is uploaded
        # data, so every replica traces the same graph.
        is_src = self.upload(torch.tensor([self.rank() == src]))
        kept = Keep(buf.dtype, buf.shape[0], guard)([is_src, buf])[0]
        return self.all_reduce(kept, "sum")

    def sync(self) -> None:
        sync(self.device)

    def sync_and_fetch(self, tensors):
        # Fetching an output of the execution waits for it, as sync's wait
        # would (one execution in flight per replica), and costs one wait less:
        # measured 0.3 ms per call at W=4 on 2 cores.
        step(self.device)
        _xlac.run_step_closures()
        return self.to_host(tensors)

    def fetch(self, tensors):
        # Where a leaf is pending, everything pending runs first (the caller's
        # work with it, as in any call's sync), as this replica's own program;
        # then this device has live pending tensors, so the step's barrier is
        # its own (_xlac.pending). Leaves that are data: a transfer, no step.
        # (One call over the leaves, not _xlac.pending's pass over every live
        # tensor of the device, a model's parameters included.)
        if tensors and _xlac.data_handles(tensors) is None:
            step(self.device)
            _xlac.run_step_closures()
        return self.to_host(tensors)

    def defer(self, verdict: Deferred) -> None:
        with _DEFERRED_LOCK:
            _deferred.setdefault(self._key, []).append(verdict)

    def ready(self) -> list[Deferred]:
        # (a call of this thread on another device settles that device's)
        return _ready(self._key) if _deferred.get(self._key) else []

    def to_host(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        # Bit for bit: torch_xla's float16 download makes every NaN the canonical
        # one, so a float16 tensor that came back holding NaN is fetched again as
        # its int16 bits (one small execution, only then). Data only: torch_xla
        # gives the copy of a tensor that requires grad requires_grad as well.
        hosts = _xlac.get_cpu_tensors(tensors)
        for k, (t, h) in enumerate(zip(tensors, hosts, strict=True)):
            if h.requires_grad:
                hosts[k] = h = h.detach()
            if t.dtype == torch.float16 and bool(torch.isnan(h).any()):
                bits = self.kernels.bitcast(t, torch.int16)
                # (stepped as every graph xcoll runs, under the lock)
                step(self.device, [bits])
                hosts[k] = _xlac.get_cpu_tensors([bits])[0].view(torch.float16)
        return hosts

    def gathered_alone(self, cpu: torch.Tensor) -> torch.Tensor:
        # (sent as int32 words where its size allows: a small exchange, padded
        # to the size class whatever its dtype, is then the one program that
        # every small call runs (Hosted's), which replicas whose calls differ meet)
        words = cpu.view(torch.int32) if cpu.numel() * cpu.element_size() % 4 == 0 else cpu
        out = self.all_gather(self.upload(words))
        _xlac.reset_token(self.device)
        step(self.device, [out])  # the graph of ``out`` alone, not everything pending
        _xlac.wait_device(self.device)
        return self.to_host([out])[0].view(self.world, -1).view(cpu.dtype)


# Deferred verdicts by device (XlaTransport.defer): a backward's call defers
# from autograd's thread, the replica's own thread settles.
_deferred: dict[str, list[Deferred]] = {}
_DEFERRED_LOCK = threading.Lock()


def _ready(device: str) -> list[Deferred]:
    """The deferred verdicts of ``device`` whose header is data (a sync has
    run their call), in the order of their calls, taken from the list."""
    with _DEFERRED_LOCK:
        waiting = _deferred.pop(device, [])
        if _xlac.data_handles([v.header for v in waiting]) is not None:  # (one call: all are)
            return waiting
        data = [_xlac.data_handle(v.header) is not None for v in waiting]
        rest = [v for v, d in zip(waiting, data, strict=True) if not d]
        if rest:
            _deferred[device] = rest
        return [v for v, d in zip(waiting, data, strict=True) if d]


def _run_repeated(device: torch.device, tensors: Sequence[torch.Tensor]) -> None:
    """Runs the graph of each pending tensor that ``tensors`` hold more than
    once, alone, and waits for it, so that it is data on every replica (and
    :meth:`XlaTransport.own_buffers`
    gives its second place a buffer of its own). torch_xla's graph cache keys
    a program by its nodes, not by which output reads which of them: a call
    of one signature whose pending leaves alias in another pattern ([a, a, c]
    after [a, c, a]) reused the first call's program and returned wrong
    values (measured: gradients of a world of one on XLA:CPU)."""
    seen: set[int] = set()
    repeated = []
    for t in tensors:
        if id(t) in seen and _xlac.data_handle(t) is None:
            repeated.append(t)
        seen.add(id(t))
    if repeated:
        step(device, repeated)
        _xlac.wait_device(device)


def _narrowed(device: torch.device) -> dict[torch.dtype, tuple[str, str]]:
    """The dtypes that ``device`` keeps in a narrower one: dtype -> (why, as what)."""
    out = {}
    for var, (dtypes, to) in _DOWNCASTS.items():
        if os.environ.get(var, "0") not in ("", "0", "false", "False"):
            out.update({d: (var, to) for d in dtypes})
    if xm.xla_device_hw(device) == "TPU":
        out.setdefault(torch.float64, ("the TPU", "float32"))
    return out


# One transport per device and thread: a transport holds its rank, which
# torch_xla keeps per thread (thread-per-device replicas), so one cached per
# device alone would give a thread that holds another replica's tensors that
# replica's rank.
_local = threading.local()


def transport(device: torch.device | None = None) -> XlaTransport:
    """This thread's transport of ``device`` (default: the thread's XLA
    device), made on its first call."""
    cache: dict[str, XlaTransport] = _local.__dict__.setdefault("transports", {})
    key = str(device if device is not None else torch_xla.device())
    t = cache.get(key)
    if t is None:
        t = cache[key] = XlaTransport(torch.device(key))
    return t
