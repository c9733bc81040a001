"""Arguments of the wrong kind are refused before any communication, naming
the argument and what it accepts (not an error from deep inside torch or
optree, and never a truthy value read as True); and a structure difference
between replicas names the leaves each lacks."""

from __future__ import annotations

import random
import re

import pytest
import torch
import torch.distributed as dist

import xcoll
from tests.replicas import device, shared_pool
from xcoll._guard import check as _check

GROUP = "group must be a torch.distributed ProcessGroup (as dist.new_group returns) or None, got "

ONE = torch.ones(2)


# (dist.group: the namespace of dist.group.WORLD, which torch.distributed's
# own functions would take apart attribute by attribute; written out, not
# formatted as the refusal formats it)
_NAMESPACE = "_WorldMeta <class 'torch.distributed.distributed_c10d.group'>"


@pytest.mark.parametrize(
    "group,shown",
    [("nope", "str 'nope'"), (3, "int 3"), (1.0, "float 1.0"), (dist.group, _NAMESPACE)],
    ids=["str", "int", "float", "dist.group"],
)
@pytest.mark.parametrize(
    "call",
    [
        lambda g: xcoll.gather(ONE, group=g),
        lambda g: xcoll.gather(ONE, group=g, uneven=True),
        lambda g: xcoll.reduce(ONE, group=g),
        lambda g: xcoll.broadcast(ONE, group=g),
        lambda g: xcoll.gather(3, group=g),  # no tensor leaves: the group's backend
        lambda g: xcoll.rank(g),
        lambda g: xcoll.world_size(g),
        lambda g: xcoll.gather_object(1, group=g),
        lambda g: xcoll.broadcast_object(1, group=g),
        lambda g: xcoll.barrier("t", group=g),
        lambda g: xcoll.sync_rng_state(group=g),
    ],
    ids=[
        "gather",
        "uneven",
        "reduce",
        "broadcast",
        "scalars",
        "rank",
        "world_size",
        "gather_object",
        "broadcast_object",
        "barrier",
        "sync_rng_state",
    ],
)
def test_a_group_that_is_not_a_process_group_is_refused(call, group, shown):
    # (before: a RuntimeError saying torch.distributed is not initialised here,
    # and where it is, AttributeError: 'str' object has no attribute 'size')
    with pytest.raises(TypeError, match="^" + re.escape(GROUP + shown) + "$"):
        call(group)


def _bad_group(_):
    return xcoll.gather(torch.ones(1), group="nope")


def _ok(_):
    return xcoll.gather(xcoll.rank())


def test_a_group_that_is_not_a_process_group_is_refused_with_torch_distributed_initialised():
    pool = shared_pool("gloo-2")
    failures = pool.run(_bad_group, [None, None], return_exceptions=True)
    assert [f.type_name for f in failures] == ["builtins.TypeError"] * 2, failures
    assert all(f.message == GROUP + "str 'nope'" for f in failures), failures
    assert pool.run(_ok, [None, None]) == [[0, 1]] * 2


FLAGS = [(xcoll.gather, flag) for flag in ("stack", "sync", "to_cpu", "uneven", "grad")] + [
    (fn, flag) for fn in (xcoll.reduce, xcoll.broadcast) for flag in ("sync", "to_cpu", "grad")
]


@pytest.mark.parametrize("value", [1, 0, "no", "yes", None, torch.tensor(True)])
@pytest.mark.parametrize("fn,flag", FLAGS, ids=[f"{fn.__name__}-{flag}" for fn, flag in FLAGS])
def test_a_flag_that_is_not_a_bool_is_refused(fn, flag, value):
    # (before: read as its truthiness, sync="no" as sync=True)
    want = f"{flag} must be a bool (True or False), got {value!r}"
    with pytest.raises(TypeError, match="^" + re.escape(want) + "$"):
        fn({"x": torch.ones(2, requires_grad=True)}, **{flag: value})


