"""How an XLA replica steps: its pending graph run under :data:`SYNC_LOCK`,
then waited for.

Replica threads (XLA:CPU, older TPUs) that reach a step together with a
graph not yet compiled each compile their own executable, whose collectives
never meet (XLA:CPU keys a rendezvous by the compiled module), and XLA aborts
the process. Under one process-wide lock the first thread compiles and the
others find the executable in torch_xla's cache. The lock is held for the
whole step, which with the synchronous CPU client (xcoll's default there)
returns once its graph is dispatched. A lock released earlier, once torch_xla's
process-wide compile counts changed, let a waiter go on when a replica's own
``.item()`` compiled a graph of its own meanwhile, and compile the holder's
graph a second time (measured: 4 of 8 fresh W=4 pools aborted).

A step must not wait under the lock for the replicas that wait for it:
torch_xla's step first locks its device until the device's last execution
has ended, and that execution (dispatched by a step that did not wait:
:func:`sync` without ``wait``) may wait at a rendezvous for replicas queued
behind the lock. So a step after one that did not wait first waits for it,
before it takes the lock (:data:`_UNWAITED`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from . import _xlac

SYNC_LOCK = threading.Lock()

#: Devices whose last step dispatched an execution nobody has waited for.
_UNWAITED: set[torch.device] = set()


def sync(device: torch.device, wait: bool = True) -> None:
    """Runs this replica's pending graph and waits for it to finish (unless
    not ``wait``: then the device's next :func:`step` waits for it first).

    ``torch_xla.sync()`` runs under the process-wide lock (see the module
    docstring). Then it waits, so that each replica has one execution in flight:
    XLA:CPU's rendezvous cannot tell a replica's consecutive executions apart (all
    run as RunId 0), so a replica that runs ahead joins another execution's
    collective and every replica hangs (seen after a few dozen back-to-back calls
    at W=4). It waits for this device only (:func:`_xlac.wait_device`).
    """
    if _xlac.pending(device):
        step(device)
        if wait:
            _xlac.wait_device(device)
        else:
            _UNWAITED.add(device)
    else:  # (_xlac.pending says why there is no step then)
        _xlac.reset_token(device)
    _xlac.run_step_closures()  # (outside the lock: _xlac.step says why)


def step(device: torch.device, tensors: Sequence[torch.Tensor] | None = None) -> None:
    """Under :data:`SYNC_LOCK`: :func:`_xlac.step` of ``device``, or
    :func:`_xlac.sync_only` of ``tensors`` (their graph alone). Waits first,
    outside the lock, for an execution of ``device`` that :func:`sync`
    dispatched without waiting."""
    if device in _UNWAITED:
        _UNWAITED.discard(device)
        _xlac.wait_device(device)
    with SYNC_LOCK:
        if tensors is None:
            _xlac.step(device)
        else:
            _xlac.sync_only(tensors)
