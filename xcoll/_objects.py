"""Python objects between replicas, without pickle: ``gather_object``,
``broadcast_object`` and a tagged ``barrier``.

Objects travel as xcoll's own encoding (``_codec``) in a uint8 tensor, padded to
a power-of-two size bucket, so repeated calls with similar sizes reuse compiled
graphs. Each call makes one size exchange and one data collective. An object
that cannot be encoded is reported in the size exchange, so that every replica
raises (the failing one its ``TypeError`` naming the path) instead of the others
waiting for data that never comes.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from . import _backends, _check, _codec, _collectives
from ._uneven import size_bucket


def _encode_or_error(obj: Any) -> tuple[bytes, Exception | None]:
    try:
        return _codec.encode(obj), None
    except (TypeError, ValueError) as e:
        return b"", e


def _raise_for(failed: list[int], mine: Exception | None, what: str) -> None:
    if mine is not None:
        raise mine
    raise ValueError(f"{what}: replica(s) {failed} could not encode their object (see their error)")


def _padded(data: bytes, size: int) -> torch.Tensor:
    buf = torch.zeros(size, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf


def gather_object(obj: Any, *, group: Any = None) -> list[Any]:
    """Every replica's ``obj``, as a list in rank order.

    ``obj`` is JSON-like (see :func:`xcoll.encode_object`): None, bool, int, float,
    str, bytes, and lists, tuples and dicts (str or int keys) of them. Values come
    back exactly, types preserved.

    >>> import xcoll
    >>> xcoll.gather_object({"epoch": 3, "tags": ("a", "b")})  # a world of one
    [{'epoch': 3, 'tags': ('a', 'b')}]
    """
    with _check.outermost() as outer:
        if outer:
            _check.check("xcoll.gather_object", list, group=group)
        return _gather_object(obj, group)


def _gather_object(obj: Any, group: Any) -> list[Any]:
    # Exchanges run on their own: the caller's pending work (on XLA) stays out of
    # them, so the consistency check can use this when replicas' calls differ.
    backend = _backends.current(group)
    data, error = _encode_or_error(obj)
    size = torch.tensor([-1 if error else len(data)], dtype=torch.int64)
    sizes = backend.exchange(backend.upload(size))[:, 0].tolist()
    failed = [r for r, n in enumerate(sizes) if n < 0]
    if failed:
        _raise_for(failed, error, "gather_object")
    every = backend.exchange(backend.upload(_padded(data, size_bucket(max(sizes)))))
    return [_codec.decode(every[r, :n].numpy().tobytes()) for r, n in enumerate(sizes)]


def broadcast_object(obj: Any, *, src: int = 0, group: Any = None) -> Any:
    """Replica ``src``'s ``obj`` on every replica (the others' ``obj`` is ignored).

    >>> import xcoll
    >>> xcoll.broadcast_object(["config", {"lr": 0.1}])
    ['config', {'lr': 0.1}]
    """
    with _check.outermost() as outer:
        if outer:
            _check.check("xcoll.broadcast_object", lambda: [f"src={src}"], group=group)
        return _broadcast_object(obj, src, group)


def _broadcast_object(obj: Any, src: int, group: Any) -> Any:
    backend = _backends.current(group)
    mine = backend.rank() == src
    data, error = _encode_or_error(obj) if mine else (b"", None)
    size = _collectives.broadcast(-1 if error else len(data), src=src, group=group)
    if size < 0:
        _raise_for([src], error, "broadcast_object")
    buf = backend.upload(_padded(data, size_bucket(size)))
    out = _collectives.broadcast(buf, src=src, group=group)
    return _codec.decode(backend.to_host([out])[0][:size].numpy().tobytes())


def barrier(tag: str = "", *, group: Any = None) -> None:
    """Waits until every replica has called ``barrier`` with the same ``tag``.

    Replicas that pass different tags all raise ``ValueError`` naming every
    replica's tag (a replica that never calls is the backend's timeout to catch).

    >>> import xcoll
    >>> xcoll.barrier("epoch-end")
    """
    with _check.outermost() as outer:
        if outer:
            _check.check("xcoll.barrier", lambda: _tag_type(tag), group=group)
        _barrier(tag, group)


def _tag_type(tag: Any) -> list[str]:
    if type(tag) is not str:
        raise TypeError(f"barrier tag must be a str, got {type(tag).__qualname__}")
    return []  # the tags themselves are compared below, and named if they differ


def _barrier(tag: str, group: Any) -> None:
    _tag_type(tag)
    backend = _backends.current(group)
    digest = torch.frombuffer(
        bytearray(hashlib.sha256(tag.encode("utf-8", "surrogatepass")).digest()), dtype=torch.uint8
    )
    every = backend.exchange(backend.upload(digest))
    if not bool((every == every[0]).all()):
        tags = _gather_object(tag, group)  # every replica takes this branch
        listing = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
        raise ValueError(f"barrier tags differ between replicas ({listing})")
