"""Random number generator states as a pytree, and their sync in one call.

``rng_state()`` reads every generator in use into a tree of tensors and Python
scalars (the same structure on every replica); ``set_rng_state()`` writes one
back; ``sync_rng_state()`` broadcasts ``src``'s tree with a single
:func:`xcoll.broadcast` (one graph execution on XLA) and applies it.

Covered: torch's CPU generator, the XLA device generator (when the XLA runtime
runs here), CUDA generators (when CUDA is initialised), Python's ``random``,
NumPy's global generator (when NumPy is importable), and any
``torch.Generator`` passed in. In thread-per-device XLA:CPU replicas the CPU,
Python and NumPy generators are one per process, shared by the replicas.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence
from typing import Any

import optree
import torch

from . import _backends, _call, _check, _guard


def _numpy():
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def _xla_device():
    return sys.modules["torch_xla"].device() if _backends.xla_runtime_running() else None


def rng_state(generators: Sequence[torch.Generator] = ()) -> dict[str, Any]:
    """The states of every generator in use, as a pytree (CPU tensors and Python
    scalars) that :func:`xcoll.broadcast` can carry and :func:`set_rng_state` applies."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {
            "version": version,
            "internal": torch.tensor(internal, dtype=torch.int64),
            "has_gauss": gauss is not None,
            "gauss": 0.0 if gauss is None else gauss,
        },
        "generators": [g.get_state() for g in generators],
    }
    np = _numpy()
    if np is not None:
        _, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(cached),
        }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    dev = _xla_device()
    if dev is not None:
        import torch_xla.core.xla_model as xm

        seed = int(xm.get_rng_state(dev))  # a uint64: carried as the int64 of the same bits
        state["xla"] = seed - (1 << 64) if seed >= 1 << 63 else seed
    return state


def set_rng_state(state: dict[str, Any], generators: Sequence[torch.Generator] = ()) -> None:
    """Applies a tree made by :func:`rng_state` (tensors on any device)."""
    # Own storage for every tensor: torch.set_rng_state reads the storage, and a
    # view into a packed buffer (what a collective returns) crashes it.
    cpu = optree.tree_map(lambda x: x.cpu().clone() if isinstance(x, torch.Tensor) else x, state)
    torch.set_rng_state(cpu["torch"])
    py = cpu["python"]
    internal = tuple(int(v) for v in py["internal"].tolist())
    random.setstate((py["version"], internal, py["gauss"] if py["has_gauss"] else None))
    if len(cpu["generators"]) != len(generators):
        raise ValueError(
            f"the state holds {len(cpu['generators'])} generators, {len(generators)} were passed"
        )
    for g, s in zip(generators, cpu["generators"], strict=True):
        g.set_state(s)
    if "numpy" in cpu:
        n = cpu["numpy"]
        np = _numpy()
        np.random.set_state(
            ("MT19937", n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["gauss"])
        )
    for i, s in enumerate(cpu.get("cuda", [])):
        torch.cuda.set_rng_state(s, i)
    if "xla" in cpu:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(cpu["xla"] % (1 << 64), _xla_device())


def sync_rng_state(
    *,
    src: int = 0,
    generators: Sequence[torch.Generator] = (),
    group: Any = None,
    tag: str | int | None = None,
) -> None:
    """Gives every replica replica ``src``'s generator states, in one xcoll call.

    Afterwards ``torch.rand``, the XLA RNG, ``random.random()``, NumPy and every
    generator in ``generators`` draw the same values on every replica.
    ``group`` and ``tag`` as in :func:`xcoll.gather`.
    """
    transport = _backends.current(group)
    head = f"src={src} generators={len(generators)}"
    name = "xcoll.sync_rng_state"
    with _guard.entered(transport, name, head, _check.Description(()), tag=tag) as signature:
        _sync(transport, src, generators, signature)


def _sync(transport, src: int, generators: Sequence[torch.Generator], signature) -> None:
    # The caller's pending work runs first, on its own: replicas that drew
    # different numbers of random values (why they sync) have different pending
    # graphs, which in the broadcast's graph would be different programs.
    # (Nothing pending: no execution.)
    transport.sync()
    state = optree.tree_map(
        lambda x: transport.upload(x) if isinstance(x, torch.Tensor) else x, rng_state(generators)
    )
    synced = _call.run(_call.Broadcast(src), state, transport, signature=signature)
    leaves, spec = optree.tree_flatten(synced)
    tensors = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    for i, host in zip(tensors, transport.to_host([leaves[i] for i in tensors]), strict=True):
        leaves[i] = host
    set_rng_state(optree.tree_unflatten(spec, leaves), generators)
