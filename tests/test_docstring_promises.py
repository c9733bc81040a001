"""Every error a public docstring promises is held by a named test.

docs/reliability.md's table "The errors the docstrings promise" has a row
for each clause of each ``Raises:`` entry of ``xcoll.__all__`` and
``xcoll.testing.__all__``, and names the tests that raise it and read the
error (its type and its whole text, or the text that tells it apart; on
every replica where the docstring says so). The first tests here check
that table: a promise without a row, or a row whose test is gone, fails.
The others hold the clauses that no other file's test held (or held by
the leaf's path alone), three of them promises the code did not keep until
these tests found them (a list as ``by_index``'s index, a group given without
torch.distributed, ``LocalPool.run``'s argument count).
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import re
import sys

import pytest
import torch
import torch.distributed as dist

import xcoll
import xcoll.testing
from tests.replicas import device, shared_pool

ROOT = pathlib.Path(__file__).resolve().parents[1]
SECTION = "## The errors the docstrings promise, each held by a test"
WORLDS = ["gloo-2", "xla-cpu-2"]


# ---- the table against the docstrings and tests/ --------------------------------


def _rows() -> list[list[str]]:
    """The table's rows: [function, raises, when, test], each cell as written."""
    text = (ROOT / "docs" / "reliability.md").read_text()
    section = text[text.index(SECTION) :].split("\n## ", 1)[0]
    table = section[section.index("| function | raises |") :].split("\n\n", 1)[0]
    return [[c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines()[2:]]


def _documented() -> dict[str, str]:
    """Each public name with a docstring of its own: ``xcoll.__all__``'s by
    name (``gather``), ``xcoll.testing.__all__``'s as ``testing.XlaPool``,
    and the public methods that their classes define with a docstring
    (``testing.ReplicaPool.run``; the pools' inherit it)."""
    out = {}
    for module, prefix in ((xcoll, ""), (xcoll.testing, "testing.")):
        for name in module.__all__:
            obj = getattr(module, name)
            out[prefix + name] = obj.__doc__ or ""
            if inspect.isclass(obj):
                for attr, value in vars(obj).items():
                    if not attr.startswith("_") and callable(value) and value.__doc__:
                        out[f"{prefix}{name}.{attr}"] = value.__doc__
    return out


def _raises(doc: str) -> list[str]:
    """The exceptions a docstring's ``Raises:`` section names (``Nothing;``
    names none), each by its class's own name."""
    doc = inspect.cleandoc(doc)
    if "\nRaises:\n" not in doc:
        return []
    names = []
    for line in doc.split("\nRaises:\n", 1)[1].splitlines():
        if line and not line.startswith(" "):
            break
        m = re.match(r"    ([A-Za-z_][\w.]*): ", line)
        if m:
            names.append(m.group(1).rpartition(".")[2])
    return names


def test_every_promised_error_of_every_public_name_has_a_row():
    promised = {(name, e) for name, doc in _documented().items() for e in _raises(doc)}
    assert len(promised) > 70, sorted(promised)  # (the parser reads the sections)
    rows = {(f.strip("`"), e.strip("`")) for f, e, _, _ in _rows()}
    assert sorted(promised - rows) == [], "a promise without a row"
    assert sorted(rows - promised) == [], "a row for no promise"


def _defined(path: pathlib.Path) -> set[str]:
    """The test functions a test module defines at its top level."""
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def test_every_row_names_tests_that_exist():
    rows = _rows()
    assert len(rows) > 100, len(rows)
    missing, defined = [], {}
    for function, raises, when, tests in rows:
        named = re.findall(r"`(tests/[\w/]+\.py)::(test_\w+)(?:\[[^\]]*\])?`", tests)
        assert named and when, (function, raises, when, tests)
        # (every test is named with its file: a bare name could be any file's)
        assert len(named) == tests.count("::"), (function, raises, tests)
        for file, name in named:
            if file not in defined:
                defined[file] = _defined(ROOT / file) if (ROOT / file).is_file() else set()
            if name not in defined[file]:
                missing.append(f"{function.strip('`')} {raises.strip('`')}: {file}::{name}")
    assert missing == []


def test_the_parser_reads_a_raises_section_entry_by_entry():
    doc = """Summary.

    Raises:
        TypeError: one, and
            more: not an entry.
        xcoll.CollectiveMismatchError: two.
        Nothing; a clause, not an exception.

    >>> 1
    1
    """
    assert _raises(doc) == ["TypeError", "CollectiveMismatchError"]
    assert _raises("No section.") == []


# ---- local refusals, their whole text ---------------------------------------------


@pytest.mark.parametrize("dim", [1.0, True, "0", None])
@pytest.mark.parametrize("kwargs", [{"uneven": True}, {"max_size": 4}], ids=["uneven", "max_size"])
def test_an_uneven_gathers_dim_that_is_not_an_int_is_refused(kwargs, dim):
    # (an uneven gather checks its dim in its own code, not the gather's)
    with pytest.raises(TypeError) as e:
        xcoll.gather({"x": torch.ones(2, 2)}, dim=dim, **kwargs)
    assert str(e.value) == f"dim must be an int, got {dim!r}"


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"dim": 2}, "tree['m']: dim=2 is out of range for a leaf of shape (2, 2)"),
        ({"dim": -3}, "tree['m']: dim=-3 is out of range for a leaf of shape (2, 2)"),
        ({"dim": 3, "stack": True}, "tree['m']: dim=3 is out of range for a leaf of shape (2, 2)"),
        (
            {"dim": 2, "uneven": True},
            "tree['m']: dim=2 is out of range for a leaf of shape (2, 2) (uneven gathers need a dim to grow)",
        ),
        (
            {"dim": -3, "max_size": 4},
            "tree['m']: dim=-3 is out of range for a leaf of shape (2, 2) (uneven gathers need a dim to grow)",
        ),
    ],
    ids=["2", "-3", "stack", "uneven", "max_size"],
)
def test_a_dim_out_of_range_names_the_leaf_and_its_shape(kwargs, message):
    # (a 0-d leaf beside it is gathered to shape (W,) whatever the dim)
    tree = {"m": torch.ones(2, 2), "s": torch.ones(())}
    if "uneven" in kwargs or "max_size" in kwargs:
        del tree["s"]  # (an uneven gather needs a dim to grow in every leaf)
    with pytest.raises(ValueError) as e:
        xcoll.gather(tree, **kwargs)
    assert str(e.value) == message