@pytest.mark.parametrize(
    "generators,want",
    [
        ("x", "generators must be a list or tuple of torch.Generator, got str 'x'"),
        (torch.Generator(), "generators must be a list or tuple of torch.Generator, got Generator"),
        (5, "generators must be a list or tuple of torch.Generator, got int 5"),
        ([torch.Generator(), "x"], "generators[1] must be a torch.Generator, got str 'x'"),
    ],
    ids=["str", "one generator", "int", "an item"],
)
@pytest.mark.parametrize("fn", [xcoll.sync_rng_state, xcoll.rng_state, "set_rng_state"])
def test_generators_that_are_not_a_sequence_of_generators_are_refused(fn, generators, want):
    # (before: AttributeError: 'str' object has no attribute 'get_state', or
    # TypeError: object of type 'torch._C.Generator' has no len())
    with pytest.raises(TypeError, match="^" + re.escape(want)):
        if fn == "set_rng_state":
            xcoll.set_rng_state(xcoll.rng_state(), generators)
        else:
            fn(generators=generators)


_MADE = "state must be what xcoll.rng_state() returns"


@pytest.mark.parametrize(
    "state,error,want",
    [
        ({"x": 1}, ValueError, f"{_MADE}: it lacks the keys ['torch', 'python', 'generators'] (it has ['x'])"),
        ("x", TypeError, f"{_MADE} (a dict), got str 'x'"),
        (
            "python",
            ValueError,
            f"{_MADE}: state['python'] is not a dict with keys ['version', 'internal', 'has_gauss', 'gauss']",
        ),
        ("not a list", ValueError, f"{_MADE}: state['generators'] is not a list"),
        ("generators", ValueError, "the state holds 0 generators, 1 were passed"),
    ],
)
def test_a_state_that_rng_state_did_not_make_is_refused_before_any_generator_is_set(
    state, error, want
):
    # (before: KeyError: 'torch'; and with too many generators, torch's and
    # Python's generators were set before the ValueError)
    generators = []
    torch.manual_seed(0)  # (the state a tree holds here)
    random.seed(0)
    if state == "python":
        state = {**xcoll.rng_state(), "python": {}}
    elif state == "not a list":
        state = {**xcoll.rng_state(), "generators": 5}
    elif state == "generators":
        state, generators = xcoll.rng_state(), [torch.Generator()]
    torch.manual_seed(1)  # (another one)
    random.seed(1)
    before = torch.get_rng_state(), random.getstate()
    with pytest.raises(error, match="^" + re.escape(want) + "$"):
        xcoll.set_rng_state(state, generators)
    assert torch.equal(torch.get_rng_state(), before[0])
    assert random.getstate() == before[1]


@pytest.mark.parametrize("length", [-1, True, False, 2.0, "3", torch.tensor(True)])
def test_by_index_refuses_a_length_that_is_not_a_non_negative_int(length):
    # (before: torch's arange error, or True read as 1)
    index = torch.tensor([0, 1, 2])
    want = f"length must be None or a non-negative int, got {length!r}"
    with pytest.raises(ValueError, match="^" + re.escape(want) + "$"):
        xcoll.by_index({"x": index}, index, length=length)


def test_by_index_takes_a_length_that_is_an_index():
    import numpy as np

    index = torch.tensor([1, 0])
    for length in (2, np.int64(2), torch.tensor(2)):
        assert xcoll.by_index({"x": index}, index, length=length)["x"].tolist() == [0, 1]


TREE = {"a": torch.ones(1), "b": [torch.ones(1), {"c": 1.0}]}


@pytest.mark.parametrize(
    "op,want",
    [
        (
            None,
            'op must be one of "sum" "mean" "max" "min" "prod", or a prefix tree of them '
            '(e.g. {"loss": "mean", "n": "sum"}), got None',
        ),
        ({"a": None, "b": "sum"}, "op['a'] is None, where the data tree has a leaf at tree['a']"),
        ([], "op is a list of 0, where the data tree has a dict with keys ['a', 'b'] at tree"),
        (
            {"a": "sum", "b": ["max", ["min"]]},
            "op['b'][1] is a list of 1, where the data tree has a dict with keys ['c'] at "
            "tree['b'][1]",
        ),
        (
            {"a": "sum", "b": ("max", "min")},
            "op['b'] is a tuple of 2, where the data tree has a list of 2 at tree['b']",
        ),
    ],
    ids=["None", "None inside", "list for dict", "list for dict below", "tuple for list"],
)
def test_an_op_that_is_not_an_op_or_a_prefix_tree_of_them_names_where(op, want):
    # (before: "Expected None, got {'a': 0}": optree's words about a tree of
    # leaf indices, which the user never made)
    with pytest.raises(ValueError, match=re.escape(want)):
        xcoll.reduce(TREE, op)


