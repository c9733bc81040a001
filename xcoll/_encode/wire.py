"""How each dtype travels so that results are exact on every backend.

Moves (gather, broadcast) carry floating-point data as the integer of the same
width holding its bits. A float collective may change bits: torch_xla adds a
numeric token to every collective's input (``-0.0 + 0.0 == +0.0``), and a NaN at
the front of one collective's result turns later collectives of the same graph
into NaN. An integer collective changes nothing. Bools travel as uint8.

max/min of floats travel as integer keys that sort like the floats (IEEE total
order), with every NaN replaced by the NaN that wins the reduction, so NaN propagates as
in ``torch.maximum``/``torch.minimum``. XLA's float max/min drops NaN, and
integer max/min is the same on every backend.

``bitcast(t, dtype)`` reinterprets bits and is provided by the backend: XLA needs
its own lowering, everywhere else it is ``Tensor.view(dtype)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Bitcast = Callable[[torch.Tensor, torch.dtype], torch.Tensor]

#: Floating dtype -> the integer dtype of the same width that carries its bits.
BITS: dict[torch.dtype, torch.dtype] = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def _nan_bits(dtype: torch.dtype, negative: bool) -> int:
    """The quiet NaN of ``dtype`` as its signed integer bits, with the sign bit set
    if ``negative``. (Built from bits: converting ``-nan`` to bfloat16 drops the
    sign.)"""
    positive = int(torch.tensor(float("nan"), dtype=dtype).view(BITS[dtype]).item())
    width = 8 * dtype.itemsize
    return positive - (1 << width) + (1 << (width - 1)) if negative else positive


#: The NaN each reduction lets win, as integer bits: +NaN is the largest key, -NaN the smallest.
WINNING_NAN = {
    (dtype, reduction): _nan_bits(dtype, negative=(reduction == "min"))
    for dtype in BITS
    for reduction in ("max", "min")
}
MAGNITUDE = {d: torch.iinfo(d).max for d in set(BITS.values())}

#: The integer dtypes (bool included), in an order in which the last present
#: one holds the values of every other it can (``xcoll._core.ops.merged``).
INTS = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)

#: Half-precision sums, products and means accumulate in float32 on every backend
#: (XLA:CPU cannot all-reduce bfloat16 at all) and are rounded back once.
ACCUMULATE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype a move carries ``dtype`` as."""
    return torch.uint8 if dtype == torch.bool else BITS.get(dtype, dtype)


def encode_move(buf: torch.Tensor, bitcast: Bitcast) -> torch.Tensor:
    """``buf`` as an integer tensor that carries it bit for bit."""
    if buf.dtype == torch.bool:
        return buf.to(torch.uint8)
    if buf.dtype in BITS:
        return bitcast(buf, BITS[buf.dtype])
    return buf


def decode_move(wire: torch.Tensor, dtype: torch.dtype, bitcast: Bitcast) -> torch.Tensor:
    """Inverse of :func:`encode_move`."""
    if dtype == torch.bool:
        return wire != 0
    if dtype in BITS:
        return bitcast(wire, dtype)
    return wire


# Elements per step of an in-place pass: bounds its temporaries (a mask, the
# flipped keys) to a few MiB whatever the buffer's size.
_CHUNK = 1 << 20


def _chunks(t: torch.Tensor) -> list[torch.Tensor]:
    return list(t.split(_CHUNK)) if t.shape[0] > _CHUNK else [t]


def reduced_dtype(dtype: torch.dtype, reduction: str) -> torch.dtype:
    """The dtype in which :func:`encode_reduce` sends ``dtype`` for ``reduction``."""
    if dtype == torch.bool:
        return torch.uint8
    if dtype.is_floating_point:
        return BITS[dtype] if reduction in ("max", "min") else ACCUMULATE.get(dtype, dtype)
    return dtype


