"""xcoll: pure-function, pytree-aware collectives for PyTorch/XLA.

One call communicates a whole pytree: one packed collective per gather or
broadcast (one per dtype and op for a reduce), one sync.

>>> import torch, xcoll
>>> xcoll.world_size()
1
>>> xcoll.reduce({"loss": torch.tensor([2.0]), "count": 3}, {"loss": "mean", "count": "sum"})
{'loss': tensor([2.]), 'count': 3}
"""

from ._backends._launch import default_cpu_env as _default_cpu_env
from ._collectives import ReduceOp as ReduceOp  # (for type annotations: reduce's op)
from ._collectives import (
    all_to_all,
    broadcast,
    gather,
    rank,
    reduce,
    reduce_scatter,
    sync,
    world_size,
)
from ._encode.codec import decode as decode_object
from ._encode.codec import encode as encode_object
from ._guard.check import CollectiveMismatchError, consistency_checks
from ._guard.entry import ConcurrentCallError
from ._objects import barrier, broadcast_object, gather_object
from ._rng import rng_state, set_rng_state, sync_rng_state
from ._samples import by_index
from ._step import step

__all__ = [
    "gather",
    "reduce",
    "broadcast",
    "reduce_scatter",
    "all_to_all",
    "rank",
    "world_size",
    "sync",
    "step",
    "by_index",
    "gather_object",
    "broadcast_object",
    "barrier",
    "encode_object",
    "decode_object",
    "rng_state",
    "set_rng_state",
    "sync_rng_state",
    "CollectiveMismatchError",
    "ConcurrentCallError",
    "consistency_checks",
]
#: The version (semantic: the API grows in minor versions while it is 0.x;
#: CHANGELOG.md says what each one changed). pyproject.toml reads it from here.
__version__ = "0.2.0"

_default_cpu_env()  # (before any XLA runtime of this program starts: docs/launchers.md)
