"""Run distributed code on W real replicas from an ordinary pytest process.

A pool is started once and reused for many calls, so property-based tests can
draw thousands of examples in the test process and run each on real replicas::

    from xcoll.testing import XlaPool

    def total(x):                 # runs on every replica, in its own thread
        import torch, torch_xla, xcoll
        return xcoll.reduce(torch.tensor(x).to(torch_xla.device())).item()

    if __name__ == "__main__":  # the pool's worker imports this module
        with XlaPool(4) as pool:
            assert pool.run(total, [1, 2, 3, 4]) == [10, 10, 10, 10]

Functions and arguments travel to the pool's worker process by reference/pickle
(they must be importable module-level functions and picklable values); results
come back the same way, so return CPU values. This is the test driver talking to
the child it started, not data exchanged between replicas: xcoll's collectives
never pickle.

Three pools, one interface (:class:`ReplicaPool`): :class:`XlaPool` (W XLA
replicas, one thread per device in one worker process), :class:`GlooPool` (W
torch.distributed processes with the gloo backend) and :class:`LocalPool` (a
world of one, run inline in the calling process with no collectives engine). In
the spawned pools a replica that hangs, or a worker that aborts, becomes an
exception in the caller within the timeout, with the tail of the workers'
stderr; the next call starts fresh workers.

The calling side lives in ``_pools``, what runs in the worker processes in
``_workers``, and what both share in ``_remote``.
"""

from __future__ import annotations

from xcoll.testing._pools import (
    GlooPool,
    LocalPool,
    PoolCrashed,
    ReplicaError,
    ReplicaPool,
    XlaPool,
    xla_counters,
    xla_cpu_env,
)
from xcoll.testing._remote import RemoteFailure

__all__ = [
    "ReplicaPool",
    "XlaPool",
    "GlooPool",
    "LocalPool",
    "RemoteFailure",
    "ReplicaError",
    "PoolCrashed",
    "xla_cpu_env",
    "xla_counters",
]
