"""Differentiable calls (``grad=True``): outputs that carry gradients back to
the inputs, through one guarded xcoll call in the backward.

Semantics: the total loss is the sum of every replica's loss. Each replica's
backward receives the gradients of its own outputs; what reaches its inputs
is the derivative of the total loss, which needs every replica's output
gradients:

* gather: the sum over replicas of the gradient's slice that is this
  replica's own rows: a reduce-scatter sum of the output gradients, each
  with its replicas' axis moved first;
* reduce: sum, the all-reduce sum of the output gradients; mean, their mean
  (the sum divided by W). Other reductions raise (:class:`xcoll._core.ops.Reduce`);
* broadcast: the sum of the output gradients on ``src``, zeros elsewhere;
* an uneven gather: its own rows of the all-reduce sum of the output
  gradients, found by the sizes that its forward exchanged (its backward's
  collective runs on its own, after the pending work, as the forward's
  does: the replicas' shapes differ);
* reduce-scatter: sum, the gather of the output gradients along ``dim``;
  mean, that divided by W;
* all-to-all: the same all-to-all of the output gradients (its own inverse).

So the backward is one xcoll call on the tree of output gradients (of the
floating tensor leaves), packed and guarded as every call is, of the
forward's op's dual, which its transpose names (:class:`~xcoll._core.ops.Transpose`,
named as the forward's backward). Which leaves travel, how their gradients are sent and how each
input's gradient is taken from the result depends only on the forward's op
and signature: a :class:`Rule`, made once per signature. A take that reads
this replica's rank reads it from uploaded data (a mask), so that on XLA
every replica traces one program.

On a lazy engine the backward runs with ``sync=False``: its collective joins
the backward's graph, and its guard is read after the caller's sync
(:class:`xcoll._guard.verdict.Deferred`). With ``create_graph=True`` the
backward is itself differentiable (its op runs with ``grad=True``), so
higher derivatives flow too.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import optree
import torch

from .._base import memo as _memo
from .._base import tree as _tree
from .._guard import header as _header
from .._guard import steps as _steps
from .._guard import verdict as _verdict
from . import call as _call
from . import ops as _ops


@dataclass(frozen=True)
class Rule:
    """How a differentiable call's gradients flow back, for one op and
    signature: which leaves travel, and the op's transpose
    (:class:`xcoll._core.ops.Transpose`)."""

    #: The forward's op (of its fields, only those its rule's key holds).
    op: _ops.Op
    #: The forward's tensor leaves, in order; and those whose gradients travel
    #: (floating ones), with their shapes.
    tensors: tuple[int, ...]
    leaves: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    #: The forward's structure (the gradient tree's, with None for the
    #: leaves that do not travel).
    treespec: optree.PyTreeSpec
    #: The op's transpose: the backward's collective (named after the
    #: forward, whose ``tag`` it carries), and how gradients go through it.
    transpose: _ops.Transpose

    @staticmethod
    def of(op: _ops.Op, flat: _tree.Flat) -> Rule:
        leaves = tuple(i for i in flat.tensors if flat.leaves[i].dtype.is_floating_point)
        return Rule(
            op=op,
            tensors=flat.tensors,
            leaves=leaves,
            shapes=tuple(tuple(flat.leaves[i].shape) for i in leaves),
            treespec=flat.treespec,
            transpose=_ops.transpose(op, flat, leaves),
        )


_rules: _memo.Memo[Rule] = _memo.Memo()


class _Differentiable(torch.autograd.Function):
    """One differentiable call: ``forward`` runs the op, ``backward`` the
    rule's backward collective and take."""

    @staticmethod
    def forward(ctx, call, *tensors):
        # (the call in one argument: autograd's apply visits each argument)
        op, p, sync, to_cpu, tag, ctx.group = call
        ctx.transport = p.transport
        out, ctx.sizes, ctx.rule, ctx.identity = forward(op, p, sync=sync, to_cpu=to_cpu, tag=tag)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *backward(ctx.rule, ctx.transport, ctx.group, ctx.identity, ctx.sizes, grads))


def forward(
    op: _ops.Op, p: _call.Prepared, *, sync: bool, to_cpu: bool, tag: Any
) -> tuple[list[Any], Any, Rule, _steps.Identity]:
    """A differentiable call's forward, the call prepared as ``p`` (without
    its error): its output leaves, what its backward needs of it (the op's
    sizes, its :class:`Rule`, the forward's :class:`~xcoll._guard.steps.Identity`)."""
    flat = p.flat
    assert flat is not None
    out, sizes, sig = _call.called(op, p, sync=sync, to_cpu=to_cpu, tag=tag)
    return flat.treespec.flatten_up_to(out), sizes, rule(op, flat), _identity(sig)


