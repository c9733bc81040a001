"""The executor: one call's :class:`~xcoll._core.recipe.Recipe`, run straight
through: pack, collectives, verdict, unpack, outputs.

A move (gather, broadcast) joins every bucket's bytes into one buffer (one
kernel call) and makes one collective; a reduce packs and encodes its buckets
(one kernel call) and makes one collective per bucket. Then one wait, the
buffers cut back into buckets (one kernel call), and into outputs: on the
device with one kernel call, or with ``to_cpu`` on the host after one fetch
per call (a reduce's results fetched as they arrived, decoded on the host:
no computation after its collectives).

A world of one (on XLA, one whose outputs go to the host) makes no
collective: each is an identity, so each output is its leaf's own copy (a
reduce's leaf's through its reduction's encoding and back:
:func:`_identity`); on XLA the copies are the call's one fetch, after its
one sync. Packing, a program and a
split would cost more than everything else the call does.

Everything here reads the recipe, and asks its op (``r.op``) only the
op's own rules: how a wire is made (``wires``) and sent (``send``), how
results are decoded (``decoded``) and outputs finished (``finish``,
``python``, ``scalar``). The verdict of a one-sided broadcast (a receiver learns that ``src``'s
call differs only after taking part in every collective, as ``src`` does) is
returned, not raised, so that a caller whose protocol goes on can go on.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from typing import Any

import torch

from .._backends.base import TORCH, EngineError, Transport
from .._backends.hosted import Hosted
from .._base import memo as _memo
from .._base import tree as _tree
from .._encode import pack as _pack
from .._encode import wire as _wire
from .._guard import entry as _entry
from .._guard import header as _header
from .._guard import order as _order
from .._guard import verdict as _verdict
from . import pending as _pending
from .recipe import Recipe


def execute(
    r: Recipe,
    flat: _tree.Flat,
    transport: Transport,
    signature: _header.Signature | None,
    *,
    sync: bool = True,
    to_cpu: bool = False,
) -> tuple[Any, bool]:
    """The output tree, and whether the call's verdict is "agree" (False only
    for a receiver of a one-sided broadcast whose ``src``'s call differs:
    every other verdict that disagrees raises, the same on every replica).

    Outputs never require grad and never alias the inputs; Python scalar
    leaves come back as Python values (a gather's, as lists)."""
    # (copies of a leaf that requires grad would be recorded by autograd; a
    # differentiable call's forward runs with grad disabled already)
    if flat.grads and torch.is_grad_enabled():
        with torch.no_grad():
            return execute(r, flat, transport, signature, sync=sync, to_cpu=to_cpu)
    if r.identity or (not r.buckets and r.guard is None):  # (no collective)
        return _untravelled(r, flat, transport, to_cpu), True
    # The stages, each in this one frame (a call's depth to its engine is
    # short); each stage's buffers are dropped once used: on XLA whatever is
    # still referenced at the sync becomes a graph output of its own.
    t, host = transport, to_cpu
    if r.hosted and (sync or not transport.lazy):  # (a small call, on the host: _backends.hosted)
        leaves = _fetched(r, flat, transport) if transport.lazy else flat.leaves
        # (cut on the host: a lazy engine's outputs are uploaded after, from the host)
        t, host = Hosted(transport, leaves), to_cpu or transport.lazy
    mine = None
    if r.guard is not None:
        assert signature is not None
        mine = signature.header(r.guard, t)
    wires = _wires(r, flat, t, mine)
    if not sync and not t.lazy:  # (no Python scalars: refused without sync)
        return flat.treespec.unflatten(InFlight.started(r, flat, t, signature, mine, wires)), True
    results, read = _start(r, t, wires, signature, mine)
    del wires
    results = _complete(r, t, results, read, signature, mine)
    g = r.guard  # (a one-sided verdict's header is read after every collective)
    late = _verdict.arrived(g, t, results[0]) if g and g.when == "last" else None
    out = _outputs(r, flat, t, signature, mine, results, sync, host)
    if t is not transport and sync and not to_cpu and transport.device.type != "cpu":
        _uploaded(transport, flat, out)
    for i in flat.scalars:
        out[i] = r.op.python(out[i], flat.leaves[i])
    return flat.treespec.unflatten(out), late is None or (mine is not None and late == mine.wire)


def _untravelled(r: Recipe, flat, transport: Transport, to_cpu: bool) -> Any:
    """The output tree of a call that makes no collective: a world of one's
    (:func:`_identity`), or a call without elements or a guard."""
    if r.identity:
        out = _identity(r, flat, transport, to_cpu)
    else:
        out = _empties(r, flat, [None] * len(flat.leaves), to_cpu)
    for i in flat.scalars:
        out[i] = r.op.python(out[i], flat.leaves[i])
    return flat.treespec.unflatten(out)


def _identity(r: Recipe, flat, transport: Transport, to_cpu: bool) -> list[Any]:
    """The output leaves of a world of one (Python scalars as CPU tensors):
    each its leaf's own copy (fetched from a lazy engine), in the shape the
    collective gives, through its reduction's encoding and back (a reduce's NaN is
    the quiet NaN, its sum's -0.0 is +0.0, as in any world)."""
    out: list[Any] = [None] * len(flat.leaves)
    sent = r.tensor_leaves
    for leaf, copy in zip(sent, _copies(transport, [flat.leaves[i] for i in sent], to_cpu), strict=True):
        out[leaf] = copy
    for k, b in enumerate(r.buckets):
        reduction = r.reductions[k] if r.reductions else ""
        for leaf, shape in zip(b.tensor_leaves, r.shapes[k], strict=False):
            t = _encoded_and_back(out[leaf], reduction)
            out[leaf] = r.op.finish(r, leaf, t if t.shape == shape else t.reshape(shape))
        for s in b.scalars:
            out[s.leaf] = _encoded_and_back(r.op.scalar(flat.leaves[s.leaf], b.dtype), reduction)
    return _empties(r, flat, out, to_cpu)


def _fetched(r: Recipe, flat, transport: Transport) -> list[Any]:
    """A small call's leaves on a lazy engine, its tensor leaves fetched to
    the host (where one is pending, after one sync of what is pending, the
    caller's work too, as a program of its own)."""
    leaves = list(flat.leaves)
    sent = r.tensor_leaves
    for i, host in zip(sent, transport.fetch([leaves[i] for i in sent]), strict=True):
        leaves[i] = host
    return leaves


def _uploaded(transport: Transport, flat, out: list[Any]) -> None:
    """A small call's tensor outputs, cut on the host, uploaded to the
    engine's device in one call."""
    tensors = flat.tensors
    for i, up in zip(tensors, transport.upload_all([out[i] for i in tensors]), strict=True):
        out[i] = up


def _copies(transport: Transport, tensors: list[torch.Tensor], to_cpu: bool) -> list[torch.Tensor]:
    """New contiguous copies of ``tensors`` (on the host with ``to_cpu``): a
    lazy engine's by its sync (the caller's pending work runs with it) and
    one transfer, bit for bit."""
    if transport.lazy:
        return _verdict.synced(transport, tensors)
    return [
        t.to("cpu" if to_cpu else t.device, copy=True, memory_format=torch.contiguous_format)
        for t in tensors
    ]


def _encoded_and_back(t: torch.Tensor, reduction: str) -> torch.Tensor:
    """A reduce's ``t`` (consumed) as one replica's all-reduce by ``reduction`` gives it."""
    if not reduction or not t.is_floating_point():  # (integers and bools are their own encoding)
        return t
    flat = t if t.dim() == 1 else t.reshape(-1)
    out = _wire.decode_reduce(_wire.encode_reduce(flat, reduction, TORCH.bitcast), t.dtype, reduction, TORCH.bitcast)
    return out if t.dim() == 1 else out.view(t.shape)


def _outputs(r: Recipe, flat, transport: Transport, signature, mine, results, sync: bool, to_cpu: bool):
    """The output leaves from the collectives' ``results`` (consumed)."""
    out: list[Any] = [None] * len(flat.leaves)
    flats, header = r.op.decoded(r, transport, results, to_cpu)
    del results[:]
    # each live bucket's output pieces, and the header's piece (a reduce's:
    # bucket 0's first) if it is still to be read (lazy engines)
    kernels = TORCH if to_cpu else transport.kernels
    pieces = kernels.split(flats, r.shapes, r.casts) if flats else []
    del flats
    if r.header_in_bucket:
        header = pieces[0].pop(0)
    if r.guard is None or r.guard.when != "outputs":
        header = None
    blocks = _place(r, pieces, out)
    if r.empties:
        _empties(r, flat, out, to_cpu)
    del pieces
    # (an eager engine's on the host has its outputs there already: a
    # gloo call's, a small call's on the host)
    on_host = to_cpu or (not transport.lazy and transport.device.type == "cpu")
    if sync and not on_host and (blocks or header is not None or transport.lazy):
        blocks, header = _materialise(transport, blocks, header)
    if header is not None and mine is not None:  # (None: the outputs' metadata, :func:`_meta_outputs`)
        if sync:
            _verdict.check(transport, signature, _header.as_bytes(header), mine.decoded)
        else:  # (a lazy call's results exist only after the caller's sync)
            transport.defer(_verdict.Deferred.of(transport, signature, header, mine.decoded))
    for scalars, block, ints in zip(r.scalars, blocks, r.ints, strict=True):
        if ints:  # (Python ints read back exactly, as Python ints)
            _exact_ints(flat, scalars, block.tolist(), ints, out)
            continue
        for leaf, j in scalars:
            out[leaf] = block[..., j]
    return out


def _exact_ints(flat, scalars, values: list[int], reduction: str, out: list[Any]) -> None:
    """A reduce's Python ints, each read back from its reduced parts
    (:func:`xcoll._encode.pack.int_value`): exact, or an OverflowError for a
    product that may not fit, the same on every replica (every replica holds
    the same reduced parts)."""
    n = _pack.WIDTH[reduction]
    for leaf, j in scalars:
        value = _pack.int_value(values[j : j + n], reduction)
        if value is None:
            raise OverflowError(
                f"{flat.path(leaf)}: the product of the replicas' Python ints may not fit "
                "in int64 (their magnitudes, each rounded up to a power of two, multiply "
                "past 2**63), and xcoll returns no wrapped value; reduce a tensor instead "
                "(torch.tensor(v): its product wraps as int64 does), or multiply the values "
                "of xcoll.gather(v) in Python"
            )
        out[leaf] = value


def _wires(r: Recipe, flat, transport: Transport, mine) -> list[torch.Tensor]:
    """The buffers the call's collectives send (:meth:`~xcoll._core.ops.Packed.wires`),
    the header a part of its own."""
    leaves = transport.own_buffers(flat)
    parts = list(map(_pack.parts, r.buckets, repeat(leaves), repeat(transport.upload)))
    head = [[mine.part]] if mine is not None else []
    return r.op.wires(r, transport, parts, head)


def _start(r: Recipe, transport: Transport, wires, signature, mine) -> tuple[list[torch.Tensor], bool]:
    """Starts every collective of the call, in order; returns their results,
    and whether the first one's header has been read. Where it is to be read
    before the others start (:attr:`Recipe.early`: a call whose buckets
    differ in number stops there), and there are others, it is waited for
    and read first, so that a call has started all its collectives when it
    returns, in flight or not: a completion starts none
    (:mod:`xcoll._guard.order`). A small first one is sent in the one size
    class of :data:`~xcoll._encode.pack.SMALL` bytes (:attr:`Recipe.first`)."""
    n, size = r.first  # (every element size divides SMALL)
    wire = wires[0]
    if size and r.segments > 1:
        wire = _padded(wire, r.segments, size)
    elif size:
        wire = wire.new_zeros(size)
        wire[:n] = wires[0]
    results = [r.op.send(transport, wire, 0, r)]
    rest = wires[1:]
    read = r.early and bool(rest)
    if read:
        transport.wait()
        results[0] = _first(r, transport, results[0], signature, mine)
    # (eager engines start every collective asynchronously)
    if rest:
        results += [r.op.send(transport, w, k, r) for k, w in enumerate(rest, 1)]
    transport.flush()
    return results, read


def _complete(r: Recipe, transport: Transport, results, read: bool, signature, mine) -> list[torch.Tensor]:
    """Every collective's result, waited for, the first one's header read
    where it is read early and was not yet (:func:`_start`)."""
    transport.wait()
    if r.early and not read:
        results[0] = _first(r, transport, results[0], signature, mine)
    return results


def _first(r: Recipe, transport: Transport, result, signature, mine) -> torch.Tensor:
    """The first collective's ``result``, arrived, its header checked
    (:func:`xcoll._guard.verdict.check`), a small one's padding cut (a
    gather's rows stay padded: its segments are cut from each row by offset)."""
    n, size = r.first
    if size and r.rows == 1:
        result = result[:n]
    assert r.guard is not None  # (read early: a guarded call's)
    _verdict.check(transport, signature, _verdict.arrived(r.guard, transport, result), mine.wire)
    return result


def _padded(wire: torch.Tensor, segments: int, size: int) -> torch.Tensor:
    """``wire``'s segments, each padded with zeros to ``size`` elements."""
    out = wire.new_zeros(segments, size)
    out[:, : wire.numel() // segments] = wire.view(segments, -1)
    return out.view(-1)


def _place(r: Recipe, pieces, out: list[Any]) -> list[torch.Tensor]:
    """Each tensor slot's output from its piece (a gathered one whose replica
    axis moves, moved); returns the scalar blocks (a bucket's last piece,
    when it has scalars)."""
    for b, bucket_pieces in zip(r.buckets, pieces, strict=True):
        for leaf, t in zip(b.tensor_leaves, bucket_pieces, strict=False):
            out[leaf] = t
    for leaf in r.moved:
        if out[leaf] is not None:  # (an empty leaf's is placed moved already)
            out[leaf] = r.op.finish(r, leaf, out[leaf])
    if not r.scalars:
        return []
    return [p[-1] for b, p in zip(r.buckets, pieces, strict=True) if b.scalars]


def _empties(r: Recipe, flat, out: list[Any], to_cpu: bool) -> list[Any]:
    """The outputs of the tensor leaves without elements (nothing was sent)."""
    for leaf, shape, dtype in r.empties:
        device = "cpu" if to_cpu else flat.leaves[leaf].device
        out[leaf] = r.op.finish(r, leaf, torch.empty(shape, dtype=dtype, device=device))
    return out


def _materialise(transport: Transport, blocks: Sequence[torch.Tensor], header):
    """The scalar blocks and the header's piece on the host, for a call with
    ``sync`` whose outputs stay on the device: one sync and one fetch, in
    which the outputs materialise (with ``to_cpu`` they are on the host
    already; without ``sync`` there are no scalar blocks, the call was
    validated, and the header is read after the caller's sync). Only the
    outputs, the scalar blocks and the header are referenced here, so they
    alone become graph outputs."""
    fetch = _verdict.synced(transport, list(blocks) + ([header] if header is not None else []))
    return (fetch[:-1], fetch[-1]) if header is not None else (fetch, None)


class InFlight(_order.Call):
    """A ``sync=False`` call on an eager engine, all of its collectives
    started (:func:`_start`): completed, in order, by :mod:`xcoll._guard.order`."""

    def __init__(self, r: Recipe, flat, transport: Transport, signature, mine, results, read: bool):
        super().__init__(transport.group_key, signature.name if signature else r.op.name)
        self.r, self.flat, self.transport, self.signature, self.mine = r, flat, transport, signature, mine
        self.results, self.read = results, read
        self.likes: list[Any] = []

    @classmethod
    def started(cls, r: Recipe, flat, transport: Transport, signature, mine, wires) -> list[Any]:
        """Starts the call; returns its output leaves, each a
        :class:`~xcoll._core.pending.PendingTensor` (the caller may change
        its inputs at once: a wire that is an input's own bytes is copied)."""
        inputs = {_storage(flat.leaves[i]) for i in flat.tensors}
        wires = [w.clone() if _storage(w) in inputs else w for w in wires]
        results, read = _start(r, transport, wires, signature, mine)
        del wires
        call = cls(r, flat, transport, signature, mine, results, read)
        _order.started(call)
        call.likes = _likes.get(id(r), _meta_outputs, r, flat, transport, results)[1]
        device = transport.device
        return [
            None if like is None else _pending.PendingTensor(call, i, like, device)
            for i, like in enumerate(call.likes)
        ]

    def complete(self) -> list[Any]:
        # (its group claimed, as a call's is: a thread that uses an output
        # while another thread calls on the group is an error, not a race)
        t = self.transport
        claimed = _entry.claim(t, self.name)
        failed = True
        try:
            out = self._complete()
            failed = False
            return out
        except EngineError as e:
            raise _entry.engine_failure(t, self.name, e) from e
        finally:
            if claimed is not None:
                _entry.release(t, claimed, self.name, failed)

    def _complete(self) -> list[Any]:
        r, t, mine, signature = self.r, self.transport, self.mine, self.signature
        results = _complete(r, t, self.results, self.read, signature, mine)
        self.results = []
        g = r.guard
        late = _verdict.arrived(g, t, results[0]) if g and g.when == "last" else None
        out = _outputs(r, self.flat, t, signature, mine, results, True, False)
        self.flat = None
        if late is not None and late != mine.wire:
            _verdict.fire(t, signature, r.op.src)
        for got, like in zip(out, self.likes, strict=True):  # (what its outputs said they are)
            if like is not None and (got.shape != like.shape or got.dtype != like.dtype):
                raise AssertionError(f"{self.name}: an output in flight was {like}, it is {got}")
        return out


def _storage(t: torch.Tensor) -> int:
    """Where ``t``'s bytes are (an output in flight: its value's, which its
    use by this call's packing has completed)."""
    if isinstance(t, _pending.PendingTensor):
        t = t.value()
    return t.untyped_storage().data_ptr()


# id(recipe) -> (the recipe, its outputs' meta tensors): what a pending
# call's outputs are made like, before its collectives have completed
_likes: _memo.Memo[tuple[Recipe, list[Any]]] = _memo.Memo(locked=True)


def _meta_outputs(r: Recipe, flat, transport: Transport, results) -> tuple[Recipe, list[Any]]:
    """The outputs of ``r`` as meta tensors (their shapes, dtypes and
    strides): its decoding run once on meta tensors of its results' shapes."""
    metas = [torch.empty(x.shape, dtype=x.dtype, device="meta") for x in results]
    n, size = r.first
    if size and r.rows == 1:  # (as :func:`_complete` cuts it)
        metas[0] = metas[0][:n]
    return r, _outputs(r, flat, transport, None, None, metas, False, False)
