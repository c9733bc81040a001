"""xcoll under torch.compile (gloo, W=2 and 4): a call of a tree of tensors
is traced into the compiled graph (no graph break, also with
``fullgraph=True``) as one custom op whose kernel is the eager call, so the
compiled step's values and gradients are the eager step's bit for bit, a
replica that runs the step eagerly meets one that runs it compiled, and
replicas whose compiled calls differ raise xcoll's error on every replica.
Calls that cannot be traced are one graph break each."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch

import xcoll
from tests.replicas import shared_pool

WORLDS = ["gloo-2", "gloo-4"]


def _training_step(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """A contrastive step: embeddings, a loss over a ``grad=True`` gather,
    a metrics reduce, a broadcast seed, and a sharded gradient's
    reduce-scatter and all-to-all (``grad=True``)."""
    emb = x * w
    # (keys not in sorted order: xcoll packs in optree's, which sorts them)
    every = xcoll.gather({"norm": (emb * emb).sum(1), "emb": emb}, grad=True)
    loss = (every["emb"] @ emb.T).sum() + every["norm"].sum()
    shard = xcoll.reduce_scatter({"g": emb.reshape(-1)}, "sum", grad=True)["g"]
    swapped = xcoll.all_to_all(emb.reshape(-1), grad=True)
    loss = loss + (shard * shard).sum() + (swapped * 3).sum()
    metrics = xcoll.reduce(
        {"seen": torch.tensor(x.shape[0]), "loss": loss.detach(), "top": emb.detach().max()},
        {"loss": "mean", "seen": "sum", "top": "max"},
    )
    seed = xcoll.broadcast({"seed": torch.tensor([7 + xcoll.rank()])}, src=1)
    return loss, {**metrics, **seed}


def _batch(n: int) -> torch.Tensor:
    # (small integers: every sum is exact in float32, in any order inductor adds)
    r = xcoll.rank()
    return (torch.arange(n * 4.0).reshape(n, 4) % 5 + r) * xcoll.world_size()


def _run(step: Any, n: int) -> dict[str, Any]:
    w = torch.ones(4, requires_grad=True)
    loss, metrics = step(_batch(n), w)
    loss.backward()
    return {"loss": loss.detach(), "grad": w.grad, **metrics}


def _step_compiled(backend: str) -> dict[str, Any]:
    """The step's graph breaks, and per batch size (the second one with
    Dynamo's dynamic shapes) whether the compiled step's values and
    gradients are the eager step's, bit for bit."""
    import torch._dynamo as dynamo

    dynamo.reset()
    out: dict[str, Any] = {"breaks": len(dynamo.explain(_training_step)(_batch(8), torch.ones(4)).break_reasons)}
    dynamo.reset()
    compiled = torch.compile(_training_step, backend=backend, fullgraph=True)
    for n in (8, 12):
        got, want = _run(compiled, n), _run(_training_step, n)
        out[f"equal at {n}"] = got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    return out


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("world", WORLDS)
def test_a_compiled_training_step_traces_every_call_with_the_eager_values_and_gradients(world, backend):
    pool = shared_pool(world)
    expected = {"breaks": 0, "equal at 8": True, "equal at 12": True}
    assert pool.run(_step_compiled, [backend] * pool.world_size) == [expected] * pool.world_size


def _compiled_on_rank_0(_: Any) -> dict[str, Any]:
    """The step compiled on rank 0 and eager on the others, in a step
    block: each replica's values, and the all-eager step's."""
    import torch._dynamo as dynamo

    dynamo.reset()
    step = torch.compile(_training_step, backend="aot_eager", fullgraph=True) if xcoll.rank() == 0 else _training_step
    with xcoll.step(0):
        got = _run(step, 8)
    want = _run(_training_step, 8)
    return {k: torch.equal(got[k], want[k]) for k in want}


@pytest.mark.parametrize("world", WORLDS)
def test_a_step_compiled_on_one_replica_meets_the_eager_step_on_the_others(world):
    # (Dynamo runs a frame eagerly after its recompile limit, on one rank only)
    pool = shared_pool(world)
    got = pool.run(_compiled_on_rank_0, [None] * pool.world_size)
    assert all(r and all(r.values()) for r in got), got


