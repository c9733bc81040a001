"""xcoll's object codec, object exchange and tagged barrier: no pickle anywhere."""

from __future__ import annotations

import ast
import math
import struct
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

import xcoll
from tests.helpers import PROPERTY, needs_xla, same_bits
from tests.replicas import counters, shared_pool

FLOATS = (
    st.floats()
    | st.sampled_from([-0.0, math.inf, -math.inf])
    | st.integers(0, 2**64 - 1).map(
        lambda bits: struct.unpack(">d", bits.to_bytes(8, "big"))[
            0
        ]  # any bit pattern, NaN payloads included
    )
)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(-(2**200), 2**200)
    | FLOATS
    | st.text()
    | st.binary()
)
OBJECTS = st.recursive(
    SCALARS,
    lambda c: (
        st.lists(c, max_size=4)
        | st.lists(c, max_size=4).map(tuple)
        | st.dictionaries(st.text(max_size=5) | st.integers(), c, max_size=4)
    ),
    max_leaves=20,
)


# ---- the codec ---------------------------------------------------------------


@given(OBJECTS)
def test_codec_round_trip_is_exact(obj):
    assert same_bits(xcoll.decode_object(xcoll.encode_object(obj)), obj)


class Thing:
    pass


@pytest.mark.parametrize(
    "obj,path",
    [
        ({"a": [1, Thing()]}, "obj['a'][1]"),
        ([{1, 2}], "obj[0]"),
        ({"f": len}, "obj['f']"),
        ({"t": [0, torch.ones(2)]}, "obj['t'][1]"),
        ({(1, 2): 3}, "obj: dict key (1, 2)"),
        ([True, 1.5, __import__("enum").IntEnum("E", "A").A], "obj[2]"),
    ],
)
def test_codec_refuses_with_the_path(obj, path):
    with pytest.raises(TypeError) as e:
        xcoll.encode_object(obj)
    assert str(e.value).startswith(path)


def test_codec_names_a_deep_path_by_its_ends():
    deep = node = []
    for _ in range(300):
        node.append([])
        node = node[0]
    with pytest.raises(ValueError) as e:
        xcoll.encode_object({"a": [deep]})
    # the first and last few steps, not all 200 of them
    assert str(e.value) == "obj['a'][0][0][0]...[0][0]: nested more than 200 levels deep"


@given(OBJECTS, st.binary(min_size=1, max_size=20))
def test_bytes_after_an_encoded_value_are_refused(obj, extra):
    enc = xcoll.encode_object(obj)
    second = xcoll.encode_object(obj)
    with pytest.raises(ValueError) as e:
        xcoll.decode_object(enc + second)  # two complete values
    assert str(e.value) == f"malformed xcoll encoding: {len(second)} byte(s) after the value"
    with pytest.raises(ValueError, match="malformed"):
        xcoll.decode_object(enc + extra)


def _n(k: int) -> bytes:
    return k.to_bytes(8, "big")  # a length or count: 8 bytes, big-endian


@pytest.mark.parametrize(
    "obj,encoding",
    [
        (None, b"N"),
        (True, b"T"),
        (False, b"F"),
        (0, b"I\x00" + _n(0)),
        (255, b"I\x00" + _n(1) + b"\xff"),
        (256, b"I\x00" + _n(2) + b"\x01\x00"),
        (-1, b"I\x01" + _n(1) + b"\x01"),
        (-(2**64), b"I\x01" + _n(9) + b"\x01" + bytes(8)),
        (-0.0, b"D" + struct.pack(">d", -0.0)),
        (1.5, b"D" + struct.pack(">d", 1.5)),
        ("é", b"S" + _n(2) + "é".encode()),
        ("\ud800", b"S" + _n(3) + b"\xed\xa0\x80"),  # a lone surrogate, as CESU-8 would
        (b"\x00x", b"B" + _n(2) + b"\x00x"),
        ([1, None], b"L" + _n(2) + b"I\x00" + _n(1) + b"\x01N"),
        ((), b"U" + _n(0)),
        (
            {"a": [], 2: b""},
            b"M" + _n(2) + b"S" + _n(1) + b"aL" + _n(0) + b"I\x00" + _n(1) + b"\x02B" + _n(0),
        ),
    ],
)
def test_the_encoding_is_the_documented_format(obj, encoding):
    """One encoding per value, the one xcoll._encode.codec's docstring describes:
    replicas compare encodings byte for byte (barrier tags)."""
    assert xcoll.encode_object(obj) == encoding
    assert same_bits(xcoll.decode_object(encoding), obj)