_SCALAR_NEEDS_SYNC = (
    "tree['n']: a Python scalar leaf needs sync=True (its value is known only after "
    "execution); pass a tensor to trace it into the pending graph"
)
_TO_CPU_NEEDS_SYNC = "to_cpu=True needs sync=True: host values exist only after execution"


@pytest.mark.parametrize("name", ["gather", "reduce", "broadcast"])
def test_sync_false_refuses_python_scalars_and_to_cpu(name):
    fn = getattr(xcoll, name)
    with pytest.raises(ValueError) as e:
        fn({"x": torch.ones(1), "n": 3}, sync=False)
    assert str(e.value) == _SCALAR_NEEDS_SYNC
    with pytest.raises(ValueError) as e:
        fn({"x": torch.ones(1)}, sync=False, to_cpu=True)
    assert str(e.value) == _TO_CPU_NEEDS_SYNC


_MEAN = "mean needs a floating dtype (convert first, e.g. x.float())"
_SUM_OF_BOOLS = 'sum of bools is ambiguous: use "max" for any, "min" for all, or sum x.int() to count'


_REFUSED = {
    "mean of ints": (torch.tensor([1, 2]), "mean", f"op 'mean' is not defined for torch.int64; {_MEAN}"),
    "mean of bools": (torch.tensor([True]), "mean", f"op 'mean' is not defined for torch.bool; {_MEAN}"),
    "sum of bools": (torch.tensor([True]), "sum", f"op 'sum' is not defined for torch.bool; {_SUM_OF_BOOLS}"),
    "mean of an int": (3, "mean", f"op 'mean' is not defined for torch.int64; {_MEAN}"),
    "sum of a bool": (True, "sum", f"op 'sum' is not defined for torch.bool; {_SUM_OF_BOOLS}"),
}