def rule(op: _ops.Op, flat: _tree.Flat) -> Rule:
    """The :class:`Rule` of a differentiable call of ``op`` on ``flat``."""
    return _rules.get((op.name, op.src, op.key(flat, 1)), Rule.of, op, flat)


def backward(
    rule: Rule, transport: Any, group: Any, identity: _steps.Identity, sizes: Any, grads: Any
) -> tuple[torch.Tensor | None, ...]:
    """A differentiable call's backward: its rule's collective of the output
    leaves' gradients ``grads``, named by its forward's ``identity``; each
    tensor input's gradient (None where none travels)."""
    t = rule.transpose
    sent = iter(t.sent([grads[i] for i in rule.leaves]))
    travelling = set(rule.leaves)
    tree = optree.tree_unflatten(
        rule.treespec, [next(sent) if i in travelling else None for i in range(len(grads))]
    )
    # (differentiable itself under create_graph=True; every Op is a frozen
    # dataclass, which the abstract base cannot say to mypy)
    op = dataclasses.replace(t.dual, grad=torch.is_grad_enabled())  # type: ignore[type-var]
    # An uneven gather's collective runs on its own, after the pending work
    # (whose shapes differ between replicas), as its forward's does.
    if t.separate:
        _verdict.synced(transport)
    out = call(op, tree, group, sync=t.separate, to_cpu=False, tag=identity)
    reduced = optree.tree_leaves(out, none_is_leaf=False)
    took = t.take(reduced, rule.shapes, transport, sizes)
    taken = dict(zip(rule.leaves, took, strict=True))
    return tuple(taken.get(i) for i in rule.tensors)


def _identity(forward: _header.Signature | None) -> _steps.Identity:
    """What a backward is named by: its forward call's tag (a step's tag
    names the call by its step, number and place: it realigns each step),
    or, for an untagged forward, its number among this thread's calls on its
    group; so it pairs only with the backward of the same forward call on
    every replica, whichever thread runs it and whatever blocks are open
    then. Unguarded (a world of one, mode "never"): none."""
    if forward is None:
        return _steps.Identity("")
    return _steps.Identity(f"backward of {forward.tag or f'call {forward.number}'}")


# Whether this thread (a replica: on XLA a thread, else a process) has been
# told that a call without grad=True drops its inputs' gradients: once each.
_once = threading.local()


def warn_without_grad(name: str, flat: _tree.Flat | None, transport: Any, stacklevel: int) -> None:
    """Warns, once per replica, where a leaf of call ``name`` requires grad,
    autograd is on and the call is made without ``grad=True``: its outputs
    carry no gradient back, which trains silently wrong where one was meant
    (also where torch.compile traces the call)."""
    assert flat is not None  # (a call without an error of its own)
    for i in flat.tensors:
        if flat.leaves[i].requires_grad:
            _once.warned = True
            path, rank = flat.path(i), transport.rank_name(transport.rank())
            warnings.warn(
                f"{name} on {rank}: {path} requires grad and autograd is on, but the call "
                "is made without grad=True: its output carries no gradient back to "
                f"{path} on any replica. Pass grad=True to differentiate through the call; "
                "to silence this warning, pass a detached tensor (.detach()) or call under "
                "torch.no_grad() (told once per replica)",
                UserWarning,
                stacklevel=stacklevel,
            )
            return


def call(op: _ops.Op, tree: Any, group: Any, *, sync: bool, to_cpu: bool, tag: Any) -> Any:
    """A public call of ``op`` on ``tree`` (:func:`xcoll._core.call.prepare`,
    then :func:`~xcoll._core.call.called`): with ``op.grad``, its outputs
    differentiable. The tree is flattened and
    its backend resolved once either way."""
    p = _call.prepare(op, tree, group, sync, to_cpu)
    if not op.grad or p.error is not None:  # (an error is raised by the call, on every replica)
        # (flat.grads: a tensor leaf requires grad; most calls' none do)
        flat = p.flat if p.error is None else None
        if flat is not None and flat.grads and "warned" not in _once.__dict__ and torch.is_grad_enabled():
            warn_without_grad(op.name, flat, p.transport, stacklevel=4)
        return _call.called(op, p, sync=sync, to_cpu=to_cpu, tag=tag)[0]
    assert p.flat is not None
    treespec, tensors = p.flat.treespec, map(p.flat.leaves.__getitem__, p.flat.tensors)
    out = _Differentiable.apply((op, p, sync, to_cpu, tag, group), *tensors)
    return treespec.unflatten(out)