@given(st.text(st.characters(codec="utf-8") | st.characters(categories=["Cs"])))
def test_strings_with_lone_surrogates_round_trip(text):
    assert xcoll.decode_object(xcoll.encode_object({text: [text]})) == {text: [text]}


def _nested(depth: int, inner):
    for _ in range(depth):
        inner = [inner]
    return inner


_LIST = b"L" + _n(1)  # a list of one item: 9 bytes


@pytest.mark.parametrize(
    "data,message",
    [
        (b"I\x02" + _n(0), "sign byte 2 at offset 1"),
        (b"NNNN", "3 byte(s) after the value"),
        (b"S" + _n(5) + b"ab", "needs 5 bytes at offset 9, has 2"),
        (b"L" + _n(1) + b"D\x00", "needs 8 bytes at offset 10, has 1"),
        (b"S" + _n(3) + b"a\xffb", "bad UTF-8 at offset 9: "),
        (b"L" + _n(5) + b"NN", "5 items cannot fit at offset 9"),
        (b"L" + _n(2**64 - 1), f"{2**64 - 1} items cannot fit at offset 9"),
        (b"Z", "unknown tag 90 at offset 0"),
        (b"U" + _n(1) + b"Z", "unknown tag 90 at offset 9"),
        (b"M" + _n(1) + b"NN", "dict key of type NoneType"),
        (b"M" + _n(1) + b"M" + _n(0) + b"N", "dict key of type dict"),
        # 201 lists: the innermost value is 201 levels deep
        (_LIST * 201 + b"N", "nested more than 200 levels at offset 1809"),
        # a dict 200 levels deep: its key is the 201st level
        (
            _LIST * 200 + b"M" + _n(1) + b"S" + _n(1) + b"aN",
            "nested more than 200 levels at offset 1809",
        ),
    ],
)
def test_malformed_encodings_are_named_exactly(data, message):
    with pytest.raises(ValueError) as e:
        xcoll.decode_object(data)
    assert str(e.value).startswith(f"malformed xcoll encoding: {message}"), str(e.value)


def test_values_nested_exactly_200_levels_deep_are_the_limit():
    for inner in (0, [], {}, {"a": 1}):
        deep = _nested(199 if inner == {"a": 1} else 200, inner)
        assert xcoll.decode_object(xcoll.encode_object(deep)) == deep
    assert xcoll.decode_object(_LIST * 200 + b"N") == _nested(200, None)
    with pytest.raises(ValueError) as e:
        xcoll.encode_object(_nested(201, 0))
    assert str(e.value) == "obj[0][0][0][0]...[0][0]: nested more than 200 levels deep"
    with pytest.raises(ValueError) as e:  # a dict's key is a level below it
        xcoll.encode_object(_nested(200, {"a": 1}))
    assert str(e.value) == "obj[0][0][0][0]...[0] key 'a': nested more than 200 levels deep"
    # and so is its value: in 200 dicts, a list's item is the 201st level
    deep, wrapped = 0, [0]
    for _ in range(200):
        deep, wrapped = {"a": deep}, {"a": wrapped}
    assert xcoll.decode_object(xcoll.encode_object(deep)) == deep
    with pytest.raises(ValueError) as e:
        xcoll.encode_object(wrapped)
    assert str(e.value) == "obj['a']['a']['a']['a']...['a'][0]: nested more than 200 levels deep"
    one = b"M" + _n(1) + b"S" + _n(1) + b"a"  # a dict of one item, its key 'a': 19 bytes
    assert xcoll.decode_object(one * 200 + b"I\x00" + _n(0)) == deep
    with pytest.raises(ValueError) as e:
        xcoll.decode_object(one * 200 + _LIST + b"N")
    assert str(e.value) == "malformed xcoll encoding: nested more than 200 levels at offset 3809"


@pytest.mark.parametrize(
    "obj,message",
    [
        (_nested(8, {1}), "obj[0][0][0][0][0][0][0][0]: cannot encode set"),  # 8 steps: all
        (_nested(9, {1}), "obj[0][0][0][0]...[0][0]: cannot encode set"),  # 9: both ends
        (
            {"a": [1, Thing()]},
            "obj['a'][1]: cannot encode Thing; xcoll's codec takes None, bool, int, float, "
            "str, bytes, and lists, tuples and dicts of them",
        ),
        (
            {"a": {(1, 2): 3}},
            "obj['a']: dict key (1, 2) of type tuple; keys must be str or int",
        ),
        (
            [{"b": {None: 1}}],
            "obj[0]['b']: dict key None of type NoneType; keys must be str or int",
        ),
    ],
)
def test_refusals_name_the_path_exactly(obj, message):
    with pytest.raises(TypeError) as e:
        xcoll.encode_object(obj)
    assert str(e.value).startswith(message), str(e.value)