def encode_reduce(buf: torch.Tensor, reduction: str, bitcast: Bitcast) -> torch.Tensor:
    """``buf`` in the form whose integer or float all-reduce by ``reduction`` gives the
    result: bools as uint8 (max = any, min = all), float max/min as ordered keys,
    float sums and products with -0.0 as +0.0, half precision in float32.

    Consumes ``buf`` (a buffer of the caller's own): the result is ``buf``
    itself, overwritten, wherever the width stays, so that a reduce of a large
    buffer needs no second one."""
    if buf.dtype == torch.bool:
        return buf.view(torch.uint8)  # (a bool is stored as the byte 0 or 1)
    if buf.dtype.is_floating_point:
        if reduction in ("max", "min"):
            keys = bitcast(buf, BITS[buf.dtype])
            for k, x in zip(_chunks(keys), _chunks(buf), strict=True):
                k.copy_(encode_order(x, reduction, bitcast))
            return keys
        # + 0.0 turns -0.0 into +0.0 and changes nothing else. torch_xla's
        # collective token does exactly this to every input, so doing it on every
        # backend makes float sums and products bitwise the same everywhere.
        wide = ACCUMULATE.get(buf.dtype, buf.dtype)
        return (buf if wide == buf.dtype else buf.to(wide)).add_(0.0)
    return buf


def decode_reduce(
    out: torch.Tensor,
    dtype: torch.dtype,
    reduction: str,
    bitcast: Bitcast,
    means: Sequence[tuple[int, int]] = (),
    world: int = 1,
) -> torch.Tensor:
    """Inverse of :func:`encode_reduce` on the reduced tensor, which it
    consumes as that does. The elements in the ranges ``means`` (``(start,
    stop)``, of a float sum) are divided by ``world`` before the result is
    rounded to ``dtype``: a half-precision mean is divided in float32 and
    rounded once. A NaN result is the quiet NaN ``float("nan")``: engines
    differ in the sign and payload of the NaN an operation makes, and results
    must not depend on the engine."""
    if dtype == torch.bool:
        return out != 0
    if not dtype.is_floating_point:
        return out if out.dtype == dtype else out.to(dtype)
    if reduction in ("max", "min"):
        for k in _chunks(out):
            k.copy_(_flip(k))
        out = bitcast(out, dtype)
    else:
        for start, stop in means:
            out[start:stop].div_(world)
        # (a call less where the dtype stays: each may hand the GIL to another replica)
        out = out if out.dtype == dtype else out.to(dtype)
    return _quiet(out)


def cast_back(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A decoded reduce result of a merged bucket (``xcoll._core.ops.merged``) cast
    back to a leaf's narrower ``dtype``, as :func:`decode_reduce` would have
    made it: rounded once, a NaN the quiet NaN (float32's NaN cast to bfloat16
    is not bfloat16's)."""
    out = out.to(dtype)
    return _quiet(out) if dtype.is_floating_point else out


def _quiet(t: torch.Tensor) -> torch.Tensor:
    """``t`` with every NaN the quiet NaN ``float("nan")``, in place."""
    return t.nan_to_num_(nan=float("nan"), posinf=float("inf"), neginf=float("-inf"))


def _flip(bits: torch.Tensor) -> torch.Tensor:
    """Negative floats sort backwards as two's complement integers: their
    magnitude bits flipped, keys sort like values (-0.0 just below +0.0). Its
    own inverse."""
    return torch.where(bits < 0, bits ^ MAGNITUDE[bits.dtype], bits)


def encode_order(buf: torch.Tensor, reduction: str, bitcast: Bitcast) -> torch.Tensor:
    """Float ``buf`` as integer keys whose integer ``reduction`` ("max"/"min") is the
    float reduction with NaN propagating."""
    bits = bitcast(buf, BITS[buf.dtype]).masked_fill(torch.isnan(buf), WINNING_NAN[buf.dtype, reduction])
    return _flip(bits)


def decode_order(keys: torch.Tensor, dtype: torch.dtype, bitcast: Bitcast) -> torch.Tensor:
    """Inverse of :func:`encode_order`."""
    return bitcast(_flip(keys), dtype)
