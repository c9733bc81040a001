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
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, cast

import optree
import torch

from . import _backends
from ._backends.base import Transport
from ._core import call as _call
from ._core import ops as _ops
from ._encode import pack as _pack
from ._guard import check as _check
from ._guard import entry as _entry
from ._guard import header as _header
from ._guard import verdict as _verdict


def _numpy() -> ModuleType | None:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def _xla_device() -> Any:
    """This replica's XLA device, or None (Any: torch_xla's RNG functions are
    annotated to take the device's name, and take the device)."""
    return sys.modules["torch_xla"].device() if _backends.xla_runtime_running() else None


def _check_generators(generators: Any) -> None:
    """Refuses ``generators=`` that is not a sequence of torch.Generator (a str
    is a sequence too, of str: its first ``get_state`` failed)."""
    if isinstance(generators, (str, bytes)) or not isinstance(generators, Sequence):
        raise TypeError(
            "generators must be a list or tuple of torch.Generator, "
            f"got {type(generators).__qualname__} {generators!r:.80}"
        )
    for i, g in enumerate(generators):
        if not isinstance(g, torch.Generator):
            raise TypeError(
                f"generators[{i}] must be a torch.Generator, got {type(g).__qualname__} {g!r:.80}"
            )


# What every tree of rng_state holds (and its "python" dict); "numpy", "cuda"
# and "xla" where those generators were in use.
_KEYS = ("torch", "python", "generators")
_PYTHON_KEYS = ("version", "internal", "has_gauss", "gauss")


def _check_state(state: Any, generators: Sequence[torch.Generator]) -> None:
    """Refuses, before any generator is set, a ``state`` that is not a tree of
    :func:`rng_state`, or one that holds another number of generators."""
    _check_generators(generators)
    made = "state must be what xcoll.rng_state() returns"
    if not isinstance(state, dict):
        raise TypeError(f"{made} (a dict), got {type(state).__qualname__} {state!r:.80}")
    missing = [k for k in _KEYS if k not in state]
    if missing:
        raise ValueError(f"{made}: it lacks the keys {missing} (it has {list(state)!r:.80})")
    python = state["python"]
    if not isinstance(python, dict) or any(k not in python for k in _PYTHON_KEYS):
        raise ValueError(f"{made}: state['python'] is not a dict with keys {list(_PYTHON_KEYS)}")
    if not isinstance(state["generators"], (list, tuple)):
        raise ValueError(f"{made}: state['generators'] is not a list")
    if len(state["generators"]) != len(generators):
        raise ValueError(
            f"the state holds {len(state['generators'])} generators, {len(generators)} were passed"
        )


