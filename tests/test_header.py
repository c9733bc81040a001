"""The guard header's verdict, exactly, for every dtype, reduction and world size:
each replica's header combined as the engine combines it (in the wire form,
in the wire dtype: integer sums wrap as the engine's do), then read by each
replica against its own expectation. Equal fingerprints pass on every
replica; any that differ pass on none. And the header's size: the same for
every dtype of one width and every reduction but prod, and small."""

from __future__ import annotations

import functools
import hashlib

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import example, given, settings

import xcoll
from tests.replicas import engine_calls, shared_pool
from xcoll._backends.base import TORCH
from xcoll._base import tree as _tree
from xcoll._core import ops as _ops
from xcoll._encode import wire as _wire
from xcoll._guard import header as _header

_REDUCED = sorted(_tree.SUPPORTED_DTYPES, key=str)  # every dtype a reduce takes
#: How each collective carries its header (:attr:`xcoll._core.ops.Packed.carries`).
_OP = {"gather": _ops.Gather(), "reduce": _ops.Reduce(), "broadcast": _ops.Broadcast()}


def _guard(kind: str, dtype: torch.dtype, reduction: str, world: int) -> _header.Guard:
    """The guard of collective ``kind`` whose header is combined by ``reduction``."""
    return _header.guard(_OP[kind].carries, dtype, reduction, reduction == "sum", world, True)


_COMBINE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum, "prod": torch.mul}


def _fingerprint(k: int) -> bytes:
    return hashlib.sha256(str(k).encode()).digest()


def _verdicts(kind: str, dtype: torch.dtype, reduction: str, prints: list[bytes]) -> list[bool]:
    """Per replica (one fingerprint each), whether its guard passes. (Each
    distinct fingerprint's header is built, encoded and read once: at W=255
    most replicas share one.)"""
    w = len(prints)
    distinct = list(dict.fromkeys(prints))
    g = _guard(kind, dtype, reduction, w)
    assert (g.dtype, g.reduction) == (dtype, reduction)
    headers = {p: _header._build(p, g) for p in distinct}
    if kind == "reduce":
        encoded = {
            p: _wire.encode_reduce(h.part.clone(), reduction, TORCH.bitcast) for p, h in headers.items()
        }
    else:
        encoded = {p: _wire.encode_move(h.part, TORCH.bitcast) for p, h in headers.items()}
    wires = [encoded[p] for p in prints]
    if kind == "gather":
        got = _header.as_bytes(torch.stack(wires))
        return [got == headers[p].wire for p in prints]
    # (one element at a time, in the wire dtype: an integer sum wraps as the engine's)
    result = functools.reduce(_COMBINE["sum" if kind == "broadcast" else reduction], wires)
    decoded = (
        _wire.decode_reduce(result.clone(), dtype, reduction, TORCH.bitcast)
        if kind == "reduce"
        else _wire.decode_move(result, dtype, TORCH.bitcast)
    )
    got, got_decoded = _header.as_bytes(result), _header.as_bytes(decoded)
    wire_ok = {p: got == h.wire for p, h in headers.items()}
    decoded_ok = {p: got_decoded == h.decoded for p, h in headers.items()}
    assert wire_ok == decoded_ok  # (eager engines read the one, lazy ones the other)
    return [wire_ok[p] for p in prints]


def _reductions(dtype: torch.dtype) -> list[str]:
    return ["max", "min"] if dtype == torch.bool else ["sum", "max", "min", "prod"]