def _keyed(x: torch.Tensor, key: str) -> dict[str, torch.Tensor]:
    return xcoll.reduce({key: x * 2})


def _differing(_: Any) -> tuple[str, list[float]]:
    """Compiled calls whose trees differ between replicas (rank 0's key
    "a", the others' "b"): each replica's error, then a call after it."""
    import torch._dynamo as dynamo

    dynamo.reset()
    f = torch.compile(_keyed, backend="aot_eager", fullgraph=True)
    try:
        f(torch.ones(2), "a" if xcoll.rank() == 0 else "b")
        error = "no error"
    except xcoll.CollectiveMismatchError as e:
        error = str(e)
    return error, xcoll.reduce(torch.ones(2)).tolist()


@pytest.mark.parametrize("world", WORLDS)
def test_replicas_whose_compiled_calls_differ_raise_xcolls_error_on_every_replica(world):
    pool = shared_pool(world)
    w = pool.world_size
    got = pool.run(_differing, [None] * w)
    for error, after in got:
        assert "xcoll.reduce" in error and "['a']" in error and "['b']" in error, error
        assert after == [w, w]


def _bad_shard(x: torch.Tensor) -> torch.Tensor:
    return xcoll.reduce_scatter({"g": x})["g"]


def _refused(_: Any) -> str:
    """A compiled reduce-scatter of a leaf whose size is not a multiple of
    W: the error each replica raises."""
    f = torch.compile(_bad_shard, backend="aot_eager", fullgraph=True)
    try:
        f(torch.ones(xcoll.world_size() + 1))
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_compiled_call_that_the_eager_call_refuses_raises_its_error_on_every_replica():
    pool = shared_pool("gloo-2")
    for error in pool.run(_refused, [None, None]):
        assert error.startswith("tree['g']: dim 0 of shape (3,) has 3 elements, which the 2 replicas cannot"), error


# (each computes before its call: Dynamo's explain counts a break after a
# graph; its break reasons are counted, which it lists for each)
def _scalar_leaf(x):
    return xcoll.reduce({"x": x + 1, "n": 3})["x"] * 2


def _to_cpu(x):
    return xcoll.gather(x + 1, to_cpu=True) + 1


def _uneven(x):
    return xcoll.gather(x[: xcoll.rank() + 1], uneven=True).sum() + x


def _synced(x):
    y = x + 1
    xcoll.sync()
    return y * 2


def _ordered_dict(x):
    # (a dict's subclass: optree keeps an OrderedDict's order, a dict's it sorts)
    y = x + 1
    return xcoll.reduce(collections.OrderedDict(b=y, a=x))["b"] * 2


#: name -> a function with one call that is not traced
UNTRACED = {
    "a Python scalar leaf": _scalar_leaf,
    "to_cpu": _to_cpu,
    "uneven": _uneven,
    "xcoll.sync": _synced,
    "an OrderedDict": _ordered_dict,
}


def _untraced(_: Any) -> dict[str, Any]:
    import torch._dynamo as dynamo

    x = torch.arange(3.0) + xcoll.rank()
    out = {}
    for name, f in UNTRACED.items():
        dynamo.reset()
        breaks = len(dynamo.explain(f)(x).break_reasons)
        dynamo.reset()
        try:
            torch.compile(f, backend="aot_eager", fullgraph=True)(x)
            refused = "no error"
        except Exception as e:  # (Dynamo's Unsupported)
            refused = str(e)
        dynamo.reset()
        same = torch.equal(torch.compile(f, backend="aot_eager")(x), f(x))
        out[name] = (breaks, same, "(reason: xcoll: this call runs eagerly, a graph break" in refused)
    return out


def test_each_call_that_is_not_traced_is_one_graph_break_with_the_eager_values():
    # (and fullgraph=True refuses it, naming xcoll's reason)
    got = shared_pool("gloo-2").run(_untraced, [None, None])
    assert got == [{name: (1, True, True) for name in UNTRACED}] * 2


def _logged_on_rank_0(x: torch.Tensor) -> torch.Tensor:
    """A step whose metrics only rank 0 uses (its logging): on the other
    replicas the call's outputs are unused in the graph."""
    metrics = xcoll.reduce({"loss": x.sum()}, "mean")
    seen = xcoll.gather(x[:1])
    if xcoll.rank() == 0:
        return x + metrics["loss"] + seen.sum()
    return x * 2