@given(st.binary(max_size=200))
def test_decoder_fuzz_raises_value_error_or_decodes(data):
    try:
        xcoll.decode_object(data)
    except ValueError as e:
        assert "malformed xcoll encoding" in str(e)


@given(OBJECTS, st.data())
def test_truncated_or_corrupted_encodings_are_refused(obj, data):
    enc = xcoll.encode_object(obj)
    cut = data.draw(st.integers(0, len(enc) - 1), "cut")
    with pytest.raises(ValueError, match="malformed"):
        xcoll.decode_object(enc[:cut])
    flipped = bytearray(enc)
    at = data.draw(st.integers(0, len(enc) - 1), "at")
    flipped[at] ^= data.draw(st.integers(1, 255), "xor")
    try:
        xcoll.decode_object(bytes(flipped))  # may still be a valid encoding
    except ValueError as e:
        assert "malformed" in str(e)


def test_no_module_of_xcoll_imports_pickle_or_calls_torch_load():
    for path in Path(xcoll.__file__).parent.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                names = []
            assert not any(
                n.split(".")[0] in ("pickle", "cPickle", "cloudpickle", "dill") for n in names
            ), path
            if isinstance(node, ast.Call):
                f = node.func
                assert not (
                    isinstance(f, ast.Attribute)
                    and f.attr == "load"
                    and getattr(f.value, "id", "") == "torch"
                ), path
                assert not (isinstance(f, ast.Name) and f.id in ("eval", "exec")), path


# ---- exchange on replicas ------------------------------------------------------


def _gather_object(objs):
    return xcoll.gather_object(objs[xcoll.rank()])


def _broadcast_object(args):
    objs, src = args
    return xcoll.broadcast_object(objs[xcoll.rank()], src=src)


@PROPERTY
@given(data=st.data())
def test_gather_and_broadcast_objects(pool, data):
    w = pool.world_size
    objs = data.draw(st.lists(OBJECTS, min_size=w, max_size=w), "objs")
    for got in pool.run(_gather_object, [objs] * w):
        assert same_bits(got, objs)
    src = data.draw(st.integers(0, w - 1), "src")
    for got in pool.run(_broadcast_object, [(objs, src)] * w):
        assert same_bits(got, objs[src])


def _small_from_src(_=None):
    # (src's objects encode to 1 byte each; the receivers' own, larger, are
    # ignored, as the docstring says)
    mine = xcoll.rank() == 0
    first = xcoll.broadcast_object(None if mine else {"ignored": "x" * 100})
    return first, xcoll.broadcast_object(True if mine else [1, 2, {3}])


def test_a_broadcast_object_of_one_byte_ignores_the_receivers_objects(pool):
    assert pool.run(_small_from_src, [None] * pool.world_size) == [(None, True)] * pool.world_size


def _one_bad(which):
    obj = {"ok": 1} if xcoll.rank() != 0 else {"bad": {1, 2}}
    if which == "gather":
        return xcoll.gather_object(obj)
    return xcoll.broadcast_object(obj, src=0)


@pytest.mark.parametrize("which", ["gather", "broadcast"])
def test_an_unencodable_object_raises_on_every_replica(pool, which):
    failures = pool.run(_one_bad, [which] * pool.world_size, return_exceptions=True)
    assert failures[0].type_name == "builtins.TypeError" and "obj['bad']" in failures[0].message
    for f in failures[1:]:
        assert f.type_name == "builtins.ValueError"
        assert f.message == (
            f"{which}_object: replica(s) [0] could not encode their object (see their error)"
        ), f.message
    assert (
        pool.run(_gather_object, [[7] * pool.world_size] * pool.world_size)
        == [[7] * pool.world_size] * pool.world_size
    )


def _broadcast_three(_=None):
    return xcoll.broadcast_object({"a": [1, 2, 3]})


@needs_xla
def test_a_warm_broadcast_object_on_xla_runs_two_programs_per_replica():
    # (its size exchange, fetched to the host as it is made, then its data:
    # a size read from the device would be one more program and transfer)
    pool = shared_pool("xla-cpu-2")
    pool.run(_broadcast_three, [None] * 2)  # (compiles)
    before = pool.run(counters)[0]
    assert pool.run(_broadcast_three, [None] * 2) == [{"a": [1, 2, 3]}] * 2
    after = pool.run(counters)[0]
    assert after["executions"] - before["executions"] == 2 * 2, (before, after)