@settings(deadline=None)
@example(world=2, differ=[1], bit=0, seed=0)
@example(world=255, differ=[3, 200], bit=63, seed=1)
@given(
    world=st.integers(1, 9) | st.sampled_from([127, 128, 255]),
    differ=st.lists(st.integers(0, 254), max_size=3),
    bit=st.integers(0, 63) | st.none(),
    seed=st.integers(0, 1 << 20),
)
def test_a_verdict_passes_on_every_replica_or_on_none(world, differ, bit, seed):
    """Replicas in ``differ`` hold another fingerprint: the same one bit
    flipped, or another digest (``bit`` None); every other replica holds
    ``seed``'s."""
    mine = _fingerprint(seed)
    other = (
        _fingerprint(seed + 1)
        if bit is None
        else bytes(b ^ (1 << (bit % 8)) if j == bit // 8 else b for j, b in enumerate(mine))
    )
    _every_verdict([other if r in differ else mine for r in range(world)])


@settings(deadline=None)
@example(offsets=[-1, 0, 1], n=(1 << 40) + 2)  # a sum of v alone: 3 v at W=3
@example(offsets=[-2, 1, 1, 0], n=6)
@given(
    offsets=st.lists(st.integers(-3, 3), min_size=1, max_size=9), n=st.integers(0, (1 << 64) - 1)
)
def test_fingerprints_whose_values_sum_alike_pass_on_no_replica(offsets, n):
    """Replica r's fingerprint is ``n + offsets[r]``: values spread around one
    replica's so that their sum is W times it (a header of ``v`` alone, or of
    sums that wrap, would pass there)."""
    _every_verdict([((n + d) % (1 << 64)).to_bytes(8, "little") * 4 for d in offsets])


def _every_verdict(prints: list[bytes]) -> None:
    """Every kind of header's verdict on every replica: pass if the replicas'
    ``prints`` are all one, else fail."""
    same = len(set(prints)) == 1
    cases = [("gather", torch.int32, ""), ("broadcast", torch.int32, "sum")]
    cases += [("reduce", d, reduction) for d in _REDUCED for reduction in _reductions(d)]
    for kind, dtype, reduction in cases:
        assert _verdicts(kind, dtype, reduction, prints) == [same] * len(prints), (kind, dtype, reduction)


def test_a_reduce_header_has_one_size_per_width_and_is_small():
    """Replicas whose reductions (prod aside) or dtypes of one width differ make
    collectives of one size; at W=4 a 4-byte bucket's header has 12
    elements, an 8-byte one's 6, a gather's 2 words."""
    for world in (1, 2, 4, 8, 255):
        for width in (1, 2, 4, 8):
            sizes = {
                _header.alike_size(d, reduction, world)
                for d in _REDUCED
                if d.itemsize == width
                for reduction in _reductions(d)
                if reduction != "prod"
            }
            assert len(sizes) == 1, (world, width, sizes)
    assert _header.alike_size(torch.float32, "sum", 4) == 12
    assert _header.alike_size(torch.int64, "max", 4) == 6
    # each reduction's own values, before the padding to its width's size: k-bit
    # values as wide as the dtype holds exactly (sums: W (2**k - 1)**2 exactly)
    own = {
        (torch.float32, "sum"): 12,  # k = 11
        (torch.float32, "max"): 6,  # k = 24
        (torch.int64, "sum"): 6,  # k = 30
        (torch.int64, "min"): 4,  # k = 63
        (torch.uint8, "max"): 16,  # k = 8
        (torch.int8, "sum"): 64,  # k = 2
        (torch.bool, "max"): 128,  # k = 1
        (torch.float16, "prod"): 128,  # bits and complements
    }
    for (dtype, reduction), n in own.items():
        assert len(_header._values(_fingerprint(0), dtype, reduction, 4)) == n, (dtype, reduction)


_MANTISSA = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}


def test_a_sum_header_uses_the_most_bits_that_stay_exact():
    """k, a sum header value's bits: the most for which W (2**k - 1)**2 is
    exact in the dtype (at least 1), at every W up to 300."""
    for dtype in _REDUCED:
        if dtype == torch.bool:
            continue
        exact = 2 ** _MANTISSA[dtype] if dtype.is_floating_point else torch.iinfo(dtype).max
        for world in range(1, 301):
            k = _header._width(dtype, "sum", world)
            assert k == 1 or world * (2**k - 1) ** 2 <= exact, (dtype, world, k)
            assert world * (2 ** (k + 1) - 1) ** 2 > exact, (dtype, world, k)
    assert _guard("gather", torch.int32, "", 4).size == 2
    assert _guard("broadcast", torch.int32, "", 4).size == 2


