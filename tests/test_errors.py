"""Bad input is refused before any communication, with the leaf's path."""

from __future__ import annotations

import enum
import re
from collections import namedtuple

import pytest
import torch

import xcoll
from tests.helpers import needs_xla
from tests.replicas import device, shared_pool, to_cpu, to_device

Point = namedtuple("Point", ["x", "y"])


@pytest.mark.parametrize(
    "tree,path,kind",
    [
        ({"preds": [torch.ones(1), torch.ones(1), "oops"]}, "tree['preds'][2]", "str"),
        ([1, object()], "tree[1]", "object"),
        (Point(1.0, {"a": {1, 2}}), "tree.y['a']", "set"),
        ({"z": torch.ones(2, dtype=torch.complex64)}, "tree['z']", "complex64"),
        ({"s": torch.ones(2).to_sparse()}, "tree['s']", "sparse"),
    ],
)
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("fn", [xcoll.gather, xcoll.reduce, xcoll.broadcast])
def test_unsupported_leaf_names_its_path(fn, tree, path, kind, grad):
    # (grad=True: the same error, before any autograd function is made)
    with pytest.raises(TypeError, match=re.escape(path)) as e:
        fn(tree, grad=grad)
    assert kind in str(e.value) or "strided" in str(e.value)


def test_python_int_out_of_int64():
    with pytest.raises(ValueError, match=re.escape("tree['big']")):
        xcoll.gather({"big": 2**63})


@pytest.mark.parametrize(
    "tree,op,path,err",
    [
        ({"n": torch.tensor([1, 2])}, "mean", "tree['n']", TypeError),
        ({"n": 3}, "mean", "tree['n']", TypeError),
        ({"b": torch.tensor([True])}, "sum", "tree['b']", TypeError),
        ({"b": True}, "mean", "tree['b']", TypeError),
        ({"x": torch.ones(1)}, "avg", "tree['x']", ValueError),
        (
            {"x": torch.ones(1), "y": [torch.ones(1)]},
            {"x": "sum", "y": ["median"]},
            "tree['y'][0]",
            ValueError,
        ),
    ],
)
def test_reduce_refuses_ops(tree, op, path, err):
    with pytest.raises(err, match=re.escape(path)):
        xcoll.reduce(tree, op)


def test_reduce_op_tree_must_be_a_prefix():
    want = (
        "op must be a str or a prefix tree of the data tree: op is a dict with keys ['a'], "
        "where the data tree has a dict with keys ['a', 'b'] at tree"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(want)}$"):
        xcoll.reduce({"a": torch.ones(1), "b": torch.ones(1)}, {"a": "sum"})


@pytest.mark.parametrize("src", [-1, 1, 1.0, True, "0"])
def test_broadcast_src_out_of_range(src):
    want = f"src={src!r} is not a replica rank: world size is 1"
    with pytest.raises(ValueError, match=f"^{re.escape(want)}$"):
        xcoll.broadcast({"x": torch.ones(1)}, src=src)


class _Rank(enum.IntEnum):
    FIRST = 0
    SECOND = 1


def _broadcast_from(src):
    try:
        return xcoll.broadcast({"x": torch.full((2,), float(xcoll.rank()))}, src=src)["x"].tolist()
    except ValueError as e:
        return str(e)


def test_a_bool_src_is_refused_and_an_int_enum_taken_where_both_are_ranks():
    # (True == 1 is a rank of two replicas; an IntEnum is an int)
    pool = shared_pool("gloo-2")
    refused = "src=True is not a replica rank: world size is 2"
    assert pool.run(_broadcast_from, [True, True]) == [refused, refused]
    assert pool.run(_broadcast_from, [_Rank.SECOND, _Rank.SECOND]) == [[1.0, 1.0]] * 2


@pytest.mark.parametrize("name", ["gather", "reduce_scatter", "all_to_all"])
@pytest.mark.parametrize("dim", [True, 1.0, "1", None])
def test_a_dim_that_is_not_an_int_is_refused_after_dim_1s_call(name, dim):
    # (checked on every call: True == 1 would find dim=1's cached plan)
    tree = {"x": torch.ones(2, 2)}
    getattr(xcoll, name)(tree, dim=1)
    with pytest.raises(TypeError, match=f"^{re.escape(f'dim must be an int, got {dim!r}')}$"):
        getattr(xcoll, name)(tree, dim=dim)