def _tagged(which):
    r = xcoll.rank()
    xcoll.barrier()  # (a group's first call is checked in full: not this one)
    try:
        if which == "gather_object":
            return xcoll.gather_object({"r": r}, tag=f"t{r}")
        return xcoll.broadcast_object({"r": r}, tag=f"t{r}")
    except xcoll.CollectiveMismatchError as e:
        return str(e)


@pytest.mark.parametrize("which", ["gather_object", "broadcast_object"])
def test_objects_whose_calls_differ_raise_naming_the_difference(pool, which):
    # (replicas whose tags differ: the guard's fingerprint travels with the
    # sizes, summed on every engine for a broadcast's: every replica reads it)
    w = pool.world_size
    got = pool.run(_tagged, [which] * w)
    if w == 1:
        assert got == [[{"r": 0}] if which == "gather_object" else {"r": 0}], got
        return
    for r, text in enumerate(got):
        other = 0 if r else 1
        assert text == (
            f"xcoll.{which}: replicas made different calls; the first difference: this "
            f"replica (rank {r}) has tag: tag='t{r}'; rank {other} has tag: tag='t{other}'"
        ), text


def _barriers(which):
    r = xcoll.rank()
    xcoll.barrier()  # (as above)
    try:
        with xcoll.step("s" if which == "lines" else f"s{r}"):
            # (one call written twice: under "lines", rank 0's is made from
            # another line than the others', so their places differ)
            if r == 0 or which != "lines":
                xcoll.barrier("end")
            else:
                xcoll.barrier("end")
    except xcoll.CollectiveMismatchError as e:
        return str(e)
    return "passed"


@pytest.mark.parametrize("which", ["lines", "steps"])
def test_barriers_of_one_tag_whose_calls_differ_raise_naming_the_difference(pool, which):
    # (the same barrier tag, made from two lines, or in two steps)
    w = pool.world_size
    got = pool.run(_barriers, [which] * w)
    if w == 1:
        assert got == ["passed"], got
        return
    for r, text in enumerate(got):
        assert text.startswith(
            "xcoll.barrier: replicas made different calls; the first difference: this "
            f"replica (rank {r}) has tag: step "
        ), text
        other = 0 if r else 1
        step = ("s{}" if which == "steps" else "s").format
        assert f"(rank {r}) has tag: step '{step(r)}', call 0 at line " in text, text
        assert f"; rank {other} has tag: step '{step(other)}', call 0 at line " in text, text


def _barrier(tags):
    xcoll.barrier(tags[xcoll.rank()])
    return "passed"


def test_barrier_passes_with_one_tag_and_names_different_ones(pool):
    w = pool.world_size
    assert pool.run(_barrier, [["epoch-1"] * w] * w) == ["passed"] * w
    if w == 1:
        return
    # (one replica's tag another: a str that UTF-8 cannot encode, a lone
    # surrogate; barrier()'s default, which sends no byte; one past the
    # exchange's size rounding; on the last replica or the first)
    for where, other in [(-1, "epoch-2"), (-1, "epoch-\udc80"), (-1, ""), (0, ""), (0, "e" * 1500)]:
        tags = ["epoch-1"] * w
        tags[where] = other
        failures = pool.run(_barrier, [tags] * w, return_exceptions=True)
        listing = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
        for f in failures:
            assert f.type_name == "builtins.ValueError"
            assert f.message == f"barrier tags differ between replicas ({listing})", f.message
    assert pool.run(_barrier, [["again"] * w] * w) == ["passed"] * w


def _objects_each_way(_):
    r = xcoll.rank()
    return xcoll.gather_object({"rank": r}), xcoll.broadcast_object({"big": 2**40 + r}, src=1)


def test_objects_cross_an_xla_setting_that_narrows_int64():
    """torch_xla's XLA_USE_32BIT_LONG keeps int64 as int32 on the device:
    an object's size travels as its bytes (broadcast_object raised TypeError
    naming a tree the caller never passed)."""
    pytest.importorskip("torch_xla")
    from xcoll.testing import XlaPool

    with XlaPool(2, env={"XLA_USE_32BIT_LONG": "1"}) as pool:
        results = pool.run(_objects_each_way, [None, None])
    assert results == [([{"rank": 0}, {"rank": 1}], {"big": 2**40 + 1})] * 2