def _sent(_):
    """Each collective of a 1-element float32 reduce (guarded, then in mode
    never) and its elements, on a group whose first call has been made."""
    xcoll.gather(xcoll.rank())  # (a group's first call is checked in full)
    with engine_calls() as engine:
        x = torch.tensor([1.5 + xcoll.rank()])
        got = [xcoll.reduce(x).item()]
        with xcoll.consistency_checks("never"):
            got.append(xcoll.reduce(x).item())
    return [(name, t.numel()) for name, t in engine], got


@pytest.mark.parametrize("world", ["gloo-2", "gloo-4"])
def test_a_small_guarded_reduce_sends_a_small_header(world):
    # the header of a float32 sum is small; the guarded call is one all-gather
    # of the size class of small calls (4 KiB: replicas whose later calls
    # differ in size or kind still meet), which costs gloo no more than the
    # header's elements (gloo-small-messages: flat from W elements on);
    # unguarded, an all-reduce of 1 element
    from xcoll._encode import pack

    pool = shared_pool(world)
    w = pool.world_size
    assert 1 + _header.alike_size(torch.float32, "sum", w) <= 16
    expected = sum(1.5 + r for r in range(w))
    # (the engine records an all-gather by its output: W rows of SMALL bytes)
    sent = [([("_allgather_base", w * pack.SMALL), ("allreduce", 1)], [expected, expected])] * w
    assert pool.run(_sent, [None] * w) == sent


def test_a_collective_whose_header_no_verdict_reads_is_refused_when_its_recipe_is_built():
    # (before: any value but "reduced" and "broadcast" was laid out as gathered)
    with pytest.raises(ValueError, match=r"one of \('gathered', 'broadcast', 'reduced'\), not 'scattered'"):
        _header.guard("scattered", torch.float32, "", False, 2, False)


def _subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _subclasses(sub)
    return out


def test_every_collective_carries_its_header_one_known_way_and_declares_its_transpose():
    import xcoll._core.uneven  # noqa: F401  (its op registers its transpose on import)
    from xcoll._core import ops

    collectives = {c for c in _subclasses(ops.Op) if not c.__name__.startswith("_")}
    assert {c.__name__ for c in collectives} >= {
        "Gather", "Reduce", "Broadcast", "ReduceScatter", "AllToAll", "UnevenGather"
    }
    for c in collectives:
        # (the registry is read by exact type: a subclass without its own
        # entry would raise KeyError at its first grad=True call)
        assert c in ops.TRANSPOSES or c in (ops.Packed, ops.Move), c
        if issubclass(c, ops.Packed) and c not in (ops.Packed, ops.Move):
            assert c.carries in _header.CARRIES, c


def test_a_calls_header_is_kept_per_signature_and_tag():
    """A header kept per signature (:meth:`Signature.header`) is the one its
    fingerprint makes, tagged or not: two calls that differ by their tag
    alone send different headers, a call made again with the same tag sends
    the header it sent before, and tags that change each call (a batch
    index's) leave the untagged calls' headers kept."""
    from xcoll._backends.base import LocalTransport
    from xcoll._guard import check as _check

    t, g = LocalTransport(), _guard("reduce", torch.float32, "sum", 2)
    d = _check.Description(("x: float32[3]",))
    untagged = _header.Signature("xcoll.reduce", "op", d)
    step = [_header.Signature("xcoll.reduce", "op", d, tag=f"step {i}, call 0") for i in range(3)]
    kept = untagged.header(g, t)
    headers = [s.header(g, t) for s in step]
    for s, h in zip(step, headers, strict=True):
        built = _header._build(s.fingerprint(), g)
        assert (h.wire, h.decoded) == (built.wire, built.decoded) and torch.equal(h.part, built.part)
        assert s.header(g, t) is h  # (made once per tag)
    assert len({h.wire for h in [kept, *headers]}) == 4
    for i in range(1100):  # (more tags than any header cache keeps)
        _header.Signature("xcoll.reduce", "op", d, tag=f"batch {i}").header(g, t)
    assert untagged.header(g, t) is kept