# The descriptions' leaves differ: the message names which paths each side lacks.


def _lacking(case):
    r, w = xcoll.rank(), xcoll.world_size()
    t = torch.ones(2, 3).to(device())
    tree = {"acc": t, "loss": t}
    if r == w - 1:
        del tree["acc"]
        if case == "replaced":  # the same sizes: found by the guard of a later call
            tree["top1"] = t
    xcoll.reduce({"x": t})  # (so that the next call is not the group's first)
    mode = "always" if case == "missing" else "guard"
    with xcoll.consistency_checks(mode):
        xcoll.reduce(tree)
    return "no error"


def _expected(case, r, w):
    """What rank ``r``'s message starts with: the last rank lacks tree['acc']
    (and, replaced, the others lack tree['top1'])."""
    last = r == w - 1
    me, other = f"this replica (rank {r})", f"rank {0 if last else w - 1}"
    lacks = [f"{me if last else other} lacks tree['acc']"]
    if case == "replaced":
        lacks.append(f"{other if last else me} lacks tree['top1']")
    lacks.sort(key=lambda side: not side.startswith("this replica"))  # its own side first
    return (
        "xcoll.reduce: replicas made different calls; their leaves differ: "
        + "; ".join(lacks)
        + ". The first difference: "
    )


@pytest.mark.parametrize("case", ["missing", "replaced"])
@pytest.mark.parametrize("world", ["gloo-2", "gloo-4", "xla-cpu-2", "xla-cpu-4"])
def test_replicas_whose_leaves_differ_are_told_which_each_lacks(world, case):
    # (before: "this replica (rank 0) has tree['acc'] ...; rank 1 has
    # tree['loss'] ...", as if a leaf had been renamed)
    pool = shared_pool(world)
    w = pool.world_size
    failures = pool.run(_lacking, [case] * w, return_exceptions=True)
    assert [f.type_name for f in failures] == ["xcoll.CollectiveMismatchError"] * w, failures
    for r, f in enumerate(failures):
        assert f.message.startswith(_expected(case, r, w)), (r, f.message)
    assert pool.run(_ok, [None] * w) == [list(range(w))] * w


def _description(paths: list[str]) -> list[str]:
    return [
        "call xcoll.gather",
        "tag: (none)",
        "parameters: dim=0",
        *[f"{p}: float32 tensor of shape (2)" for p in paths],
        "structure: PyTreeSpec(...)",
    ]


def test_the_paths_a_side_lacks_are_listed_up_to_three_then_counted():
    mine = _description([f"tree['k{i}']" for i in range(6)] + ["tree['z: 1']"])
    theirs = _description(["tree['k0']", "tree['y']"])
    assert _check._lacks(mine, theirs, "rank 0", "rank 1") == (
        "their leaves differ: this replica (rank 0) lacks tree['y']; "
        "rank 1 lacks tree['k1'], tree['k2'], tree['k3'] and 3 more"
    )
    # the same leaves, or calls that differ before their leaves: nothing to add
    assert _check._lacks(mine, list(mine), "rank 0", "rank 1") == ""
    other_call = ["call xcoll.reduce", *theirs[1:]]
    assert _check._lacks(mine, other_call, "rank 0", "rank 1") == ""


def _shards(n: int):
    """A gather of shards whose length differs on the last rank (an epoch's
    last batch), without uneven=True: the error, then the same with it."""
    rank, w = xcoll.rank(), xcoll.world_size()
    x = torch.ones(n + (rank == w - 1), 3).to(device())
    try:
        xcoll.gather({"x": x})
        text = "returned"
    except xcoll.CollectiveMismatchError as e:
        text = str(e)
    return text, tuple(xcoll.gather({"x": x}, uneven=True)["x"].shape)


@pytest.mark.parametrize("world", ["gloo-2", "xla-cpu-2"])
def test_a_gather_of_shards_of_different_sizes_names_uneven_as_the_fix(world):
    pool = shared_pool(world)
    w = pool.world_size
    for text, shape in pool.run(_shards, [2] * w):
        assert text.startswith("xcoll.gather: replicas made different calls; the first difference:"), text
        assert text.endswith("(a leaf whose size along dim differs between replicas: gather it with uneven=True)"), text
        assert shape == (2 * w + 1, 3)