@pytest.mark.parametrize("dim,stack", [(2, False), (-3, False), (3, True)])
def test_gather_dim_out_of_range(dim, stack):
    with pytest.raises(ValueError, match=re.escape("tree['m']")):
        xcoll.gather({"m": torch.ones(2, 2), "s": torch.ones(())}, dim=dim, stack=stack)


def _cut(args):
    name, tree, dim = args
    return getattr(xcoll, name)(tree, dim=dim)


#: Leaves that a reduce-scatter or an all-to-all cannot cut into W=2 parts,
#: and the whole message each raises ({name}: the collective's).
_UNCUT = [
    (
        {"x": torch.ones(4), "n": 3},
        0,
        "TypeError",
        "tree['n']: a Python scalar has no dim to cut into the replicas' parts; {name} "
        "takes tensor leaves (reduce or gather scalars with xcoll.reduce, xcoll.gather)",
    ),
    (
        {"x": torch.ones(4), "z": torch.ones(())},
        0,
        "ValueError",
        "tree['z']: a 0-d tensor has no dim to cut into the 2 replicas' parts; {name} "
        "takes tensors of at least one dim",
    ),
    ({"x": torch.ones(4, 2)}, 2, "ValueError", "tree['x']: dim=2 is out of range for a leaf of shape (4, 2)"),
    ({"x": torch.ones(4, 2)}, -3, "ValueError", "tree['x']: dim=-3 is out of range for a leaf of shape (4, 2)"),
    (
        {"a": torch.ones(2, 4), "x": torch.ones(4, 3)},
        -1,
        "ValueError",
        "tree['x']: dim 1 of shape (4, 3) has 3 elements, which the 2 replicas cannot share equally",
    ),
]


@pytest.mark.parametrize("name", ["reduce_scatter", "all_to_all"])
@pytest.mark.parametrize("tree,dim,kind,message", _UNCUT)
def test_leaves_that_cannot_be_cut_into_the_replicas_parts_are_named(name, tree, dim, kind, message):
    pool = shared_pool("gloo-2")
    failures = pool.run(_cut, [(name, tree, dim)] * 2, return_exceptions=True)
    want = message.format(name=f"xcoll.{name}")
    assert [(f.type_name, f.message) for f in failures] == [(f"builtins.{kind}", want)] * 2
    # (a dim of -n is the first: allowed, as in torch)
    out = pool.run(_cut, [(name, {"x": torch.arange(8.0).reshape(4, 2) + 10 * r}, -2) for r in range(2)])
    halves = [torch.arange(8.0).reshape(4, 2)[2 * r : 2 * r + 2] for r in range(2)]
    for r, got in enumerate(out):
        expected = halves[r] * 2 + 10 if name == "reduce_scatter" else torch.cat([halves[r], halves[r] + 10])
        assert torch.equal(got["x"], expected), (name, r, got)


@pytest.mark.parametrize("name", ["gather", "reduce_scatter", "all_to_all"])
@pytest.mark.parametrize("dim", [True, 1.0, "0", None])
def test_a_dim_that_is_not_an_int_is_refused(name, dim):
    with pytest.raises(TypeError) as e:
        getattr(xcoll, name)({"x": torch.ones(2, 2)}, dim=dim)
    assert str(e.value) == f"dim must be an int, got {dim!r}"


def test_scalars_need_sync():
    with pytest.raises(ValueError, match=re.escape("tree['step']")):
        xcoll.reduce({"x": torch.ones(1), "step": 3}, sync=False)
    with pytest.raises(ValueError, match="to_cpu"):
        xcoll.gather({"x": torch.ones(1)}, sync=False, to_cpu=True)


def _mixed_devices(grad):
    xcoll.gather({"a": torch.ones(1, requires_grad=grad), "b": torch.ones(1).to(device())}, grad=grad)


@pytest.mark.parametrize("grad", [False, True])
def test_mixed_devices_name_both_paths(grad):
    failure = shared_pool("xla-cpu-1").run(_mixed_devices, [grad], return_exceptions=True)[0]
    assert failure.type_name == "builtins.TypeError"
    assert re.search(re.escape("tree['a']") + ".*" + re.escape("tree['b']"), failure.message)


def _bad_leaf(kind):
    dev = device()
    if kind == "cpu-leaf":
        return xcoll.gather({"x": torch.ones(2)})  # a CPU tensor inside an XLA replica
    return xcoll.reduce({"x": torch.ones(2, device=dev), "y": [None, "nope"]})