# (a reduce_scatter refuses a Python scalar leaf first: its own row)
@pytest.mark.parametrize(
    "name,case",
    [("reduce", c) for c in _REFUSED]
    + [("reduce_scatter", c) for c, (leaf, _, _) in _REFUSED.items() if isinstance(leaf, torch.Tensor)],
)
def test_an_op_that_a_dtype_refuses_is_named(name, case):
    leaf, op, message = _REFUSED[case]
    with pytest.raises(TypeError) as e:
        getattr(xcoll, name)({"x": torch.ones(1), "n": leaf}, {"x": "sum", "n": op})
    assert str(e.value) == f"tree['n']: {message}"


@pytest.mark.parametrize("op", ["avg", "Sum", 3, 1.5])
@pytest.mark.parametrize("name", ["reduce", "reduce_scatter"])
def test_an_unknown_op_is_named(name, op):
    tree = {"x": torch.ones(2), "y": [torch.ones(2)]}
    with pytest.raises(ValueError) as e:
        getattr(xcoll, name)(tree, {"x": "sum", "y": [op]})
    assert str(e.value) == (
        f"tree['y'][0]: unknown op {op!r}; expected one of sum, mean, max, min, prod"
    )


@pytest.mark.parametrize("op", ["max", "min", "prod"])
@pytest.mark.parametrize("name", ["reduce", "reduce_scatter"])
def test_an_op_without_a_gradient_is_refused_with_grad(name, op):
    fn = getattr(xcoll, name)
    tree = {"i": torch.tensor([3, 4]), "x": torch.ones(2, requires_grad=True)}
    with pytest.raises(ValueError) as e:
        fn(tree, {"i": "sum", "x": op}, grad=True)
    assert str(e.value) == (
        f"tree['x']: op {op!r} has no gradient in xcoll (grad=True differentiates sum and "
        "mean); reduce this leaf in a call without grad"
    )
    # an integer leaf has no gradient to refuse: any op
    assert fn({"i": torch.tensor([3, 4])}, op, grad=True)["i"].tolist() == [3, 4]


_GROUP = "group must be a torch.distributed ProcessGroup (as dist.new_group returns) or None, got "


@pytest.mark.parametrize("value", [1, "no", None])
@pytest.mark.parametrize("flag", ["sync", "to_cpu", "grad"])
@pytest.mark.parametrize("name", ["reduce_scatter", "all_to_all"])
def test_a_flag_or_group_of_the_wrong_type_is_refused_by_reduce_scatter_and_all_to_all(
    name, flag, value
):
    # (each public call checks its flags in its own code; the group, where
    # every call resolves its backend)
    fn = getattr(xcoll, name)
    with pytest.raises(TypeError) as e:
        fn({"x": torch.ones(2, requires_grad=True)}, **{flag: value})
    assert str(e.value) == f"{flag} must be a bool (True or False), got {value!r}"
    with pytest.raises(TypeError) as e:
        fn({"x": torch.ones(2)}, group="nope")
    assert str(e.value) == _GROUP + "str 'nope'"


def test_a_mode_that_is_not_one_of_the_three_is_refused_on_entering_the_block():
    block = xcoll.consistency_checks("sometimes")  # (made: nothing is checked yet)
    with pytest.raises(ValueError) as e:
        with block:
            pass
    assert str(e.value) == "mode must be one of ('guard', 'always', 'never'), got 'sometimes'"


# ---- by_index --------------------------------------------------------------------


@pytest.mark.parametrize(
    "index,shown",
    [
        (torch.tensor([0.0, 1.0]), "torch.float32 of shape (2,)"),
        (torch.tensor([True, False]), "torch.bool of shape (2,)"),
        (torch.tensor([[0, 1]]), "torch.int64 of shape (1, 2)"),
        (torch.tensor(0), "torch.int64 of shape ()"),
    ],
    ids=["float", "bool", "2-d", "0-d"],
)
def test_by_index_refuses_an_index_that_is_not_a_1d_integer_tensor(index, shown):
    with pytest.raises(TypeError) as e:
        xcoll.by_index({"x": torch.ones(2)}, index)
    assert str(e.value) == f"index must be a 1-d integer tensor, got {shown}"


