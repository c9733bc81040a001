"""xcoll: pure-function, pytree-aware collectives for PyTorch/XLA.

One call communicates a whole pytree: one packed collective per dtype, one sync.

>>> import torch, xcoll
>>> xcoll.world_size()
1
>>> xcoll.reduce({"loss": torch.tensor([2.0]), "count": 3}, {"loss": "mean", "count": "sum"})
{'loss': tensor([2.]), 'count': 3}
"""

from ._collectives import broadcast, gather, rank, reduce, sync, world_size
from ._samples import by_index

__all__ = ["gather", "reduce", "broadcast", "rank", "world_size", "sync", "by_index"]
__version__ = "0.1.0"