@pytest.mark.parametrize("kind,path", [("str-leaf", "tree['y'][1]"), ("cpu-leaf", "tree['x']")])
def test_errors_on_every_replica_and_the_pool_goes_on(pool, kind, path):
    failures = pool.run(_bad_leaf, [kind] * pool.world_size, return_exceptions=True)
    if kind == "cpu-leaf" and pool.device_type == "cpu":  # the right device there
        assert all(torch.equal(out["x"], torch.ones(2 * pool.world_size)) for out in failures)
        return
    assert [f.type_name for f in failures] == ["builtins.TypeError"] * pool.world_size
    assert all(path in f.message for f in failures)
    assert pool.run(_ok) == list(range(pool.world_size))


def _ok():
    return xcoll.gather(xcoll.rank())[xcoll.rank()]


def _bad_leaf_on_a_sub_group(_):
    """Rank 0's tree has a leaf that is not a tensor, in a gather on its
    sub-group (its own at W = 2, the pair {0, 1} at W = 4); every other
    replica's is good. Returns the outcome, then a gather on the world."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    size = 1 if world == 2 else 2
    groups = [dist.new_group(list(range(s, s + size))) for s in range(0, world, size)]
    group = groups[rank // size]
    tree = {"x": torch.tensor([float(rank)]), "y": "nope" if rank == 0 else 1}
    try:
        got = ("ok", xcoll.gather(tree, group=group)["x"].tolist())
    except (TypeError, xcoll.CollectiveMismatchError) as e:
        got = (type(e).__name__, str(e))
    dist.destroy_process_group(group)
    return got, xcoll.gather(torch.tensor([rank])).tolist()


@pytest.mark.parametrize("world", ["gloo-2", "gloo-4"])
def test_an_error_on_a_sub_group_is_shared_on_that_group_alone(world):
    pool = shared_pool(world)
    w = pool.world_size
    results = pool.run(_bad_leaf_on_a_sub_group, [None] * w)
    (kind, text), _ = results[0]
    assert kind == "TypeError" and "tree['y']" in text, text
    for rank, ((kind, got), after) in enumerate(results):
        assert after == list(range(w)), (rank, after)  # (the world's next call)
        if rank == 1 and w == 4:  # rank 0's partner: told of its error
            assert kind == "CollectiveMismatchError", (rank, kind, got)
            assert "rank 0 of the group (global rank 0) raised before communicating (TypeError: tree['y']" in got, got
        elif rank:
            pair = [float(r) for r in range(rank - rank % (w // 2), rank - rank % (w // 2) + w // 2)]
            assert (kind, got) == ("ok", pair if w == 4 else [float(rank)]), (rank, kind, got)


class _Factory:
    """A defaultdict factory that cannot be hashed (it defines __eq__ only), so
    neither can the tree's treespec: such a tree is checked and planned on every
    call instead of cached."""

    def __call__(self):
        return 0

    def __eq__(self, other):
        return isinstance(other, _Factory)

    __hash__ = None


def _unhashable(_):
    from collections import defaultdict

    r, w = xcoll.rank(), xcoll.world_size()
    out = []
    for _ in range(2):  # (the second call would hit the caches)
        tree = defaultdict(_Factory(), {"a": torch.tensor([1.0 + r, -0.0]).to(device()), "n": r})
        g = xcoll.gather(tree, to_cpu=True)
        m = xcoll.reduce(tree, "max")
        b = xcoll.broadcast(tree, src=w - 1)
        out.append((type(g), g["a"], g["n"], to_cpu(m["a"]), m["n"], to_cpu(b["a"]), b["n"]))
    return out


def test_tree_with_an_unhashable_treespec(pool):
    w = pool.world_size
    gathered = torch.tensor([v for r in range(w) for v in (1.0 + r, -0.0)])
    last = torch.tensor([float(w), -0.0])
    for calls in pool.run(_unhashable, [None] * w):  # every replica
        for kind, g, n, m, m_n, b, b_n in calls:
            assert kind.__name__ == "defaultdict"
            assert torch.equal(g, gathered) and torch.equal(g.signbit(), gathered.signbit())
            assert n == list(range(w))
            assert torch.equal(m, last) and bool(m[1].signbit())
            assert m_n == w - 1
            assert torch.equal(b, last) and bool(b[1].signbit())
            assert b_n == w - 1
    with pytest.raises(ValueError, match=r"tree\['n'\]: Python int"):
        from collections import defaultdict

        xcoll.gather(defaultdict(_Factory(), {"n": 2**63}))


def _bad_then_caught(_):
    import weakref

    x = torch.ones(2, device=device())
    alive, tree = weakref.ref(x), {"x": x, "y": [None, "nope"]}
    del x
    caught = False
    try:
        xcoll.reduce(tree)
    except TypeError:
        caught = True
    del tree  # (after the except block: the error and its frames are gone)
    if not caught:
        return "returned"
    return "raised, tensor freed" if alive() is None else "raised, tensor kept alive"


def _collector(on: bool) -> None:
    import gc

    gc.enable() if on else gc.disable()


def test_a_failed_calls_tensors_do_not_join_the_next_graph():
    # The failed call's frame once held its error (a cycle), keeping the
    # pending torch.ones alive on some replicas until a garbage collection: it
    # joined their next graph, the programs differed and XLA aborted (within
    # 40 rounds at W=4)
    pool = shared_pool("xla-cpu-4")
    # The collector is off for all 40 rounds, set apart from them: it is one
    # per process, and the 4 replicas are threads of one (a replica that turned
    # it back on would let a collection free the others' kept tensors)
    pool.run(_collector, [False] * 4)
    try:
        for _ in range(40):
            assert pool.run(_bad_then_caught, [None] * 4) == ["raised, tensor freed"] * 4
            assert pool.run(_ok) == list(range(4))
    finally:
        pool.run(_collector, [True] * 4)


# ---- a launched process without its world ---------------------------------------

_LAUNCHED = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_WITHOUT_GROUP = (
    "this process was started as {}, but torch.distributed is not initialised: call "
    'torch.distributed.init_process_group first ("gloo"; "nccl" with CUDA leaves), or every '
    "xcoll call would run as a world of one and return this process's values alone "
    "(docs/launchers.md)"
)


def _world_of_one_calls():
    return {
        "gather": lambda: xcoll.gather({"x": torch.ones(1)}),
        "reduce of scalars": lambda: xcoll.reduce({"n": 1}),
        "rank": xcoll.rank,
        "world_size": xcoll.world_size,
        "gather_object": lambda: xcoll.gather_object(1),
        "barrier": lambda: xcoll.barrier("t"),
        "sync_rng_state": xcoll.sync_rng_state,
    }


@pytest.mark.parametrize(
    "variable,rank,named",
    [
        ("WORLD_SIZE", "RANK", "rank 1 of 2 (torchrun's environment: WORLD_SIZE=2)"),
        ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "rank 1 of 2 (Open MPI's environment (mpirun): OMPI_COMM_WORLD_SIZE=2)"),
        ("PMI_SIZE", "PMI_RANK", "rank 1 of 2 (MPICH's or Intel MPI's environment (mpirun): PMI_SIZE=2)"),
        ("WORLD_SIZE", "", "rank ? of 2 (torchrun's environment: WORLD_SIZE=2)"),  # (no rank said)
    ],
)
def test_a_launched_process_without_a_process_group_raises(monkeypatch, variable, rank, named):
    # (torchrun itself: tests/test_launchers.py) Each process would otherwise
    # be a world of one and return its own values alone.
    import torch.distributed as dist

    from xcoll._backends import xla_runtime_running

    assert not dist.is_initialized() and not xla_runtime_running()
    for v in _LAUNCHED:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv(variable, "2")
    for v in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(v, raising=False)
    if rank:
        monkeypatch.setenv(rank, "1")
    for name, call in _world_of_one_calls().items():
        with pytest.raises(RuntimeError) as e:
            call()
        assert str(e.value) == _WITHOUT_GROUP.format(named), (name, e.value)
    # a bad tree: its own error first (the next good call names the missing group)
    with pytest.raises(TypeError, match=re.escape("tree['bad']: unsupported leaf of type str")):
        xcoll.gather({"x": torch.ones(1), "bad": "nope"})
    monkeypatch.setenv(variable, "1")  # what the environment says, a world of one
    assert xcoll.gather({"x": torch.ones(1)})["x"].tolist() == [1.0]
    assert xcoll.world_size() == 1


_XLA_IN_A_TORCHRUN_JOB = """
import json, os
import xcoll  # (first: its import makes XLA:CPU's synchronous client the default)
client = os.environ.get("PJRT_CPU_ASYNC_CLIENT")
import torch, torch_xla
said = []
for device in (torch_xla.device(), "cpu"):
    try:
        said.append(xcoll.gather({"x": torch.ones(1, device=device)})["x"].tolist())
    except (RuntimeError, TypeError) as e:
        said.append(f"{type(e).__name__}: {e}")