def test_the_fix_is_named_for_a_gathers_sizes_along_its_dim_only():
    def fix(call: str, params: str, mine: str, theirs: str) -> str:
        lines = [f"call {call}", "tag: (none)", f"parameters: {params}"]
        return _check._fix(lines, f"tree['x']: {mine}", f"tree['x']: {theirs}")

    plain = "dim=0 stack=False uneven=False max_size=None to_cpu=False sync=True"
    a, b = "float32 tensor of shape (2, 3)", "float32 tensor of shape (3, 3)"
    assert fix("xcoll.gather", plain, a, b).endswith("gather it with uneven=True)")
    assert fix("xcoll.gather", plain.replace("dim=0", "dim=1"), a, "float32 tensor of shape (2, 5)")
    assert fix("xcoll.gather", plain.replace("dim=0", "dim=-1"), a, "float32 tensor of shape (2, 5)")
    # not the fix: another dim differs, the call is uneven already or stacks,
    # a reduce (whose sizes must agree), another dtype, rank or leaf
    assert fix("xcoll.gather", plain, a, "float32 tensor of shape (2, 4)") == ""
    assert fix("xcoll.gather", plain.replace("dim=0", "dim=1"), a, b) == ""
    assert fix("xcoll.gather", plain.replace("uneven=False", "uneven=True"), a, b) == ""
    assert fix("xcoll.gather", plain.replace("stack=False", "stack=True"), a, b) == ""
    assert fix("xcoll.reduce", plain, a, b) == ""
    assert fix("xcoll.gather", plain, a, "float64 tensor of shape (3, 3)") == ""
    assert fix("xcoll.gather", plain, a, "float32 tensor of shape (3)") == ""
    assert fix("xcoll.gather", plain, "float32 tensor of shape ()", "float32 tensor of shape (3)") == ""
    assert _check._fix(
        ["call xcoll.gather", "tag: (none)", f"parameters: {plain}"], f"tree['x']: {a}", f"tree['y']: {b}"
    ) == ""


GRAD_TO_CPU = {
    "gather": lambda t: xcoll.gather(t, grad=True, to_cpu=True),
    "gather stack": lambda t: xcoll.gather(t, stack=True, grad=True, to_cpu=True),
    "gather uneven": lambda t: xcoll.gather(t, uneven=True, grad=True, to_cpu=True),
    "gather uneven max_size": lambda t: xcoll.gather(
        t, uneven=True, max_size=4, grad=True, to_cpu=True
    ),
    "reduce": lambda t: xcoll.reduce(t, grad=True, to_cpu=True),
    "broadcast": lambda t: xcoll.broadcast(t, grad=True, to_cpu=True),
    "reduce_scatter": lambda t: xcoll.reduce_scatter(t, grad=True, to_cpu=True),
    "all_to_all": lambda t: xcoll.all_to_all(t, grad=True, to_cpu=True),
}
GRAD_NEEDS_DEVICE = "grad=True needs to_cpu=False: gradients flow back to the leaves' device"


@pytest.mark.parametrize("call", sorted(GRAD_TO_CPU))
def test_grad_refuses_to_cpu_for_every_op(call):
    # (before: an uneven gather skipped the check every other op made, and
    # returned host tensors that no gradient could flow back from)
    x = {"x": torch.ones(4, requires_grad=True)}
    with pytest.raises(ValueError, match="^" + re.escape(GRAD_NEEDS_DEVICE) + "$"):
        GRAD_TO_CPU[call](x)


def _grad_to_cpu(call):
    # (an uneven gather's shards differ between replicas, as its users' do)
    n = 2 + xcoll.rank() if "uneven" in call else 4
    return GRAD_TO_CPU[call]({"x": torch.ones(n, requires_grad=True)})


@pytest.mark.parametrize("call", sorted(GRAD_TO_CPU))
def test_grad_refuses_to_cpu_on_every_replica_for_every_op(call):
    pool = shared_pool("gloo-2")
    failures = pool.run(_grad_to_cpu, [call, call], return_exceptions=True)
    assert [f.type_name for f in failures] == ["builtins.ValueError"] * 2, failures
    assert all(f.message == GRAD_NEEDS_DEVICE for f in failures), failures
    assert pool.run(_ok, [None, None]) == [[0, 1]] * 2
