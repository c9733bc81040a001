"""Calls reached while Dynamo traces (``torch.compile``): one node of the
compiled graph, whose kernel is the eager call itself.

A call is traced where its tree is tensors in dicts, lists and tuples,
none on XLA, with
``to_cpu=False``, not ``uneven`` nor ``max_size``, its arguments valid and
its engine torch.distributed (or a world of one): :func:`call` puts it in
the graph as the custom op ``xcoll::call`` (with ``grad=True``, whose
backward is ``xcoll::backward``), so the graph is not broken, also with
``fullgraph=True``. Its kernel, run when the graph runs, makes the eager
call (:mod:`xcoll._core.grad`) on the leaves: the same packing, collectives,
guard and errors, so that a compiled replica meets an eager one (Dynamo runs
a frame eagerly after its recompile limit) and the results are the eager
ones bit for bit. Every other call is a graph break around the eager call.

What a call is (its op, tree structure, group, tag and place) is fixed
while it is traced: a :class:`Call`, kept in :data:`_calls` under a key made
of its contents, which the graph's node holds (the same key in every
process that traces the same call, as a graph that torch loads from its
compile cache holds it). Its place in a step (:mod:`xcoll._guard.steps`) is
read from Dynamo's frames while it traces: the frames below the compiled
function, which do not run when the graph runs.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from .. import _backends
from .._base import tree as _tree
from .._guard import steps as _steps
from . import call as _call
from . import grad as _grad
from . import ops as _ops


def _constant(fn: Any) -> Any:
    """``fn``, run while Dynamo traces, its result a constant of the graph
    (as ``torch.compiler.assume_constant_result`` marks it, which imports
    torch._dynamo: xcoll does not, until torch.compile does)."""
    fn._dynamo_marked_constant = True
    return fn


#: The bytes of the tensor that carries a traced forward's identity (its
#: backward's tag) to its backward.
IDENTITY = 4096
_FLAGS = ("stack", "sync", "to_cpu", "uneven", "grad")


@dataclass(frozen=True)
class Op:
    """A traced call's op and arguments, as its public function made them."""

    op: _ops.Op
    group: Any
    sync: bool
    tag: Any


@dataclass(frozen=True)
class Call:
    """A traced call: what its node's kernel runs."""

    op: Op
    #: Its place, as Dynamo traced it (None where it could not be read).
    place: _steps.Traced | None
    #: The tree's structure (torch.utils._pytree's: Dynamo traces it).
    spec: Any
    #: Its leaves (all tensors) in xcoll's order (optree's), each by its
    #: index in ``spec``'s order.
    order: tuple[int, ...]


#: What traced calls are, by key (kept: a graph that holds a key may run
#: at any time).
_ops_made: dict[str, Op] = {}
_places: dict[str, _steps.Traced | None] = {"": None}
_calls: dict[str, Call] = {}


def call(fn: Any, tree: Any, params: dict[str, Any]) -> Any:
    """Public call ``fn`` (:mod:`xcoll._collectives`) of ``tree`` with its
    keyword arguments ``params``, reached while Dynamo traces: a node of the
    graph where it is traced, else a graph break around the eager call."""
    group = params.pop("group")
    key = _made(fn.__name__, params, group, _traces(tree, params, group))
    if not key:
        return _eagerly(fn, tree, group, params)
    out = _node(key, _place(), tree, _order)
    return pytree.tree_unflatten(list(out), pytree.tree_structure(tree))


def asked(fn: Any, group: Any) -> int:
    """:func:`xcoll.rank` or :func:`xcoll.world_size` (``fn``) reached while
    Dynamo traces: a constant of the graph on torch.distributed (a process
    is a replica), else a graph break around it (on XLA:CPU a replica is a
    thread, and threads share their compiled graphs)."""
    if _process_is_replica(group) and (group is None or isinstance(group, dist.ProcessGroup)):
        return _asked(fn.__name__, group)
    return _eagerly(fn, group, None, None)


