"""How an XLA replica steps: its pending graph run under :data:`SYNC_LOCK`
(held until the graph is compiled: :mod:`.compile_lock`), then waited for."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch_xla

from . import _xlac
from .compile_lock import CompileLock

SYNC_LOCK = CompileLock()


def sync(device: torch.device | None = None, wait: bool = True) -> None:
    """Runs this replica's pending graph and waits for it to finish (unless
    not ``wait``: :func:`own_sync`).

    ``torch_xla.sync()`` runs under the process-wide lock (see the module
    docstring). Then it waits, so that each replica has one execution in flight:
    XLA:CPU's rendezvous cannot tell a replica's consecutive executions apart (all
    run as RunId 0), so a replica that runs ahead joins another execution's
    collective and every replica hangs (seen after a few dozen back-to-back calls
    at W=4). It waits for this device only (:func:`_xlac.wait_device`).
    """
    device = device or torch_xla.device()
    if _xlac.pending(device):
        step(device)
        if wait:
            _xlac.wait_device(device)
    else:  # (_xlac.pending says why there is no step then)
        _xlac.reset_token(device)
    _xlac.run_step_closures()  # (outside the lock: _xlac.step says why)


def step(device: torch.device, tensors: Sequence[torch.Tensor] | None = None) -> None:
    """Under :data:`SYNC_LOCK`: :func:`_xlac.step` of ``device``, or
    :func:`_xlac.sync_only` of ``tensors`` (their graph alone)."""
    held = SYNC_LOCK.hold()
    try:
        if tensors is None:
            _xlac.step(device)
        else:
            _xlac.sync_only(tensors)
    finally:
        SYNC_LOCK.release(held)