def test_by_index_refuses_an_index_that_is_not_a_tensor():
    with pytest.raises(TypeError, match="^index must be a 1-d integer tensor"):
        xcoll.by_index({"x": torch.ones(2)}, [0, 1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="^index must be a 1-d integer tensor, got torch.complex64"):
        xcoll.by_index({"x": torch.ones(2)}, torch.zeros(2, dtype=torch.complex64))


def test_by_index_refuses_an_unsupported_leaf_naming_its_path():
    with pytest.raises(TypeError) as e:
        xcoll.by_index({"x": torch.ones(2), "s": [1, {1, 2}]}, torch.tensor([1, 0]))
    assert str(e.value) == (
        "tree['s'][1]: unsupported leaf of type set; xcoll communicates tensors and Python "
        "bool/int/float (None is structure)"
    )


@pytest.mark.parametrize(
    "index,length,message",
    [
        ([0, 2], 3, "index does not cover 0..2 exactly: missing [1], outside []"),
        ([0, 5, 1], 2, "index does not cover 0..1 exactly: missing [], outside [5]"),
        ([0, -1, 1], 2, "index does not cover 0..1 exactly: missing [], outside [-1]"),
        ([3, 2], 3, "index does not cover 0..2 exactly: missing [0, 1], outside [3]"),
    ],
    ids=["missing", "outside", "negative", "both"],
)
def test_by_index_names_what_is_missing_or_outside(index, length, message):
    idx = torch.tensor(index)
    with pytest.raises(ValueError) as e:
        xcoll.by_index({"x": torch.ones(len(index))}, idx, length=length)
    assert str(e.value) == message


@pytest.mark.parametrize(
    "leaf,dim,message",
    [
        (torch.ones(3), 0, "tree['m']['x']: has shape (3,), not 2 samples along dim 0"),
        (torch.ones(()), 0, "tree['m']['x']: has shape (), not 2 samples along dim 0"),
        (torch.ones(2, 3), 1, "tree['m']['x']: has shape (2, 3), not 2 samples along dim 1"),
    ],
    ids=["longer", "0-d", "dim 1"],
)
def test_by_index_names_a_leaf_without_one_sample_per_index(leaf, dim, message):
    with pytest.raises(ValueError) as e:
        xcoll.by_index({"m": {"x": leaf, "n": 7}}, torch.tensor([1, 0]), dim=dim)
    assert str(e.value) == message


# ---- a launched process without its world: the calls no other test made -----------


_WITHOUT_GROUP = (
    "this process was started as rank 1 of 2 (torchrun's environment: WORLD_SIZE=2), but "
    "torch.distributed is not initialised: call torch.distributed.init_process_group first "
    '("gloo"; "nccl" with CUDA leaves), or every xcoll call would run as a world of one and '
    "return this process's values alone (docs/launchers.md)"
)


def test_a_launched_process_without_a_process_group_raises_from_every_other_call(monkeypatch):
    # (gather, reduce, rank, world_size, gather_object, barrier and
    # sync_rng_state: tests/test_errors.py)
    from xcoll._backends import xla_runtime_running

    assert not dist.is_initialized() and not xla_runtime_running()
    for v in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    calls = {
        "broadcast": lambda: xcoll.broadcast({"x": torch.ones(1)}),
        "broadcast of scalars": lambda: xcoll.broadcast({"n": 1}),
        "reduce_scatter": lambda: xcoll.reduce_scatter({"x": torch.ones(2)}),
        "all_to_all": lambda: xcoll.all_to_all({"x": torch.ones(2)}),
        "sync": xcoll.sync,
        "broadcast_object": lambda: xcoll.broadcast_object(1),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError) as e:
            call()
        assert str(e.value) == _WITHOUT_GROUP, name


_DESTROYED = """
import json, os, torch, torch.distributed as dist, xcoll
store = "file://" + os.path.abspath(__file__) + ".store"
dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
group = dist.new_group([0])
CALL  # (used, then destroyed)
dist.destroy_process_group()
try:
    said = ["returned", repr(CALL)]
except Exception as e:
    said = [type(e).__name__, str(e)]
print(json.dumps(said))
"""

# Each public name whose docstring promises it, called with a group: as the
# script's text, and as the call itself.
_WITH_GROUP = {
    "rank": ("xcoll.rank(group)", lambda g: xcoll.rank(g)),
    "world_size": ("xcoll.world_size(group)", lambda g: xcoll.world_size(g)),
    "gather": ("xcoll.gather(torch.ones(1), group=group)", lambda g: xcoll.gather(torch.ones(1), group=g)),
    "sync": ("xcoll.sync(group)", lambda g: xcoll.sync(g)),
    "barrier": ("xcoll.barrier(group=group)", lambda g: xcoll.barrier(group=g)),
}


@pytest.mark.parametrize("group", ["NON_GROUP_MEMBER", "destroyed"])
@pytest.mark.parametrize("name", sorted(_WITH_GROUP))
def test_a_group_given_without_torch_distributed_raises_runtime_error(tmp_path, name, group):
    text, call = _WITH_GROUP[name]
    if group == "destroyed":  # (in a process of its own: the test process never initialises)
        import json

        from tests.helpers import run

        script = tmp_path / "script.py"
        script.write_text(_DESTROYED.replace("CALL", text))
        result = run(script, {"PYTHONPATH": str(ROOT)})
        assert result.returncode == 0, result.stderr[-3000:]
        said = json.loads(result.stdout.splitlines()[-1])
        assert said[0] == "RuntimeError" and said[1].startswith(_NOT_INITIALISED), said
        return
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError) as e:
        call(dist.GroupMember.NON_GROUP_MEMBER)
    assert str(e.value).startswith(_NOT_INITIALISED)