#: What Dynamo names as the reason of a graph break around a call.
_WHY_EAGERLY = (
    "xcoll: this call runs eagerly, a graph break (a call of Python scalar leaves, "
    "containers other than dict, list and tuple, to_cpu, uneven or max_size, xcoll.sync, objects, RNG states, a call on XLA, or arguments the "
    "eager call refuses: docs/design.md, 'Under torch.compile')"
)


def eagerly(fn: Any, group: Any) -> Any:
    """Public call ``fn`` of ``group`` alone (:func:`xcoll.sync`) reached
    while Dynamo traces: a graph break around the eager call."""
    _process_is_replica(group)  # (run while Dynamo traces: it marks _eagerly)
    return _eagerly(fn, group, None, None)


def _eagerly(fn: Any, tree: Any, group: Any, params: dict[str, Any] | None) -> Any:
    """Public call ``fn``, made eagerly: one graph break."""
    return fn(tree) if params is None else fn(tree, group=group, **params)


@_constant
def _process_is_replica(group: Any) -> bool:
    _installed()
    return group is not None or not _backends.xla_runtime_running()


@_constant
def _asked(name: str, group: Any) -> int:
    t = _backends.current(group)
    return t.world if name == "world_size" else t.rank()


def _traces(tree: Any, params: dict[str, Any], group: Any) -> bool:
    """Whether a call can be traced (see the module's docstring)."""
    if any(k in params and params[k] is not True and params[k] is not False for k in _FLAGS):
        return False
    if params.get("to_cpu") or params.get("uneven") or params.get("max_size") is not None:
        return False
    if any(isinstance(v, torch.SymInt) for v in params.values()):
        return False
    leaves = pytree.tree_leaves(tree)
    if not leaves or not _of_tensors(tree) or any(t.device.type == "xla" for t in leaves):
        return False
    return group is None or isinstance(group, dist.ProcessGroup)


def _of_tensors(tree: Any) -> bool:
    """Whether ``tree`` is tensors in dicts, lists and tuples (and None):
    what its node's kernel rebuilds as it was (a graph's constants are
    FX's immutable dicts and lists, which lose a dict's subclass)."""
    if type(tree) is dict:
        return all(_of_tensors(v) for v in tree.values())
    if type(tree) is list or type(tree) is tuple:
        return all(_of_tensors(v) for v in tree)
    return tree is None or isinstance(tree, torch.Tensor)


@_constant
def _made(name: str, params: dict[str, Any], group: Any, traces: bool) -> str:
    """The key of call ``name``'s :class:`Op`, made and kept; "" where the
    call is not traced (``traces`` is False, its engine is not
    torch.distributed nor a world of one, or its public function refuses its
    arguments). Run while Dynamo traces: a constant of the graph."""
    if not _process_is_replica(group) or not traces:
        return ""
    try:
        _steps.check(params["tag"]) if params["tag"] is not None else None
        op = _op(name, params)
    except (TypeError, ValueError):  # (the eager call raises it, on every replica)
        return ""
    # (the world size too: a graph that torch's compile cache keeps on disk is
    # found by its key, whose outputs' shapes it fixed, by a job of another size)
    where = ("" if group is None else group.group_name, _backends.current(group).world)
    key = hashlib.sha256(repr((name, sorted(params.items()), where)).encode()).hexdigest()
    _ops_made.setdefault(key, Op(op, group, params["sync"], params["tag"]))
    return key


def _op(name: str, p: dict[str, Any]) -> _ops.Op:
    """Call ``name``'s op, as its public function makes it."""
    if name == "gather":
        return _ops.Gather(p["dim"], p["stack"], p["grad"])
    if name == "reduce":
        return _ops.Reduce(p["op"], p["grad"])
    if name == "broadcast":
        return _ops.Broadcast(p["src"], p["grad"])
    if name == "reduce_scatter":
        return _ops.ReduceScatter(p["op"], dim=p["dim"], grad=p["grad"])
    return _ops.AllToAll(dim=p["dim"], grad=p["grad"])


