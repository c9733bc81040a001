"""One call of a collective (an op of :mod:`xcoll._core.ops`): flatten
once, resolve the backend once, take the op's cached plan (or build it,
which validates), check, run it under the guard, unflatten.

:func:`prepare` and :func:`called` are what a public call runs
(:func:`xcoll._core.grad.call`); :func:`run` and :func:`outcome` are what
xcoll's own modules run on trees they built themselves (no check: the public
call that made them was checked).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import _backends
from .._backends.base import Transport
from .._base import memo as _memo
from .._base import tree as _tree
from .._guard import entry as _entry
from .._guard import header as _header
from .._guard import verdict as _verdict
from . import execute as _execute
from .ops import GRAD_ON_HOST, Op, Packed, unsynced
from .recipe import Plan

_plans: _memo.Memo[Plan] = _memo.Memo()


def _prepare(op: Op, flat: _tree.Flat, transport: Transport, sync: bool, to_cpu: bool) -> Plan:
    # the op's own checks, then those every op shares, which no op can skip
    op.validate(flat, transport, sync, to_cpu)
    if op.grad and to_cpu:
        raise ValueError(GRAD_ON_HOST)
    if not sync:
        unsynced(flat, to_cpu)
    w = transport.world
    return _plans.get(op.key(flat, w), op.plan, flat, w)


@dataclass
class Prepared:
    """A public call's tree flattened once, its backend resolved once and its
    plan taken (or the call's own error, which :func:`called` shares with
    every replica): what the call, and a differentiable call's forward, run."""

    flat: _tree.Flat | None
    transport: Transport
    plan: Plan | None
    error: Exception | None


def prepare(op: Op, tree: Any, group: Any, sync: bool, to_cpu: bool) -> Prepared:
    """``tree`` flattened, its backend resolved and ``op``'s plan taken; an
    argument's error is kept for :func:`called` to raise on every replica."""
    flat = transport = plan = error = None
    try:
        try:
            flat = _tree.flatten(tree)
            transport = _backends.resolve(flat, group)
            plan = _prepare(op, flat, transport, sync, to_cpu)
        except (TypeError, ValueError) as e:
            error = e
        if transport is None:  # the call's own error is the one to report
            try:
                transport = _backends.current(group)
            except RuntimeError:
                if error is None:
                    raise
                raise error from None
        return Prepared(flat, transport, plan, error)
    finally:
        # The error's traceback holds this frame: cleared, the frame holds
        # neither the error (a cycle that only a later garbage collection
        # would free, on each replica at its own time) nor the tree's tensors.
        error = flat = tree = plan = None  # noqa: F841


def called(
    op: Op, p: Prepared, *, sync: bool, to_cpu: bool, tag: Any
) -> tuple[Any, Any, _header.Signature | None]:
    """The call ``p`` was prepared for: its output tree, what a backward
    needs of it (:meth:`xcoll._core.ops.Op.apply`), and its guard's signature (whose tag and
    number its backward is named by)."""
    description = None if p.plan is None else p.plan.description
    try:
        with _entry.entered(
            p.transport, op.name, op.head(sync, to_cpu), description, p.error, tag=tag
        ) as sig:
            assert p.flat is not None and p.plan is not None  # (else entered raised the error)
            return (*op.apply(p.flat, p.transport, p.plan, sync, to_cpu, sig), sig)
    finally:
        # Drops the tree and the error: the error's traceback holds the frames
        # that hold ``p``, and an XLA tensor kept alive on one replica (until a
        # garbage collection frees the cycle) joins its next graph (seen: XLA's
        # abort after a caught error, the replicas' programs differing).
        p.flat = p.plan = p.error = None


def run(
    op: Packed,
    tree: Any,
    transport: Transport,
    *,
    to_cpu: bool = False,
    signature: _header.Signature | None = None,
) -> Any:
    """``op`` on a tree that xcoll built itself, on ``transport``, synchronously
    (guarded as ``signature``, the public call's, if given)."""
    out, agree = outcome(op, tree, transport, to_cpu=to_cpu, signature=signature)
    if not agree:
        _verdict.fire(transport, signature, op.src)
    return out


def outcome(
    op: Packed,
    tree: Any,
    transport: Transport,
    *,
    to_cpu: bool,
    signature: _header.Signature | None,
) -> tuple[Any, bool]:
    """As :func:`run`, and the verdict instead of its error where the verdict
    is one-sided (a receiver of gloo's broadcast: see
    :func:`xcoll._core.execute.execute`), for a caller whose protocol goes on."""
    flat = _tree.flatten(tree)
    transport.validate(flat)
    plan = _prepare(op, flat, transport, True, to_cpu)
    r = op.recipe(plan, transport, signature is not None, to_cpu)
    return _execute.execute(r, flat, transport, signature, to_cpu=to_cpu)
