"""Small exchanges run on their own: digests and byte strings between replicas.

They carry the consistency check, barriers and Python objects. Each runs as
``Transport.exchange`` (on XLA a graph of just that gather: the caller's pending
work, which differs between replicas exactly when their calls do, stays out of
it), and each has the same size on every replica or is preceded by a size
exchange of fixed size, so mismatched input cannot make the exchange itself
hang.
"""

from __future__ import annotations

import hashlib

import torch

from .._backends.base import Transport
from .._encode import pack as _pack


def bytes_tensor(data: bytes, size: int) -> torch.Tensor:
    """``data`` in a uint8 tensor of ``size`` elements, zero-padded."""
    buf = torch.zeros(size, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf


def differing(transport: Transport, digest: bytes) -> list[int]:
    """The ranks whose ``digest`` (32 bytes on every replica) differs from this
    replica's, in rank order: one exchange of 32 bytes."""
    every = transport.exchange(bytes_tensor(digest, 32))
    mine = every[transport.rank()]
    return [r for r in range(every.shape[0]) if not torch.equal(every[r], mine)]


def sha256(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


def gather_bytes(
    transport: Transport, data: bytes | None, tag: bytes = b""
) -> list[bytes | None] | None:
    """Every replica's ``data`` in rank order (``None`` where a replica passed
    ``None``: it has nothing to send, e.g. it could not encode its object).
    Two exchanges: the sizes (with ``tag``, the same length on every
    replica), then the bytes padded to a shared size bucket. None, after the
    first, where the replicas' tags differ."""
    head = [-1 if data is None else len(data), *tag]
    rows = transport.exchange(torch.tensor(head, dtype=torch.int64))
    if not bool((rows[:, 1:] == rows[transport.rank(), 1:]).all()):
        return None
    sizes = rows[:, 0].tolist()
    padded = _pack.size_bucket(max(0, *sizes))
    if padded == 0:  # nothing to send (an XLA all-gather of no elements fails)
        return [None if n < 0 else b"" for n in sizes]
    every = transport.exchange(bytes_tensor(data or b"", padded))
    return [None if n < 0 else every[r, :n].numpy().tobytes() for r, n in enumerate(sizes)]