@_constant
def _place() -> str:
    """The key of the place Dynamo is tracing now, kept: its frames from
    here up to the compiled function (run while Dynamo traces: a constant
    of the graph)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx: Any = InstructionTranslator.current_tx()
        frames = []
        while tx is not None:
            frames.append((tx.f_code, tx.lineno, tx.f_globals.get("__name__", "")))
            tx = getattr(tx, "parent", None)
    except (ImportError, AttributeError):  # (Dynamo's internals: the call's own frames are taken)
        return ""
    where = _steps.traced_place(frames)
    key = repr(where)
    _places.setdefault(key, where)
    return key


#: What every traced call reads, and ``xcoll::done`` after it writes (by
#: its schema; it writes nothing): a tensor outside the graph, so that no
#: compiler leaves out a call whose outputs are unused, or reorders two
#: calls (each replica's collectives run in the program's order, as an
#: eager replica's do); and, not a constant, it keeps fake tensors from
#: running a call on constant inputs for real while the graph is traced.
_order = torch.empty(0)


def _node(key: str, place: str, tree: Any, order: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The call's node: run while the graph is traced (by Dynamo, then by
    AOTAutograd, on fake tensors); ``xcoll::call`` in the graph."""
    tree = _plain(tree)
    leaves, spec = pytree.tree_flatten(tree)
    whole = hashlib.sha256(repr((key, place, spec)).encode()).hexdigest()
    if whole not in _calls:
        indices = _tree.flatten(pytree.tree_unflatten(list(range(len(leaves))), spec)).leaves
        _calls[whole] = Call(_ops_made[key], _places[place], spec, tuple(indices))
    o = _calls[whole].op
    if not o.op.grad:  # (as eagerly: outputs that carry no gradient)
        if "warned" not in _grad._once.__dict__ and torch.is_grad_enabled():
            _grad.warn_without_grad(o.op.name, _tree.flatten(tree), _backends.current(o.group), 5)
        leaves = [t.detach() for t in leaves]
    call, done, _ = _custom_ops()
    out = call(leaves, order, whole)[: len(leaves)]
    done(order, [t.detach() for t in out])
    return tuple(out)


@functools.cache
def _installed() -> None:
    """Marks :func:`_node` a node of the graph and :func:`_eagerly` a graph
    break, once Dynamo runs (xcoll does not import it)."""
    global _eagerly
    torch._dynamo.allow_in_graph(_node)
    _eagerly = torch.compiler.disable(_eagerly, recursive=True, reason=_WHY_EAGERLY)