_NOT_INITIALISED = "group= is given, but torch.distributed is not initialised in this process"


# ---- on every replica -----------------------------------------------------------


def _ok(_=None):
    return xcoll.gather(xcoll.rank())


def _outcome(call) -> tuple[str, str]:
    try:
        return "returned", repr(call())
    except Exception as e:  # noqa: BLE001 - reported to the test
        return type(e).__name__, str(e)


def _src_out_of_range(src):
    x = {"x": torch.ones(2).to(device()), "n": 3}
    return [
        _outcome(lambda: xcoll.broadcast(x, src=src)),
        _outcome(lambda: xcoll.broadcast_object({"a": 1}, src=src)),
        _outcome(lambda: xcoll.sync_rng_state(src=src)),
    ]


@pytest.mark.parametrize("src", [2, -1, True, 1.0, "0"])
@pytest.mark.parametrize("world", WORLDS)
def test_a_src_that_is_not_a_rank_is_refused_on_every_replica(world, src):
    pool = shared_pool(world)
    w = pool.world_size
    want = ("ValueError", f"src={src!r} is not a replica rank: world size is {w}")
    for r, got in enumerate(pool.run(_src_out_of_range, [src] * w)):
        assert got == [want] * 3, (r, got)
    assert pool.run(_ok, [None] * w) == [list(range(w))] * w


def _src_or_generators_differ(_):
    r = xcoll.rank()
    xcoll.barrier()  # (a group's first call is checked in full: not these)
    out = [
        _outcome(lambda: xcoll.broadcast_object({"r": r}, src=r)),
        _outcome(lambda: xcoll.sync_rng_state(src=r)),
    ]
    with xcoll.consistency_checks("always"):  # (the states' sizes differ too)
        out.append(_outcome(lambda: xcoll.sync_rng_state(generators=[torch.Generator()] * r)))
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_object_and_rng_calls_whose_src_or_generators_differ_raise_on_every_replica(world):
    pool = shared_pool(world)
    for r, got in enumerate(pool.run(_src_or_generators_differ, [None, None])):
        o = 1 - r
        differ = "replicas made different calls; the first difference: this replica"
        assert got == [
            (
                "CollectiveMismatchError",
                f"xcoll.broadcast_object: {differ} (rank {r}) has parameters: src={r}; "
                f"rank {o} has parameters: src={o}",
            ),
            (
                "CollectiveMismatchError",
                f"xcoll.sync_rng_state: {differ} (rank {r}) has parameters: src={r} "
                f"generators=0; rank {o} has parameters: src={o} generators=0",
            ),
            (
                "CollectiveMismatchError",
                f"xcoll.sync_rng_state: {differ} (rank {r}) has parameters: src=0 "
                f"generators={r}; rank {o} has parameters: src=0 generators={o}",
            ),
        ], (r, got)
    assert pool.run(_ok, [None, None]) == [[0, 1]] * 2


