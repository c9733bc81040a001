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

from typing import Any

from . import _backends, _call, _check, _codec, _exchange, _pack


def _encode_or_error(obj: Any) -> tuple[bytes | None, Exception | None]:
    try:
        return _codec.encode(obj), None
    except (TypeError, ValueError) as e:
        return None, e


def _raise_for(failed: list[int], mine: Exception | None, what: str) -> None:
    if mine is not None:
        raise mine
    raise ValueError(f"{what}: replica(s) {failed} could not encode their object (see their error)")


def _checked(name: str, head: str, group: Any, error: Exception | None = None):
    """The call's transport, after the consistency check when it is due."""
    transport = _backends.current(group)
    if _check.due(transport):
        _check.verify(transport, name, head, _check.Description(()), error)
    if error is not None:
        raise error
    return transport


def gather_object(obj: Any, *, group: Any = None) -> list[Any]:
    """Every replica's ``obj``, as a list in rank order.

    ``obj`` is JSON-like (see :func:`xcoll.encode_object`): None, bool, int, float,
    str, bytes, and lists, tuples and dicts (str or int keys) of them. Values come
    back exactly, types preserved. ``obj`` is left unmodified.

    >>> import xcoll
    >>> xcoll.gather_object({"epoch": 3, "tags": ("a", "b")})  # a world of one
    [{'epoch': 3, 'tags': ('a', 'b')}]
    """
    transport = _checked("xcoll.gather_object", "", group)
    data, error = _encode_or_error(obj)
    every = _exchange.gather_bytes(transport, data)
    failed = [r for r, d in enumerate(every) if d is None]
    if failed:
        _raise_for(failed, error, "gather_object")
    return [_codec.decode(d) for d in every]


def broadcast_object(obj: Any, *, src: int = 0, group: Any = None) -> Any:
    """Replica ``src``'s ``obj`` on every replica (the others' ``obj`` is ignored).

    >>> import xcoll
    >>> xcoll.broadcast_object(["config", {"lr": 0.1}])
    ['config', {'lr': 0.1}]
    """
    transport = _checked("xcoll.broadcast_object", f"src={src}", group)
    mine = transport.rank() == src
    data, error = _encode_or_error(obj) if mine else (b"", None)
    size = _call.run(_call.Broadcast(src), -1 if data is None else len(data), transport)
    if size < 0:
        _raise_for([src], error, "broadcast_object")
    buf = transport.upload(_exchange.bytes_tensor(data or b"", _pack.size_bucket(size)))
    out = _call.run(_call.Broadcast(src), buf, transport)
    return _codec.decode(transport.to_host([out])[0][:size].numpy().tobytes())


def barrier(tag: str = "", *, group: Any = None) -> None:
    """Waits until every replica has called ``barrier`` with the same ``tag``.

    Replicas that pass different tags all raise ``ValueError`` naming every
    replica's tag (a replica that never calls is the backend's timeout to catch).

    >>> import xcoll
    >>> xcoll.barrier("epoch-end")
    """
    error = None
    if type(tag) is not str:
        error = TypeError(f"barrier tag must be a str, got {type(tag).__qualname__}")
    # The tags themselves are compared below, and named if they differ.
    transport = _checked("xcoll.barrier", "", group, error)
    if _exchange.differing(transport, _exchange.sha256(tag)):
        tags = _exchange.gather_bytes(transport, tag.encode("utf-8", "surrogatepass"))
        listing = ", ".join(
            f"rank {r}: {t.decode('utf-8', 'surrogatepass')!r}" for r, t in enumerate(tags)
        )
        raise ValueError(f"barrier tags differ between replicas ({listing})")
