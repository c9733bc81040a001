"""Runs a script on W XLA:CPU replicas, one thread each, as a TPU host runs
it on its chips:

    python -m xcoll.launch --cpu 4 script.py [its arguments]

It sets what XLA:CPU replicas need before torch_xla starts (W devices, the
synchronous client, a thread pool of at least W threads, scalars as data:
:func:`xcoll.testing.xla_cpu_env`; a setting already in the environment is
kept), makes the process's first ``.item()`` once before the replicas start
(torch_xla's first CPU fallback races when replica threads make it at once:
docs/design.md), then runs ``script`` as ``__main__`` in every replica's
thread, with ``sys.argv`` ``[script, *arguments]``. It exits with 0 when
every replica's run returned, else 1, each failed replica's traceback
printed as it fails (a replica left waiting in a collective for one that
failed is stopped with the process).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import threading
import time
import traceback
from typing import Any

#: Seconds the other replicas have to finish after one failed (they may wait
#: in a collective the failed one never reaches, where XLA aborts the process
#: after 10 s)
GRACE = 5.0


def main(argv: list[str] | None = None) -> int:
    """Parses the command line (see the module's docstring) and runs it."""
    p = argparse.ArgumentParser(prog="python -m xcoll.launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", type=int, required=True, metavar="W", help="the number of XLA:CPU replicas")
    p.add_argument("script", help="the script every replica runs as __main__")
    p.add_argument("arguments", nargs=argparse.REMAINDER, help="the script's arguments")
    a = p.parse_args(argv)
    if a.cpu < 1:
        p.error(f"--cpu must be at least 1, got {a.cpu}")
    from xcoll.testing import xla_cpu_env

    for k, v in xla_cpu_env(a.cpu).items():
        os.environ.setdefault(k, v)  # (before torch_xla starts in this process)
    devices = _started(a.cpu)
    sys.argv = [a.script, *a.arguments]
    failed: dict[int, str] = {}
    threads = [threading.Thread(target=_replica, args=(d, a.script, failed), daemon=True) for d in devices]
    for t in threads:
        t.start()
    deadline = None
    while any(t.is_alive() for t in threads):
        if failed and deadline is None:
            deadline = time.monotonic() + GRACE
        if deadline is not None and time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if failed:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # (replicas still waiting in a collective cannot be joined)
    return 0


def _started(world: int) -> list[Any]:
    """Starts the XLA runtime for ``world`` replica threads; their devices."""
    import torch_xla.core.xla_model as xm

    from xcoll._backends import _xlac

    _xlac.start_single_process_runtime()
    devices = xm.get_xla_supported_devices()
    if len(devices) != world:
        raise SystemExit(f"xcoll.launch: expected {world} XLA:CPU devices, torch_xla has {len(devices)}")
    _xlac.warm_up_fallbacks(devices[0])
    return list(devices)


def _replica(device: Any, script: str, failed: dict[int, str]) -> None:
    """One replica's thread: ``script`` as ``__main__``, on ``device``."""
    from xcoll._backends import _xlac

    _xlac.start_replica_thread(device)
    import torch_xla.runtime as xr

    rank = xr.global_ordinal()
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            _failed(failed, rank, f"SystemExit({e.code!r})")
    except BaseException:
        _failed(failed, rank, traceback.format_exc())


def _failed(failed: dict[int, str], rank: int, text: str) -> None:
    """Says at once that replica ``rank`` failed (before XLA may abort the
    process for the replicas left waiting), and records it."""
    print(f"xcoll.launch: replica {rank} failed:\n{text}", file=sys.stderr, flush=True)
    failed[rank] = text


if __name__ == "__main__":
    sys.exit(main())