def _in_flight_tags_differ(_):
    r = xcoll.rank()
    xcoll.barrier()  # (as above)
    got = xcoll.gather(torch.arange(3.0).to(device()), sync=False, tag=f"t{r}")
    del got
    return _outcome(xcoll.sync)


@pytest.mark.parametrize("world", WORLDS)
def test_a_call_in_flight_that_differs_is_named_by_sync_on_every_replica(world):
    # (a sync=False call on XLA joins the pending graph, whose guard the sync reads)
    pool = shared_pool(world)
    for r, got in enumerate(pool.run(_in_flight_tags_differ, [None, None])):
        assert got == (
            "CollectiveMismatchError",
            "xcoll.gather: replicas made different calls; the first difference: this replica "
            f"(rank {r}) has tag: tag='t{r}'; rank {1 - r} has tag: tag='t{1 - r}'",
        ), (r, got)
    assert pool.run(_ok, [None, None]) == [[0, 1]] * 2


def _a_mismatch_caught_in_a_step(_):
    r = xcoll.rank()
    xcoll.barrier()  # (as above)
    caught = []

    def block():
        with xcoll.step(0):
            try:
                xcoll.reduce(torch.ones(1).to(device()), tag=f"t{r}")
            except xcoll.CollectiveMismatchError as e:
                caught.append(str(e).split(";")[0])

    return _outcome(block), caught


@pytest.mark.parametrize("world", WORLDS)
def test_a_step_in_which_a_call_raised_a_mismatch_raises_it_again_at_its_end(world):
    pool = shared_pool(world)
    for r, (end, caught) in enumerate(pool.run(_a_mismatch_caught_in_a_step, [None, None])):
        assert caught == ["xcoll.reduce: replicas made different calls"], (r, caught)
        assert end == (
            "CollectiveMismatchError",
            "xcoll.step(0): a call inside this step raised CollectiveMismatchError (caught "
            "inside the step): the replicas' calls in it differ, and its results may be "
            "other calls'",
        ), (r, end)
    assert pool.run(_ok, [None, None]) == [[0, 1]] * 2


def _one_too_deep(_):
    deep = node = []
    for _ in range(300):
        node.append([])
        node = node[0]
    return _outcome(lambda: xcoll.gather_object({"a": deep} if xcoll.rank() == 0 else {"a": 1}))


@pytest.mark.parametrize("world", WORLDS)
def test_an_object_nested_too_deep_raises_on_its_replica_and_is_named_by_the_others(world):
    pool = shared_pool(world)
    mine, theirs = pool.run(_one_too_deep, [None, None])
    assert mine == ("ValueError", "obj['a'][0][0][0]...[0][0]: nested more than 200 levels deep")
    assert theirs == (
        "ValueError",
        "gather_object: replica(s) [0] could not encode their object (see their error)",
    )
    assert pool.run(_ok, [None, None]) == [[0, 1]] * 2


# ---- xcoll.testing ---------------------------------------------------------------


@pytest.mark.parametrize("size", [0, -1])
@pytest.mark.parametrize("kind", ["XlaPool", "GlooPool"])
def test_a_pool_of_fewer_than_one_replica_is_refused(kind, size):
    # (before any worker starts)
    with pytest.raises(ValueError) as e:
        getattr(xcoll.testing, kind)(size)
    assert str(e.value) == f"world_size must be >= 1, got {size}"


def test_xla_counters_without_torch_xla_raises_import_error(monkeypatch):
    # (None in sys.modules: what an import finds where torch_xla is not installed)
    for name in [m for m in sys.modules if m == "torch_xla" or m.startswith("torch_xla.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torch_xla", None)
    with pytest.raises(ImportError, match="torch_xla"):
        xcoll.testing.xla_counters()


def test_a_local_pool_refuses_per_rank_args_of_another_length():
    with pytest.raises(ValueError, match="entries for 1 replicas"):
        xcoll.testing.LocalPool().run(abs, [1, 2])