print(json.dumps([client, said]))
"""

_STARTED_AS = (
    "This process was started as rank ? of 2 (torchrun's environment), but XLA's runtime runs "
    "it as a world of one: something started the XLA runtime instead of torch.distributed "
    "(accelerate does when torch_xla is installed: set USE_TORCH_XLA=0)"
)


def _python(tmp_path, code: str, env: dict[str, str]):
    """``code`` run as a script of its own, importing this checkout's xcoll."""
    import json

    from tests.helpers import ROOT, run

    script = tmp_path / "script.py"
    script.write_text(code)
    result = run(script, {"PYTHONPATH": str(ROOT), **env})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


@needs_xla
@pytest.mark.parametrize("launched", [False, True], ids=["alone", "one of several"])
def test_an_xla_process_names_what_its_launch_says(tmp_path, launched):
    # (what accelerate's XLA path under torchrun does: tests/test_launchers.py)
    env = {"PJRT_DEVICE": "CPU", **({"WORLD_SIZE": "2"} if launched else {})}
    client, said = _python(tmp_path, _XLA_IN_A_TORCHRUN_JOB, env)
    assert client == "false"  # (unset before: xcoll's default, XLA:CPU's synchronous client)
    if not launched:  # a world of one, and CPU leaves that belong on its device
        assert said == [
            [1.0],
            "TypeError: tree['x'] is on cpu, but this process runs XLA replicas; move the "
            "leaves to the replica's XLA device (torch_xla.device())",
        ]
        return
    assert said == [
        f"RuntimeError: xcoll: XLA runs this process as a world of one. {_STARTED_AS} (docs/launchers.md)",
        "TypeError: tree['x'] is on cpu, but this process runs XLA replicas. "
        f"{_STARTED_AS}, or call torch.distributed.init_process_group first (docs/launchers.md)",
    ]