def _unused_outputs(backend: str) -> list[float]:
    """The step compiled, then an eager call: each replica's values."""
    import torch._dynamo as dynamo

    dynamo.reset()
    x = torch.arange(2.0) + xcoll.rank()
    out = torch.compile(_logged_on_rank_0, backend=backend, fullgraph=True)(x)
    return out.tolist() + xcoll.reduce(torch.ones(1)).tolist()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_call_whose_outputs_are_unused_still_meets_the_other_replicas(backend):
    # (a compiler leaves out an unused pure op: the other replicas' calls
    # would pair with the next one)
    got = shared_pool("gloo-2").run(_unused_outputs, [backend] * 2)
    # rank 0: x + mean(sum) + (0 + 1), the other: x * 2; then the eager call's sum
    assert got == [[0 + 2.0 + 1, 1 + 2.0 + 1, 2.0], [2.0, 4.0, 2.0]]


def _loss_without_grad(x: torch.Tensor) -> torch.Tensor:
    return xcoll.reduce({"loss": x * 2})["loss"].sum()


def _warned(_: Any) -> list[str]:
    """A compiled call without grad=True of a leaf that requires grad: the
    warnings each replica is given, and whether the graph ran."""
    import warnings

    import torch._dynamo as dynamo

    from xcoll._core import grad

    dynamo.reset()
    grad._once.__dict__.pop("warned", None)  # (told once per replica: this test's own)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = torch.compile(_loss_without_grad, backend="aot_eager", fullgraph=True)(torch.ones(2, requires_grad=True))
    return [str(w.message) for w in seen if "grad=True" in str(w.message)] + [str(out.item())]


def test_a_compiled_call_without_grad_of_a_leaf_that_requires_grad_warns_once_on_every_replica():
    got = shared_pool("gloo-2").run(_warned, [None, None])
    for rank, messages in enumerate(got):
        *warned, value = messages
        assert value == "8.0" and len(warned) == 1, messages
        assert warned[0].startswith(f"xcoll.reduce on rank {rank}: tree['loss'] requires grad"), warned


def _xla_model(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x @ w).relu()


def _xla_step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A step on XLA: its calls are graph breaks under openxla."""
    y = _xla_model(x, w)
    m = xcoll.reduce({"y": y.sum(), "n": torch.ones((), device=x.device)})
    return (xcoll.gather(y) * m["y"]).sum() / m["n"]


def _with_model_compiled(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = _compiled_model(x, w)
    m = xcoll.reduce({"y": y.sum(), "n": torch.ones((), device=x.device)})
    return (xcoll.gather(y) * m["y"]).sum() / m["n"]


_compiled_model: Any = None


def _openxla(_: Any) -> list[bool]:
    """The step compiled by openxla (its xcoll calls graph breaks), then
    only its model compiled (xcoll outside it), three steps each: whether
    each step's value is the eager step's."""
    global _compiled_model
    import torch._dynamo as dynamo
    import torch_xla

    dev = torch_xla.device()
    w = torch.ones(4, 3, device=dev)
    dynamo.reset()
    _compiled_model = torch.compile(_xla_model, backend="openxla")
    whole = torch.compile(_xla_step, backend="openxla")
    same = []
    for step in (whole, _with_model_compiled):
        for i in range(3):
            x = torch.arange(8.0, device=dev).reshape(2, 4) + xcoll.rank() + i
            same.append(torch.equal(step(x, w).cpu(), _xla_step(x, w).cpu()))
    return same


@pytest.mark.parametrize("world", ["xla-cpu-2", "xla-cpu-4"])
def test_openxla_on_xla_cpu_replica_threads_runs_xcolls_calls_as_graph_breaks(world):
    # (torch_xla's openxla bridge waits for every device of the process as it
    # compiles: on replica threads, for another replica's collective, which
    # waited for this one, and XLA aborted the process)
    pool = shared_pool(world)
    assert pool.run(_openxla, [None] * pool.world_size) == [[True] * 6] * pool.world_size
