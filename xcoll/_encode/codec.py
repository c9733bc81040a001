"""xcoll's object codec: JSON-like values to bytes and back, exactly.

Encodes ``None``, ``bool``, ``int`` (any size), ``float`` (every bit: NaN
payloads, ``-0.0``, infinities), ``str``, ``bytes``, ``list``, ``tuple`` and
``dict`` with ``str`` or ``int`` keys; types are preserved (a tuple stays a
tuple, dict order is kept). Anything else, subclasses included (an ``IntEnum``
would come back as a plain int), raises ``TypeError`` naming its path. Decoding
reads only these tags and lengths: malformed bytes raise ``ValueError`` and
never run code. No pickle, no ``eval``.

Format: one tag byte, then for ``int`` a sign byte and a length-prefixed
big-endian magnitude, for ``float`` 8 IEEE bytes, for ``str``/``bytes`` a length
and the bytes, for containers a count and the items. Lengths are 8-byte
big-endian unsigned integers.
"""

from __future__ import annotations

import struct
from typing import Any

_NONE, _TRUE, _FALSE, _INT, _FLOAT, _STR, _BYTES, _LIST, _TUPLE, _DICT = b"NTFIDSBLUM"
_LEN = struct.Struct(">Q")
_F64 = struct.Struct(">d")
MAX_DEPTH = 200


def encode(obj: Any) -> bytes:
    """``obj`` as bytes, in xcoll's own encoding (what the object calls send).

    Exact: types are preserved (a tuple stays a tuple, dict order is kept),
    floats keep every bit (NaN payloads, ``-0.0``), ints any size. No pickle:
    :func:`xcoll.decode_object` runs no code.

    Args:
        obj: None, bool, int, float, str, bytes, or a list, tuple or dict (str
            or int keys) of them, nested at most 200 levels deep. Subclasses
            are refused (an ``IntEnum`` would come back as a plain int).

    Returns:
        The encoding, which :func:`xcoll.decode_object` turns back into an
        equal value.

    Raises:
        TypeError: a value or dict key of another type, naming its path
            (``obj['a'][2]``).
        ValueError: ``obj`` is nested more than 200 levels deep.

    >>> import xcoll
    >>> xcoll.decode_object(xcoll.encode_object({"a": (1, -0.0, None), 2: [b"x", "é", 10**30]}))
    {'a': (1, -0.0, None), 2: [b'x', 'é', 1000000000000000000000000000000]}
    """
    out = bytearray()
    _encode(obj, out, None, 0)
    return bytes(out)


# Where ``_encode`` is: None at the root, else (the parent's place, a format
# for this step, its key or index). Written out only for an error.
_Place = tuple[Any, str, Any] | None


def _path(at: _Place) -> str:
    """``at`` as a Python expression from ``obj``; past 8 steps only the first
    and last few (a full path is as long as the value is deep)."""
    steps = []
    while at is not None:
        at, step, key = at
        steps.append(step.format(key))
    steps.reverse()
    shown = steps if len(steps) <= 8 else (*steps[:4], "...", *steps[-2:])
    return "obj" + "".join(shown)


