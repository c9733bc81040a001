"""The collectives, one object each: :class:`Gather`, :class:`Reduce`,
:class:`Broadcast`, :class:`ReduceScatter`, :class:`AllToAll` (and
:class:`xcoll._core.uneven.UnevenGather`). Each holds everything that differs
between collectives: its parameters, how it is described, validated and
planned (:class:`xcoll._core.recipe.Plan`); how its collective carries the
guard's header (:attr:`Packed.carries`: all that the guard,
:mod:`xcoll._guard.header`, reads of it); how its wires are made, sent,
cut and decoded; how a Python scalar comes back; and its backward rule, its
transpose (:class:`Transpose`, declared beside it in :data:`TRANSPOSES`).
The executor (:mod:`xcoll._core.execute`) reads these and never asks which
collective it is.
Adding a collective is one new op and its public function.

A move (:class:`Move`: gather, broadcast) joins every bucket's bytes into
one buffer of int32 words and makes one collective; a reduce makes one
all-reduce per (dtype, reduction) bucket, encoded so that the engine's arithmetic is
exact (:mod:`xcoll._encode.wire`).

One module each: :mod:`~xcoll._core.ops.base` (what every op is),
:mod:`~xcoll._core.ops.gather`, :mod:`~xcoll._core.ops.reduce`,
:mod:`~xcoll._core.ops.parts`, :mod:`~xcoll._core.ops.reduce_scatter`,
:mod:`~xcoll._core.ops.all_to_all`,
:mod:`~xcoll._core.ops.broadcast`; their names are gathered here.
"""

from .all_to_all import AllToAll
from .base import (
    GRAD_ON_HOST,
    TRANSPOSES,
    Move,
    Op,
    Packed,
    Transpose,
    Tuning,
    transpose,
    tuned,
    unsynced,
)
from .broadcast import Broadcast
from .gather import Gather, gather_params
from .reduce import REDUCTIONS, Reduce, merged, summed
from .reduce_scatter import ReduceScatter

__all__ = [
    "GRAD_ON_HOST",
    "REDUCTIONS",
    "TRANSPOSES",
    "AllToAll",
    "Broadcast",
    "Gather",
    "Move",
    "Op",
    "Packed",
    "Reduce",
    "ReduceScatter",
    "Transpose",
    "Tuning",
    "gather_params",
    "merged",
    "summed",
    "transpose",
    "tuned",
    "unsynced",
]