def _plain(x: Any) -> Any:
    """``x`` (:func:`_of_tensors`) with FX's immutable containers, into
    which a graph's constants are made, as the dict and list the call was
    given."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_plain(v) for v in x]
    if isinstance(x, tuple):
        return tuple(_plain(v) for v in x)
    return x


def _forward(leaves: list[torch.Tensor], order: torch.Tensor, key: str) -> list[torch.Tensor]:
    """``xcoll::call``'s kernel: the eager call; its outputs in ``spec``'s
    order (and, with ``grad=True``, its identity's bytes)."""
    c = _calls[key]
    o = c.op
    tree = pytree.tree_unflatten(leaves, c.spec)
    with _steps.traced(c.place):
        if not o.op.grad:
            out = _grad.call(o.op, tree, o.group, sync=o.sync, to_cpu=False, tag=o.tag)
            return _owned(pytree.tree_leaves(out), leaves)
        p = _call.prepare(o.op, tree, o.group, o.sync, False)
        if p.error is not None:  # (raised on every replica)
            _call.called(o.op, p, sync=o.sync, to_cpu=False, tag=o.tag)
        out, _, _, identity = _grad.forward(o.op, p, sync=o.sync, to_cpu=False, tag=o.tag)
    ordered: list[Any] = [None] * len(leaves)
    for i, t in zip(c.order, out, strict=True):
        ordered[i] = t
    text = identity.text.encode()
    if len(text) > IDENTITY:
        raise ValueError(f"{o.op.name}: its tag is longer than {IDENTITY} bytes: {identity.text[:200]}...")
    return [*_owned(ordered, leaves), torch.frombuffer(bytearray(text.ljust(IDENTITY, b"\0")), dtype=torch.uint8)]


def _owned(out: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``out``, each at the start of storage of its own (a custom op's
    outputs may share none with its inputs or one another, and inductor
    takes them aligned: an eager call's outputs may be views of one
    result), each pending output completed."""
    seen = {t.untyped_storage().data_ptr() for t in inputs}
    owned = []
    for t in out:
        if type(t) is not torch.Tensor or t.storage_offset() or t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        owned.append(t)
    return owned


def _done(order: torch.Tensor, outs: list[torch.Tensor]) -> None:
    """``xcoll::done``: nothing (see :data:`_order`)."""


def _forward_shapes(leaves: list[torch.Tensor], order: torch.Tensor, key: str) -> list[torch.Tensor]:
    """``xcoll::call``'s outputs' shapes, dtypes and devices."""
    c = _calls[key]
    o = c.op.op
    world = _backends.current(c.op.group).world
    out = [_shaped(o, t, world) for t in leaves]
    return [*out, torch.empty(IDENTITY, dtype=torch.uint8)] if o.grad else out


def _shaped(o: _ops.Op, t: torch.Tensor, world: int) -> torch.Tensor:
    shape = list(t.shape)
    if type(o) is _ops.Gather:
        if not shape:
            return t.new_empty(world)
        d = o.dim % (len(shape) + o.stack)
        if o.stack:
            shape.insert(d, world)
        else:
            shape[d] *= world
    elif type(o) is _ops.ReduceScatter and shape:
        shape[o.dim % len(shape)] //= world
    return t.new_empty(shape)


def _context(ctx: Any, inputs: tuple[Any, ...], output: list[torch.Tensor]) -> None:
    leaves, _, key = inputs
    if _calls[key].op.op.grad:
        ctx.key = key
        ctx.save_for_backward(*leaves, output[-1])
        ctx.outs = [(t.shape, t.dtype, t.device) for t in output[:-1]]


def _backward_formula(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[Any, None, None]:
    """``xcoll::call``'s backward: ``xcoll::backward`` of its output
    gradients (zeros for an output that got none, as eagerly)."""
    *leaves, identity = ctx.saved_tensors
    full = [
        g if g is not None else torch.zeros(s, dtype=d, device=dev)
        for g, (s, d, dev) in zip(grads, ctx.outs, strict=False)
    ]
    got = iter(_custom_ops()[2](full, leaves, identity, ctx.key))
    return [next(got) if t.is_floating_point() else None for t in leaves], None, None


def _backward(
    grads: list[torch.Tensor], leaves: list[torch.Tensor], identity: torch.Tensor, key: str
) -> list[torch.Tensor]:
    """``xcoll::backward``'s kernel: the eager backward of the forward call,
    named by the forward's identity; the floating leaves' gradients."""
    c = _calls[key]
    o = c.op
    p = _call.prepare(o.op, pytree.tree_unflatten(leaves, c.spec), o.group, o.sync, False)
    assert p.flat is not None  # (the forward ran on these leaves)
    rule = _grad.rule(o.op, p.flat)
    text = bytes(identity.tolist()).rstrip(b"\0").decode()
    got = _grad.backward(rule, p.transport, o.group, _steps.Identity(text), None, [grads[i] for i in c.order])
    ordered: list[Any] = [None] * len(leaves)
    for i, g in zip(c.order, got, strict=True):
        ordered[i] = g
    return _owned([g for g, t in zip(ordered, leaves, strict=True) if t.is_floating_point()], [*grads, *leaves])


def _backward_shapes(
    grads: list[torch.Tensor], leaves: list[torch.Tensor], identity: torch.Tensor, key: str
) -> list[torch.Tensor]:
    return [torch.empty_like(t) for t in leaves if t.is_floating_point()]


@functools.cache
def _custom_ops() -> tuple[Any, Any, Any]:
    """``xcoll::call``, ``xcoll::done`` and ``xcoll::backward``, defined at
    their first use."""
    forward = torch.library.custom_op("xcoll::call", _forward, mutates_args=())
    done = torch.library.custom_op("xcoll::done", _done, mutates_args=("order",))
    done.register_fake(_done)
    forward.register_fake(_forward_shapes)
    backward = torch.library.custom_op("xcoll::backward", _backward, mutates_args=())
    backward.register_fake(_backward_shapes)
    forward.register_autograd(_backward_formula, setup_context=_context)
    return forward, done, backward