def _encode(obj: Any, out: bytearray, at: _Place, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ValueError(f"{_path(at)}: nested more than {MAX_DEPTH} levels deep")
    t = type(obj)
    if obj is None:
        out.append(_NONE)
    elif t is bool:
        out.append(_TRUE if obj else _FALSE)
    elif t is int:
        magnitude = abs(obj).to_bytes((abs(obj).bit_length() + 7) // 8, "big")
        out += bytes([_INT, obj < 0]) + _LEN.pack(len(magnitude)) + magnitude
    elif t is float:
        out.append(_FLOAT)
        out += _F64.pack(obj)
    elif t is str:
        data = obj.encode("utf-8", "surrogatepass")
        out.append(_STR)
        out += _LEN.pack(len(data)) + data
    elif t is bytes:
        out.append(_BYTES)
        out += _LEN.pack(len(obj)) + obj
    elif t is list or t is tuple:
        out.append(_LIST if t is list else _TUPLE)
        out += _LEN.pack(len(obj))
        for i, item in enumerate(obj):
            _encode(item, out, (at, "[{!r}]", i), depth + 1)
    elif t is dict:
        out.append(_DICT)
        out += _LEN.pack(len(obj))
        for key, value in obj.items():
            if type(key) not in (str, int):
                raise TypeError(
                    f"{_path(at)}: dict key {key!r} of type {type(key).__qualname__}; "
                    "keys must be str or int"
                )
            _encode(key, out, (at, " key {!r}", key), depth + 1)
            _encode(value, out, (at, "[{!r}]", key), depth + 1)
    else:
        raise TypeError(
            f"{_path(at)}: cannot encode {t.__qualname__}; xcoll's codec takes None, bool, "
            "int, float, str, bytes, and lists, tuples and dicts of them"
        )


def decode(data: bytes) -> Any:
    """The value that :func:`xcoll.encode_object` made.

    Reads only the format's tags and lengths: malformed bytes raise and never
    run code.

    Args:
        data: bytes (or any bytes-like object) holding exactly one encoded value.

    Returns:
        The decoded value, equal to the one encoded, types preserved.

    Raises:
        ValueError: ``data`` is not exactly one encoded value (malformed, cut
            short, or with bytes after it), naming the offset.

    >>> import xcoll
    >>> xcoll.decode_object(xcoll.encode_object([1, "two", 3.0]))
    [1, 'two', 3.0]
    """
    buf = memoryview(bytes(data))  # (its length in bytes, whatever ``data``'s item size)
    value, end = _decode(buf, 0, 0)
    if end != len(buf):
        raise ValueError(f"malformed xcoll encoding: {len(buf) - end} byte(s) after the value")
    return value


def _take(buf: memoryview, at: int, n: int) -> tuple[memoryview, int]:
    if n > len(buf) - at:
        raise ValueError(
            f"malformed xcoll encoding: needs {n} bytes at offset {at}, has {len(buf) - at}"
        )
    return buf[at : at + n], at + n


def _length(buf: memoryview, at: int) -> tuple[int, int]:
    raw, at = _take(buf, at, _LEN.size)
    return _LEN.unpack(raw)[0], at


def _decode(buf: memoryview, at: int, depth: int) -> tuple[Any, int]:
    if depth > MAX_DEPTH:
        raise ValueError(
            f"malformed xcoll encoding: nested more than {MAX_DEPTH} levels at offset {at}"
        )
    tag_raw, at = _take(buf, at, 1)
    tag = tag_raw[0]
    if tag == _NONE:
        return None, at
    if tag in (_TRUE, _FALSE):
        return tag == _TRUE, at
    if tag == _INT:
        sign, at = _take(buf, at, 1)
        if sign[0] > 1:
            raise ValueError(f"malformed xcoll encoding: sign byte {sign[0]} at offset {at - 1}")
        n, at = _length(buf, at)
        raw, at = _take(buf, at, n)
        value = int.from_bytes(raw, "big")
        return (-value if sign[0] else value), at
    if tag == _FLOAT:
        raw, at = _take(buf, at, _F64.size)
        return _F64.unpack(raw)[0], at
    if tag in (_STR, _BYTES):
        n, at = _length(buf, at)
        raw, at = _take(buf, at, n)
        if tag == _BYTES:
            return bytes(raw), at
        try:
            return bytes(raw).decode("utf-8", "surrogatepass"), at
        except UnicodeDecodeError as e:
            raise ValueError(
                f"malformed xcoll encoding: bad UTF-8 at offset {at - n}: {e}"
            ) from None
    if tag in (_LIST, _TUPLE, _DICT):
        n, at = _length(buf, at)
        if n > len(buf) - at:  # every item takes at least one byte
            raise ValueError(f"malformed xcoll encoding: {n} items cannot fit at offset {at}")
        if tag == _DICT:
            out = {}
            for _ in range(n):
                key, at = _decode(buf, at, depth + 1)
                if type(key) not in (str, int):
                    raise ValueError(
                        f"malformed xcoll encoding: dict key of type {type(key).__name__}"
                    )
                out[key], at = _decode(buf, at, depth + 1)
            return out, at
        items = []
        for _ in range(n):
            item, at = _decode(buf, at, depth + 1)
            items.append(item)
        return (items if tag == _LIST else tuple(items)), at
    raise ValueError(f"malformed xcoll encoding: unknown tag {tag!r} at offset {at - 1}")
