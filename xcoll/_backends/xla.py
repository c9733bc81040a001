"""PyTorch/XLA backend: collectives are traced into the replica's lazy graph.

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
  collectives never meet. A process-wide lock around the sync lets the first
  thread compile and the others hit the cache; with the asynchronous PJRT client
  the lock is released before execution ends. In a one-replica process it costs
  nothing. See :func:`sync` for why it then waits.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import torch
import torch_xla
import torch_xla.core.xla_builder as xb
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr

from .. import _memo, _pack, _tree, _wire
from . import Backend

SYNC_LOCK = threading.Lock()

_XLA_TYPES = {
    torch.float64: xb.Type.F64,
    torch.float32: xb.Type.F32,
    torch.float16: xb.Type.F16,
    torch.bfloat16: xb.Type.BF16,
    torch.int64: xb.Type.S64,
    torch.int32: xb.Type.S32,
    torch.int16: xb.Type.S16,
    torch.int8: xb.Type.S8,
    torch.uint8: xb.Type.U8,
}
_REDUCE_TYPES = {
    "sum": xm.REDUCE_SUM,
    "prod": xm.REDUCE_MUL,
    "max": xm.REDUCE_MAX,
    "min": xm.REDUCE_MIN,
}

# Built XLA computations (bitcasts by shape and dtypes, packs, unpacks and splits
# by the shapes of their parts), each built by one replica thread.
_computations: _memo.Memo[object] = _memo.Memo(locked=True)


def _wait(device: torch.device) -> None:
    torch_xla._XLAC._xla_wait_device_ops(devices=torch_xla._XLAC._xla_real_devices([str(device)]))


def sync(device: torch.device | None = None) -> None:
    """Runs this replica's pending graph and waits for it to finish.

    ``torch_xla.sync()`` runs under the process-wide lock (see the module
    docstring). Then it waits, so that each replica has one execution in flight:
    XLA:CPU's rendezvous cannot tell a replica's consecutive executions apart (all
    run as RunId 0), so a replica that runs ahead joins another execution's
    collective and every replica hangs (seen after a few dozen back-to-back calls
    at W=4). It waits for this device only: waiting for all devices would, in
    thread-per-device mode, wait on the other replicas' rendezvous.
    """
    device = device or torch_xla.device()
    with SYNC_LOCK:
        torch_xla.sync()
    _wait(device)


def _join(ops, shapes):
    """``ops`` (of ``shapes``) flattened and concatenated, in an XLA computation."""
    return xb.Op.concat_in_dim([q.reshape([_pack.numel(s)]) for q, s in zip(ops, shapes)], 0)


def _encode(op, dtype: torch.dtype):
    """_wire.encode_move in an XLA computation."""
    if dtype == torch.bool:
        return op.cast(xb.Type.U8)
    if dtype in _wire.BITS:
        return op.bitcast(_XLA_TYPES[_wire.BITS[dtype]])
    return op


def _decode(op, dtype: torch.dtype):
    """_wire.decode_move in an XLA computation."""
    if dtype == torch.bool:
        return op != op.zeros_like()
    if dtype in _wire.BITS:
        return op.bitcast(_XLA_TYPES[dtype])
    return op


# Settings under which the device keeps some dtypes in a narrower one: values of
# those dtypes would change in transit, so such leaves are refused.
_DOWNCASTS = {
    "XLA_USE_BF16": ((torch.float32, torch.float64), "bfloat16"),
    "XLA_DOWNCAST_BF16": ((torch.float32, torch.float64), "bfloat16"),
    "XLA_USE_32BIT_LONG": ((torch.int64,), "int32"),
}


class XlaBackend(Backend):
    def __init__(self, device: torch.device | None):
        self.device = torch.device(device) if device is not None else torch_xla.device()
        self._name = str(self.device)

    def validate(self, flat) -> None:
        narrowed = {}
        for var, (dtypes, to) in _DOWNCASTS.items():
            if os.environ.get(var, "0") not in ("", "0", "false", "False"):
                narrowed.update({d: (var, to) for d in dtypes})
        if xm.xla_device_hw(self.device) == "TPU":
            narrowed.setdefault(torch.float64, ("the TPU", "float32"))
        if not narrowed:
            return
        for i, leaf in enumerate(flat.leaves):
            dtype = leaf.dtype if isinstance(leaf, torch.Tensor) else _tree.scalar_dtype(leaf)
            if dtype in narrowed:
                why, to = narrowed[dtype]
                raise TypeError(
                    f"{flat.path(i)}: {dtype} is kept as {to} on this device ({why}), so its "
                    f"values would change in transit; convert the leaf yourself (e.g. to {to})"
                )

    def rank(self) -> int:
        return xr.global_ordinal()

    def world_size(self) -> int:
        return xr.world_size()

    def bitcast(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        computation = _computations.get(
            ("bitcast", tuple(t.shape), t.dtype, dtype),
            lambda: xb.create_computation(
                "xcoll_bitcast", lambda p: p.bitcast(_XLA_TYPES[dtype]), [xb.tensor_shape(t)]
            ),
        )
        return torch_xla._XLAC._xla_user_computation("xla::xcoll_bitcast", [t], computation)[0]

    def concat(
        self, parts: Sequence[torch.Tensor], shapes: Sequence[tuple[int, ...]]
    ) -> torch.Tensor:
        # One small XLA computation per list of shapes: one node in the traced
        # graph instead of a reshape per leaf and a cat (10x less tracing at 256
        # leaves, measured: 0.12 ms against 1.25 ms).
        computation = _computations.get(
            ("concat", parts[0].dtype, tuple(shapes)),
            lambda: xb.create_computation(
                "xcoll_concat", lambda *ps: _join(ps, shapes), [xb.tensor_shape(p) for p in parts]
            ),
        )
        return torch_xla._XLAC._xla_user_computation("xla::xcoll_concat", list(parts), computation)[
            0
        ]

    # A move's buckets are packed by one XLA computation and unpacked by another,
    # each one node of the traced graph (every torch call a replica thread makes
    # can hand the GIL to another replica; at W=4 on 2 cores the calls, not the
    # work, were most of a call's time). They lower _wire's move encoding: float
    # bits as the integer of the same width, bool as uint8.

    def pack_moves(
        self, parts: Sequence[Sequence[torch.Tensor]], shapes: Sequence[Sequence[tuple[int, ...]]]
    ) -> list[torch.Tensor]:
        dtypes = [p[0].dtype for p in parts]
        flat = [t for p in parts for t in p]

        def build():
            def pack(*params):
                wires, at = [], 0
                for dtype, bucket_shapes in zip(dtypes, shapes):
                    ops = params[at : at + len(bucket_shapes)]
                    at += len(bucket_shapes)
                    wires.append(_encode(_join(ops, bucket_shapes), dtype))
                return xb.Op.tuple(wires)

            return xb.create_computation("xcoll_pack", pack, [xb.tensor_shape(t) for t in flat])

        key = ("pack_moves", tuple(dtypes), tuple(tuple(s) for s in shapes))
        return list(
            torch_xla._XLAC._xla_user_computation("xla::xcoll_pack", flat, _computations.get(key, build))
        )

    def unpack_moves(
        self,
        results: Sequence[torch.Tensor],
        dtypes: Sequence[torch.dtype],
        sizes: Sequence[Sequence[int]],
        world: int | None,
    ) -> list[torch.Tensor]:
        def build():
            def unpack(*params):
                out = []
                for p, dtype, n in zip(params, dtypes, sizes):
                    p = _decode(p, dtype)
                    if world and world > 1:  # each slot's (W, size) block made contiguous
                        p = xb.Op.concat_in_dim(
                            [
                                p.reshape([world, sum(n)])
                                .slice_in_dim(a, a + k * m, 1)
                                .reshape([world, k, m])
                                .transpose([1, 0, 2])
                                .reshape([world * k * m])
                                for a, k, m in _pack.runs(n)
                            ],
                            0,
                        )
                    out.append(p)
                return xb.Op.tuple(out)

            return xb.create_computation(
                "xcoll_unpack", unpack, [xb.tensor_shape(r) for r in results]
            )

        key = ("unpack_moves", tuple(dtypes), tuple(tuple(n) for n in sizes), world)
        return list(
            torch_xla._XLAC._xla_user_computation(
                "xla::xcoll_unpack", list(results), _computations.get(key, build)
            )
        )

    def split(
        self, flats: Sequence[torch.Tensor], shapes: Sequence[Sequence[tuple[int, ...]]]
    ) -> list[list[torch.Tensor]]:
        # One node with an output per piece, instead of a slice and a reshape
        # traced per leaf.
        def build():
            def cut(*params):
                pieces = []
                for p, bucket_shapes in zip(params, shapes):
                    offset = 0
                    for shape in bucket_shapes:
                        n = _pack.numel(shape)
                        pieces.append(p.slice_in_dim(offset, offset + n, 0).reshape(list(shape)))
                        offset += n
                return xb.Op.tuple(pieces)

            return xb.create_computation("xcoll_split", cut, [xb.tensor_shape(f) for f in flats])

        key = ("split", tuple(f.dtype for f in flats), tuple(tuple(s) for s in shapes))
        pieces = iter(
            torch_xla._XLAC._xla_user_computation(
                "xla::xcoll_split", list(flats), _computations.get(key, build)
            )
        )
        return [[next(pieces) for _ in bucket_shapes] for bucket_shapes in shapes]

    def _fresh_token(self) -> None:
        # Isolates each collective from NaN in the results of earlier ones (the
        # caller's, when sync=False, or this call's), and, from wait(), the
        # caller's later collectives from this call's.
        torch_xla._XLAC._set_all_reduce_token(self._name, None)

    def all_gather(self, buf: torch.Tensor) -> torch.Tensor:
        self._fresh_token()
        # xm.all_gather(buf, pin_layout=False) without its token lookup (this
        # form of all-gather does not use it)
        return torch_xla._XLAC._xla_all_gather(buf, 0, xr.world_size(), [], False, None, None)

    def all_reduce(self, buf: torch.Tensor, op: str) -> torch.Tensor:
        self._fresh_token()
        return xm.all_reduce(_REDUCE_TYPES[op], buf, pin_layout=False)

    def wait(self) -> None:
        self._fresh_token()

    def broadcast(self, buf: torch.Tensor, src: int) -> torch.Tensor:
        # Integer sum with zeros from every other replica: exact, and nothing of
        # theirs (NaN included: the wire is integer) reaches the result. The
        # mask is uploaded data, so every replica traces the same graph.
        is_src = self.upload(torch.tensor([self.rank() == src]))
        return self.all_reduce(torch.where(is_src, buf, torch.zeros_like(buf)), "sum")

    def sync(self) -> None:
        sync(self.device)

    def to_host(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return list(torch_xla._XLAC._xla_get_cpu_tensors(list(tensors)))

    def exchange(self, buf: torch.Tensor) -> torch.Tensor:
        out = self.all_gather(buf)
        self._fresh_token()
        with SYNC_LOCK:  # runs the graph of ``out`` alone, not everything pending
            torch_xla._XLAC._xla_sync_multi([out], devices=[], wait=False)
        _wait(self.device)
        return self.to_host([out])[0].view(self.world_size(), -1)