_XLA_LEAVES_ON_A_GROUP = """
import json, os, torch, torch_xla, torch.distributed as dist
import xcoll
store = "file://" + os.path.abspath(__file__) + ".store"
dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
try:
    xcoll.gather({"x": torch.ones(1, device=torch_xla.device())}, group=dist.group.WORLD)
    said = "returned"
except ValueError as e:
    said = f"{type(e).__name__}: {e}"
dist.destroy_process_group()
print(json.dumps(said))
"""


@needs_xla
def test_xla_leaves_on_a_process_group_are_refused(tmp_path):
    said = _python(tmp_path, _XLA_LEAVES_ON_A_GROUP, {"PJRT_DEVICE": "CPU"})
    assert said == "ValueError: group= selects a torch.distributed process group; these leaves are on XLA"


def test_importing_xcoll_keeps_the_callers_xla_cpu_client(tmp_path):
    code = "import json, os, xcoll\nprint(json.dumps(os.environ['PJRT_CPU_ASYNC_CLIENT']))\n"
    assert _python(tmp_path, code, {"PJRT_CPU_ASYNC_CLIENT": "true"}) == "true"


@needs_xla
@pytest.mark.parametrize("first", ["torch_xla", "xcoll"])
def test_importing_xcoll_makes_the_xla_cpu_client_synchronous_in_either_import_order(tmp_path, first):
    # (the usual order imports torch_xla first: no runtime runs until a device is used)
    second = "xcoll" if first == "torch_xla" else "torch_xla"
    code = (
        f"import json, os, torch, {first}, {second}\n"
        "from xcoll._backends import xla_runtime_running\n"
        "before = xla_runtime_running()\n"
        "(torch.ones(1, device=torch_xla.device()) + 1).cpu()  # (the runtime starts)\n"
        "print(json.dumps([before, os.environ.get('PJRT_CPU_ASYNC_CLIENT'), xla_runtime_running()]))\n"
    )
    assert _python(tmp_path, code, {"PJRT_DEVICE": "CPU"}) == [False, "false", True]


@needs_xla
def test_importing_xcoll_after_an_xla_runtime_started_leaves_its_client_alone(tmp_path):
    code = (
        "import json, os, torch, torch_xla\n"
        "(torch.ones(1, device=torch_xla.device()) + 1).cpu()  # (the runtime runs)\n"
        "import xcoll\n"
        "from xcoll._backends import xla_runtime_running\n"
        "print(json.dumps([os.environ.get('PJRT_CPU_ASYNC_CLIENT'), xla_runtime_running()]))\n"
    )
    assert _python(tmp_path, code, {"PJRT_DEVICE": "CPU"}) == [None, True]


