"""Calls traced by Dynamo (``torch.compile``) on torch.distributed: the
call becomes part of the compiled graph, as PyTorch's functional collectives
(``torch.distributed._functional_collectives``) do, instead of a graph break.

What is traced (:func:`traces` decides, from the call's arguments alone):
``gather`` (``grad=True`` too), ``reduce`` with one op for every leaf, and
``broadcast``, of trees of tensors, ``sync=True``, on torch.distributed (or a
world of one). Every other call (Python scalar leaves, XLA leaves, ``to_cpu``,
``sync=False``, ``uneven``, ``tag=``, a tree of ops, ``grad=True`` on a reduce
or broadcast, ``reduce_scatter``, ``all_to_all``) runs eagerly, as a graph
break around it (:func:`xcoll._collectives._outside`).

Each traced call makes the collectives that it makes eagerly: a gather and a
broadcast one over the tree's bytes (a differentiable gather, one per dtype,
whose backward is a reduce-scatter per dtype), a reduce one per dtype. Its
guard travels in its first buffer as eagerly: a fingerprint of the call (its
name, parameters, tree structure and each leaf's dtype and number of dims,
hashed while Dynamo traces, a constant of the graph) and a hash of the
leaves' sizes (computed in the graph: sizes may be dynamic). What arrived is
checked in the graph: where the replicas' calls differ, every replica raises
``RuntimeError("xcoll.gather: replicas made different calls ...")`` when the
graph runs (``torch._assert_async``), before any output is used. It does not
name the difference: the eager call does (run without ``torch.compile``).

Leaves are taken in ``torch.utils._pytree``'s order (which Dynamo traces;
optree's C flatten it cannot): every replica of a compiled program packs them
alike, and the outputs are the eager call's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch.utils import _pytree as pytree

from .._backends.base import TORCH
from .._encode import pack as _pack
from .._encode import wire as _wire
from .._guard import header as _header

#: The header's bytes at the front of a moved buffer: the fingerprint's 8,
#: the sizes' hash (4), and 4 of padding (every dtype's width divides 16).
_HEAD = 16
#: The sizes' hash: a polynomial modulo a prime below 2**31 (products fit int64).
_P, _M = 1_000_003, 2_147_483_647
_REDUCE_OPS = {"sum": "sum", "mean": "sum", "max": "max", "min": "min"}
#: The engine's all-reduce ops, as a small reduce's rows are folded (as
#: :mod:`xcoll._backends.hosted` folds them)
_FOLD: dict[str, Callable[..., torch.Tensor]] = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


def traces(tree: Any, group: Any, **flags: Any) -> bool:
    """Whether a call with these arguments, reached while Dynamo traces, is
    traced (see the module's docstring); ``flags`` are the call's keyword
    arguments whose default is the only traced value."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        return False
    if any(v is not d for v, d in zip(flags.values(), _traced_flags(flags), strict=True)):
        return False
    leaves = pytree.tree_leaves(tree)
    return len(leaves) > 0 and all(
        isinstance(t, torch.Tensor) and t.device.type != "xla" and t.dtype != torch.bool for t in leaves
    )


def reduces(tree: Any, group: Any, op: Any, **flags: Any) -> bool:
    """:func:`traces` for a reduce by ``op``: one op for every leaf, a mean
    of floating leaves only (the eager call names the others' errors)."""
    if not isinstance(op, str) or op not in _REDUCE_OPS or not traces(tree, group, **flags):
        return False
    return op != "mean" or all(t.dtype.is_floating_point for t in pytree.tree_leaves(tree))


def _traced_flags(flags: dict[str, Any]) -> tuple[Any, ...]:
    # (sync: a graph's collectives complete where the compiler waits for them,
    # with sync=False or without: both are traced alike)
    defaults = {"to_cpu": False, "uneven": False, "max_size": None, "tag": None}
    return tuple(defaults[k] for k in flags)


def gather(tree: Any, dim: int, stack: bool, group: Any, grad: bool) -> Any:
    """:func:`xcoll.gather`, traced."""
    leaves, spec = pytree.tree_flatten(tree)
    world, group = world_of(group)
    dims = [_dim(t, dim, stack) for t in leaves]
    head = _head("xcoll.gather", f"dim={dim} stack={stack} grad={grad}", spec, leaves, world)
    if grad and any(t.requires_grad for t in leaves):
        blocks = list(_Gathered.apply(head, world, group, rank(group) if world > 1 else 0, *leaves))
    else:  # (detached, as the eager call's outputs are)
        blocks = _moved(_detached(leaves), head, world, lambda buf: _all_gather(buf, world, group), "xcoll.gather")
    out = [_placed(b, d, stack, world) for b, d in zip(blocks, dims, strict=True)]
    return pytree.tree_unflatten(out, spec)


def broadcast(tree: Any, src: int, group: Any) -> Any:
    """:func:`xcoll.broadcast`, traced."""
    leaves, spec = pytree.tree_flatten(tree)
    leaves = _detached(leaves)
    world, group = world_of(group)
    head = _head("xcoll.broadcast", f"src={src}", spec, leaves, world)
    small = sum(t.numel() * t.element_size() + 8 for t in leaves) + _HEAD <= _pack.SMALL
    if small:  # (an all-gather, as an eager small call: replicas whose sources differ meet)
        out = _moved(leaves, head, world, lambda buf: _all_gather(buf, world, group), "xcoll.broadcast")
        return pytree.tree_unflatten([b[src] for b in out], spec)
    out = _moved(leaves, head, 1, lambda buf: _broadcast(buf, src, world, group), "xcoll.broadcast")
    return pytree.tree_unflatten([b[0] for b in out], spec)


def reduce(tree: Any, op: Any, group: Any) -> Any:
    """:func:`xcoll.reduce` with one op for every leaf, traced: as eagerly,
    each dtype's leaves encoded (:func:`xcoll._encode.wire.encode_reduce`),
    and a small call's buffers all-gathered and folded in rank order (as
    :mod:`xcoll._backends.hosted` does), a larger one's all-reduced."""
    leaves, order, spec = _in_optrees_order(tree)
    leaves = _detached(leaves)
    world, group = world_of(group)
    how = _REDUCE_OPS[op]
    head = _head("xcoll.reduce", f"op={op}", spec, leaves, world)
    buckets = [[i for i, t in enumerate(leaves) if t.dtype == d] for d in dict.fromkeys(t.dtype for t in leaves)]
    sent = [_wire.encode_reduce(torch.cat([leaves[i].reshape(-1) for i in b]), how, TORCH.bitcast) for b in buckets]
    if _HEAD + sum(x.numel() * x.element_size() + 8 for x in sent) <= _pack.SMALL:
        summed = _folded(sent, head, how, world, group)
    else:
        summed = _all_reduced(sent, head, [leaves[b[0]].dtype for b in buckets], how, world, group)
    out: list[torch.Tensor | None] = [None] * len(leaves)
    for b, got in zip(buckets, summed, strict=True):
        dtype = leaves[b[0]].dtype
        sizes = [leaves[i].numel() for i in b]
        means = [(0, sum(sizes))] if op == "mean" else []
        got = _wire.decode_reduce(got, dtype, how, TORCH.bitcast, means, world)
        for i, piece in zip(b, got.split(sizes), strict=True):
            out[order[i]] = piece.reshape(leaves[i].shape)
    return pytree.tree_unflatten(out, spec)


def _in_optrees_order(tree: Any) -> tuple[list[torch.Tensor], list[int], Any]:
    """``tree``'s leaves in optree's order (dict keys sorted), which the
    eager call packs them in: where a reduce's engine sums an element in an
    order that depends on its place in the buffer (gloo's ring), a leaf is
    summed as eagerly only at the eager call's place. Also the place of each
    in ``torch.utils._pytree``'s order, and that order's spec."""
    pairs, spec = pytree.tree_flatten_with_path(tree)
    order = sorted(range(len(pairs)), key=lambda i: tuple(_entry(e) for e in pairs[i][0]))
    return [pairs[i][1] for i in order], order, spec


def _entry(e: Any) -> tuple[str, Any]:
    """A path entry's sort key: a dict's key (as optree sorts them), a
    sequence's index, an attribute's name."""
    key = e.key if isinstance(e, pytree.MappingKey) else e.idx if isinstance(e, pytree.SequenceKey) else e.name
    return type(key).__name__, key


def _folded(sent: list[torch.Tensor], head: torch.Tensor, how: str, world: int, group: Any) -> list[torch.Tensor]:
    """A small reduce's encoded buffers, all-gathered behind ``head`` (one
    collective of :data:`~xcoll._encode.pack.SMALL` bytes, as eagerly),
    the headers checked, each buffer's rows folded in rank order."""
    rows = _moved(sent, head, world, lambda buf: _all_gather(buf, world, group), "xcoll.reduce")
    return [_fold_rows(r, how, world) for r in rows]


def _all_reduced(
    sent: list[torch.Tensor], head: torch.Tensor, dtypes: list[torch.dtype], how: str, world: int, group: Any
) -> list[torch.Tensor]:
    """A larger reduce's encoded buffers, all-reduced one by one, the first
    behind its header values (checked)."""
    out = []
    for k, buf in enumerate(sent):
        front = _reduce_header(head, dtypes[k], how, world) if k == 0 else None
        if front is not None:
            buf = torch.cat([_wire.encode_reduce(front[0].clone(), how, TORCH.bitcast), buf])
        got = buf if world == 1 else fc.wait_tensor(fc.all_reduce(buf, how, group))
        if front is not None:
            skip = front[0].numel()
            seen = _wire.decode_reduce(got[:skip].clone(), dtypes[k], how, TORCH.bitcast)
            torch._assert_async((seen == front[1]).all(), _differ("xcoll.reduce"))
            got = got[skip:]
        out.append(got.clone())
    return out


def distributed(group: Any) -> bool:
    """Whether a call on ``group`` traced now runs on torch.distributed."""
    return dist.is_initialized() and (group is None or isinstance(group, dist.ProcessGroup))


def rank(group: Any) -> int:
    """:func:`xcoll.rank` on torch.distributed, traced (a constant)."""
    return dist.get_rank(group if group is not None else dist.group.WORLD)


def world_of(group: Any) -> tuple[int, Any]:
    """The world size of ``group`` (1 where torch.distributed is not
    initialised: a world of one), and the group a collective takes."""
    if not dist.is_initialized():
        return 1, None
    group = group if group is not None else dist.group.WORLD
    return dist.get_world_size(group), group


def _detached(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach() for t in leaves]


def _dim(t: torch.Tensor, dim: int, stack: bool) -> int:
    if t.dim() == 0:
        return 0
    n = t.dim() + 1 if stack else t.dim()
    if not -n <= dim < n:
        raise ValueError(f"dim={dim} is out of range for a leaf of shape {tuple(t.shape)}")
    return dim % n


def _placed(block: torch.Tensor, d: int, stack: bool, world: int) -> torch.Tensor:
    """A gathered leaf, ``(W, *shape)``, as the eager call returns it."""
    if stack or block.dim() == 1:
        return block.movedim(0, d) if d else block
    if d == 0:
        return block.reshape(world * block.shape[1], *block.shape[2:])
    t = block.movedim(0, d)
    pre = t.shape
    return t.reshape(*pre[:d], world * pre[d + 1], *pre[d + 2 :])


def _head(name: str, params: str, spec: Any, leaves: list[torch.Tensor], world: int) -> torch.Tensor:
    """The call's 16 header bytes: its fingerprint (a constant of the graph)
    and the hash of its leaves' sizes (computed in it)."""
    static = _fingerprint(name, params, str(spec), tuple((str(t.dtype), t.dim()) for t in leaves), world)
    h = torch.zeros((), dtype=torch.int64)
    for t in leaves:
        for s in t.shape:
            h = (h * _P + s) % _M
    words = torch.cat([torch.tensor(static, dtype=torch.int32), h.reshape(1).to(torch.int32)])
    return torch.cat([words, torch.zeros(1, dtype=torch.int32)]).view(torch.uint8)


@torch.compiler.assume_constant_result
def _fingerprint(name: str, params: str, spec: str, leaves: tuple[Any, ...], world: int) -> tuple[int, int]:
    """The static part of a call's fingerprint, as two int32 words (run while
    Dynamo traces: its result is a constant of the graph)."""
    text = "\n".join(["traced", name, params, spec, repr(leaves), str(world)])
    digest = hashlib.sha256(text.encode()).digest()
    return (int.from_bytes(digest[:4], "little", signed=True), int.from_bytes(digest[4:8], "little", signed=True))


def _moved(leaves: list[torch.Tensor], head: torch.Tensor, rows: int, move: Any, name: str) -> list[torch.Tensor]:
    """The leaves' bytes, behind ``head``, moved by ``move`` (whose result
    has ``rows`` buffers); the header checked; each leaf's ``(rows, *shape)``."""
    pieces = [t.contiguous().reshape(-1).view(torch.uint8) for t in leaves]
    sizes = [p.numel() for p in pieces]
    pads = [-n % 8 for n in sizes]  # (every piece starts 8-byte aligned, for its view)
    parts = [head]
    for p, pad in zip(pieces, pads, strict=True):
        parts += [p, torch.zeros(pad, dtype=torch.uint8)] if pad else [p]
    got = move(_small(torch.cat(parts))).view(rows, -1)
    torch._assert_async((got[:, :_HEAD] == head).all(), _differ(name))
    out, at = [], _HEAD
    for t, n, pad in zip(leaves, sizes, pads, strict=True):
        out.append(got[:, at : at + n].view(t.dtype).reshape(rows, *t.shape))
        at += n + pad
    return out


class _Gathered(torch.autograd.Function):
    """A differentiable traced gather: forward, the tree's bytes moved as
    a gather without grad moves them; backward, the output gradients'
    reduce-scatter, summed as the eager backward sums them: a small one (4
    KiB) all-gathered behind the forward's header marked as a backward's
    (checked), each replica's rows folded in rank order; a larger one
    torch's reduce-scatter per dtype (gloo's order, unguarded)."""

    @staticmethod
    def forward(ctx: Any, head: torch.Tensor, world: int, group: Any, rank: int, *leaves: torch.Tensor) -> Any:
        blocks = _moved(list(leaves), head, world, lambda buf: _all_gather(buf, world, group), "xcoll.gather")
        ctx.save_for_backward(_backward_head(head, blocks))
        ctx.world, ctx.group, ctx.rank = world, group, rank
        ctx.leaves = [(t.shape, t.dtype) for t in leaves]
        return tuple(blocks)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        (back,) = ctx.saved_tensors
        world, group, rank = ctx.world, ctx.group, ctx.rank
        floating = [i for i, (_, d) in enumerate(ctx.leaves) if d.is_floating_point]
        dtypes = list(dict.fromkeys(ctx.leaves[i][1] for i in floating))
        buckets = [[i for i in floating if ctx.leaves[i][1] == d] for d in dtypes]
        # (each replica's gradients of every replica's rows, encoded as a sum's)
        sent = [
            _wire.encode_reduce(torch.cat([grads[i].reshape(world, -1) for i in b], 1).reshape(-1), "sum", TORCH.bitcast)
            for b in buckets
        ]
        if _HEAD + sum(x.numel() * x.element_size() + 8 for x in sent) <= _pack.SMALL:
            rows = _moved(sent, back, world, lambda buf: _all_gather(buf, world, group), "xcoll.gather backward")
            summed = [_fold_rows(r.view(world, world, -1)[:, rank], "sum", world) for r in rows]
        else:
            summed = [fc.wait_tensor(fc.reduce_scatter_tensor(x, "sum", 0, group)) for x in sent]
        out: list[torch.Tensor | None] = [None] * len(ctx.leaves)
        for b, d, got in zip(buckets, dtypes, summed, strict=True):
            got = _wire.decode_reduce(got, d, "sum", TORCH.bitcast)
            sizes = [ctx.leaves[i][0].numel() for i in b]
            for i, piece in zip(b, got.split(sizes), strict=True):
                out[i] = piece.reshape(ctx.leaves[i][0])
        return (None, None, None, None, *out)


def _backward_head(head: torch.Tensor, blocks: list[torch.Tensor]) -> torch.Tensor:
    """A differentiable gather's backward's header: its forward's 12 bytes
    flipped (it pairs with no forward call), then a checksum of what the
    forward gathered, which every replica holds alike: the backwards of two
    calls of one signature that gathered different values (each replica's
    loss through another one) differ, and raise."""
    words = torch.cat([b.detach().contiguous().reshape(-1).view(torch.uint8) for b in blocks]).to(torch.int64)
    weights = torch.arange(words.numel(), dtype=torch.int64) % _P + 1
    checksum = (words * weights).sum() % _M
    # (its 4 bytes by shifts: inductor cannot view a 1-element result as bytes)
    four = ((checksum >> torch.arange(0, 32, 8, dtype=torch.int64)) & 0xFF).to(torch.uint8)
    return torch.cat([head[:12] ^ 0xFF, four])



def _fold_rows(rows: torch.Tensor, how: str, world: int) -> torch.Tensor:
    """``how`` over ``rows`` (``(W, n)``) in rank order, as
    :mod:`xcoll._backends.hosted` folds a small call's rows."""
    acc = rows[0]
    for k in range(1, world):
        acc = _FOLD[how](acc, rows[k])
    return acc.clone() if world == 1 else acc


def _reduce_header(head: torch.Tensor, dtype: torch.dtype, how: str, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A reduce's header values in ``dtype``, made in the graph from
    ``head`` (its fingerprint's 64 bits, the sizes' hash folded in) as
    eagerly (:func:`xcoll._guard.header._values`: values and their squares,
    or their complements, then zeros to the eager header's size, so that
    the payload lies where it lies eagerly); and what they reduce to where
    every replica sent them."""
    words = head[:12].view(torch.int32).to(torch.int64)
    n = ((words[0] ^ words[2]) & 0xFFFFFFFF) | (words[1] << 32)
    k, size = _header_shape(dtype, how, world)
    v = (n >> torch.arange(0, 64, k, dtype=torch.int64)) & ((1 << k) - 1)
    if how == "sum":
        values = v if k == 1 else torch.cat([v, v * v])
    else:
        values = torch.cat([v, (1 << k) - 1 - v])
    values = torch.cat([values, values.new_zeros(size - values.numel())])
    return values.to(dtype), (values * world if how == "sum" else values).to(dtype)


@torch.compiler.assume_constant_result
def _header_shape(dtype: torch.dtype, how: str, world: int) -> tuple[int, int]:
    """A reduce header's bits per value and its size, as eagerly (run while
    Dynamo traces: constants of the graph)."""
    return _header._width(dtype, how, world), _header.alike_size(dtype, how, world)


def _small(buf: torch.Tensor) -> torch.Tensor:
    """``buf``, padded with zeros to :data:`~xcoll._encode.pack.SMALL` bytes
    where it is shorter (as an eager small call is: replicas whose calls
    differ then make collectives of one size, and the header names it,
    where the engine would fail on sizes that differ)."""
    short = _pack.SMALL // buf.element_size() - buf.numel()
    return torch.cat([buf, buf.new_zeros(short)]) if short > 0 else buf


def _all_gather(buf: torch.Tensor, world: int, group: Any) -> torch.Tensor:
    return buf if world == 1 else fc.wait_tensor(fc.all_gather_tensor(buf, 0, group))


def _broadcast(buf: torch.Tensor, src: int, world: int, group: Any) -> torch.Tensor:
    return buf if world == 1 else fc.wait_tensor(fc.broadcast(buf, src, group))


def _differ(name: str) -> str:
    return (
        f"{name}: replicas made different calls (checked in a graph compiled by torch.compile: "
        "run the step without torch.compile to have xcoll name the difference and both ranks)"
    )