def rng_state(generators: Sequence[torch.Generator] = ()) -> dict[str, Any]:
    """The states of every generator in use, as a pytree.

    Read: torch's CPU generator, Python's ``random``, NumPy's global
    generator, CUDA's generators (where CUDA is initialised), the XLA device
    generator (where XLA's runtime runs here) and every generator passed in.
    The tree has the same structure on every replica that uses the same
    generators, so :func:`xcoll.broadcast` can carry it.

    Args:
        generators: ``torch.Generator`` objects of your own to read too.

    Returns:
        A dict of CPU tensors and Python scalars that :func:`set_rng_state`
        applies.

    Raises:
        TypeError: ``generators`` is not a list or tuple of ``torch.Generator``
            (naming the item that is not one).

    >>> import random, xcoll
    >>> state = xcoll.rng_state()
    >>> first = random.random()
    >>> xcoll.set_rng_state(state)
    >>> random.random() == first
    True
    """
    _check_generators(generators)
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
    """Applies a tree made by :func:`rng_state`: every generator it holds
    draws from where it was when the tree was made.

    Args:
        state: what :func:`rng_state` returned (here or on another replica,
            e.g. after :func:`xcoll.broadcast`; tensors on any device).
        generators: the ``torch.Generator`` objects whose states ``state``
            holds, in the order they were passed to :func:`rng_state`.

    Raises:
        TypeError: ``state`` is not a dict, or ``generators`` is not a list or
            tuple of ``torch.Generator``.
        ValueError: ``state`` is not a tree that :func:`rng_state` made (naming
            the keys it lacks), or ``generators`` is not as long as the list
            ``state`` holds. Raised before any generator is set.

    >>> import torch, xcoll
    >>> state = xcoll.rng_state()
    >>> a = torch.rand(2)
    >>> xcoll.set_rng_state(state)
    >>> torch.equal(torch.rand(2), a)
    True
    """
    _check_state(state, generators)
    # Own storage for every tensor: torch.set_rng_state reads the storage, and a
    # view into a packed buffer (what a collective returns) crashes it.
    cpu: dict[str, Any] = _map_tensors(lambda x: x.cpu().clone(), state)
    torch.set_rng_state(cpu["torch"])
    py = cpu["python"]
    internal = tuple(int(v) for v in py["internal"].tolist())
    random.setstate((py["version"], internal, py["gauss"] if py["has_gauss"] else None))
    for g, s in zip(generators, cpu["generators"], strict=True):
        g.set_state(s)
    if "numpy" in cpu:
        n = cpu["numpy"]
        np = _numpy()
        assert np is not None, "numpy is one of xcoll's dependencies"
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
) -> tuple[str, ...]:
    """Gives every replica replica ``src``'s generator states, in one xcoll call.

    Afterwards ``torch.rand``, the XLA RNG, ``random.random()``, NumPy and every
    generator in ``generators`` draw the same values on every replica, except
    where the replicas share a generator: XLA:CPU replicas are threads of one
    process, which share torch's CPU generator, Python's ``random`` and
    NumPy's (set to ``src``'s state, but each replica's draw moves them on
    for all: pass a ``torch.Generator`` of each replica's own in
    ``generators`` instead). The caller's pending work runs first, on its
    own; then one :func:`xcoll.broadcast` carries :func:`rng_state` (one
    graph execution on XLA) and every replica applies it.

    Args:
        src: the rank, in ``group``, whose states every replica gets.
        generators: ``torch.Generator`` objects of your own to sync too; every
            replica passes the same number.
        group: as in :func:`xcoll.gather`.
        tag: as in :func:`xcoll.gather`.

    Returns:
        The generators that now draw alike on every replica, by name:
        ``"torch"`` (the CPU generator), ``"python"``, ``"numpy"``,
        ``"cuda"``, ``"xla"`` (those in use) and ``"generators[i]"`` for each
        passed in; on XLA:CPU replica threads without the three they share.

    Raises:
        TypeError: ``generators`` is not a list or tuple of ``torch.Generator``,
            or ``group`` is neither a process group nor None; before any
            communication.
        ValueError: ``src`` is not a rank in ``[0, W)``.
        xcoll.CollectiveMismatchError: the replicas' calls differ (``src``, or
            the generators read: docs/reliability.md).
        xcoll.ConcurrentCallError: as in :func:`xcoll.gather`.
        RuntimeError: as in :func:`xcoll.gather`.

    >>> import xcoll
    >>> xcoll.sync_rng_state()  # a world of one: its own states
    ('torch', 'python', 'numpy')
    """
    _check_generators(generators)
    transport = _backends.current(group)
    head = f"src={src} generators={len(generators)}"
    name = "xcoll.sync_rng_state"
    with _entry.entered(transport, name, head, _check.NO_TREE, tag=tag) as signature:
        state = _sync(transport, src, generators, signature)
    shared = _SHARED if transport.replica_threads else ()
    named = [k for k in state if k != "generators" and k not in shared]
    return (*named, *(f"generators[{i}]" for i in range(len(generators))))


#: The generators that XLA:CPU replica threads share: one per process.
_SHARED = ("torch", "python", "numpy")


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], state: dict[str, Any]) -> Any:
    """``state`` with ``fn`` applied to its tensor leaves."""
    return optree.tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, cast(Any, state))


def _sync(
    transport: Transport,
    src: int,
    generators: Sequence[torch.Generator],
    signature: _header.Signature | None,
) -> dict[str, Any]:
    """Sets ``src``'s states on this replica; returns them."""
    # The caller's pending work runs first, on its own: replicas that drew
    # different numbers of random values (why they sync) have different pending
    # graphs, which in the broadcast's graph would be different programs.
    # (Nothing pending: no execution.)
    _verdict.synced(transport)
    mine, spec = optree.tree_flatten(cast(Any, rng_state(generators)))
    guard, agree = signature, True
    if signature is not None:
        # The states (over 4 KiB) would travel in an eager engine's broadcast,
        # which a replica making another call meets with another collective
        # (on XLA, in a program of their own); a small guarded call first
        # meets any other small call, whatever its kind (the guard reads the
        # difference), and the states follow unguarded.
        # (A one-sided verdict, a receiver's of a broadcast of CUDA leaves, is
        # raised after the states, which src sends whatever it learns.)
        count = transport.upload(_pack.leaf_bytes(len(mine)))
        agree = _call.outcome(_ops.Broadcast(src), count, transport, to_cpu=False, signature=signature)[1]
        guard = None
    sent = optree.tree_unflatten(spec, [transport.upload(_pack.leaf_bytes(x)) for x in mine])
    synced = _call.run(_ops.Broadcast(src), sent, transport, signature=guard)
    if not agree:
        _verdict.fire(transport, signature, src)
    got = transport.to_host(optree.tree_leaves(synced))
    state = cast(dict[str, Any], optree.tree_unflatten(spec, list(map(_pack.from_leaf_bytes, got, mine))))
    set_rng_state(state, generators)
    return state