# ---- dict keys whose order no replica can match -----------------------------------


class _Anon:
    """A dict key without a repr of its own (``<... object at 0x...>``, the same
    on every replica once the address is left out) or an order."""


class _Named:
    """A dict key that reads as its name but has no order."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"_Named({self.name!r})"


def _metric_keys(kind, first_loss):
    """{loss key: loss, acc key: acc}, inserted loss first or acc first."""
    keys = (_Anon(), _Anon()) if kind == "anonymous" else (_Named("loss"), _Named("acc"))
    items = list(zip(keys, ("loss", "acc"), strict=True))
    return dict(items if first_loss else items[::-1])


def _keyed(tree, mapping):
    from collections import OrderedDict, defaultdict

    if mapping == "OrderedDict":
        return OrderedDict(tree)
    if mapping == "defaultdict":
        return defaultdict(list, tree)
    return tree


@pytest.mark.parametrize("mapping", ["dict", "OrderedDict", "defaultdict"])
@pytest.mark.parametrize("fn", [xcoll.gather, xcoll.reduce, xcoll.broadcast])
def test_keys_that_keep_insertion_order_and_read_the_same_are_refused(fn, mapping):
    keys = _metric_keys("anonymous", first_loss=True)
    tree = {"ok": 1.0, "m": [_keyed({k: torch.ones(1) for k in keys}, mapping)]}
    with pytest.raises(TypeError, match=re.escape("tree['m'][0]: ")) as e:
        fn(tree)
    assert "two of them read <tests.test_errors._Anon object>" in str(e.value)


@pytest.mark.parametrize(
    "keys",
    [
        [_Anon()],  # one: nothing to mix up
        [_Named("loss"), _Named("acc")],  # named: the check sees their order
        [_Anon(), 1, "a"],  # optree sorts them by type
        [len, max],  # functions read as their names
    ],
    ids=["one", "named", "mixed types", "functions"],
)
def test_keys_that_can_be_told_apart_pass(keys):
    tree = {k: torch.tensor([float(i)]) for i, k in enumerate(keys)}
    out = xcoll.gather(tree)
    assert [out[k].item() for k in keys] == [float(i) for i in range(len(keys))]


def _metric_tree(args):
    kind, where, r = args
    if where == "rank 0" and r != 0:
        tree = {"m": {"loss": torch.tensor([1.0 + r]), "acc": torch.tensor([10.0 + r])}}
    else:  # the keys inserted in a different order on every other replica
        keys = _metric_keys(kind, first_loss=r % 2 == 0)
        values = {"loss": torch.tensor([1.0 + r]), "acc": torch.tensor([10.0 + r])}
        tree = {"m": {k: values[name] for k, name in keys.items()}}
    with xcoll.consistency_checks("always" if where != "guard" else "guard"):
        xcoll.gather(to_device({"warm": 1.0}, device()))  # a consistent first call
        xcoll.gather(to_device(tree, device()), to_cpu=True)
    return "returned"


@pytest.mark.parametrize("world", ["gloo-2", "gloo-4", "xla-cpu-2", "xla-cpu-4"])
@pytest.mark.parametrize(
    "kind,where,raised",
    [
        ("anonymous", "every rank", "TypeError"),
        ("anonymous", "rank 0", "TypeError"),
        ("named", "every rank", "CollectiveMismatchError"),
        ("named", "guard", "CollectiveMismatchError"),
    ],
)
def test_dict_keys_in_a_different_order_never_swap_values(world, kind, where, raised):
    # 'loss' and 'acc' inserted in a different order on each replica: keys that
    # read the same are refused where they are (the others, with "always",
    # quote the refusal); keys that read differently differ in the check
    pool = shared_pool(world)
    w = pool.world_size
    failures = pool.run(_metric_tree, [(kind, where, r) for r in range(w)], return_exceptions=True)
    for r, f in enumerate(failures):
        assert f != "returned", (r, failures)
        named = "tree['m']" if kind == "anonymous" else "_Named("
        if where == "rank 0" and r != 0:
            assert f.type_name.endswith("CollectiveMismatchError"), f
            assert "rank 0" in f.message and "tree['m']: keys that cannot be sorted" in f.message
        else:
            assert f.type_name.endswith(raised), f
            assert named in f.message, f
    assert pool.run(_ok) == list(range(w))
