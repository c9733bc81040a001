"""torch.compile around xcoll (gloo): a training step's gather (``grad=True``),
metrics reduce and broadcast are traced into the compiled graph, with
``fullgraph=True`` and no graph break, and give the eager step's values and
gradients; replicas whose compiled calls differ raise on every replica; a
call that is not traced is one graph break, run as it runs eagerly."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import xcoll
from tests.replicas import shared_pool


def _step(w: torch.Tensor, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, Any, Any]:
    """A contrastive step as users compile it: every replica's embeddings
    (and their indices, an int64 leaf: a second bucket) through a
    differentiable gather, a metrics dict reduced, a seed broadcast."""
    emb = x @ w
    every = xcoll.gather({"emb": emb, "index": labels}, grad=True)
    logits = emb @ every["emb"].T
    loss = torch.nn.functional.cross_entropy(logits, every["index"][labels])
    stats = xcoll.reduce({"loss": loss.detach(), "seen": torch.tensor(float(x.shape[0]))}, "sum")
    best = xcoll.reduce({"top": logits.detach().max(1).values}, "max")
    # (over the small size class: all-reduced by the engine, as eagerly)
    best["big"] = xcoll.reduce(emb.detach().repeat(400, 1), "mean")
    seed = xcoll.broadcast({"seed": torch.arange(3) * (xcoll.rank() + 1), "scale": w.detach()[0]}, src=0)
    return loss, {**stats, **best}, seed


def _inputs(batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rank = xcoll.rank()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, 4, generator=g) + rank
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(7)), x, torch.arange(batch) + batch * rank


def _equal(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    # (inductor fuses the step's own arithmetic, and rounds it otherwise than
    # eager does: its values are compared within float32's rounding)
    return torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def _compiled_step(backend: str) -> dict[str, Any]:
    """The step compiled with fullgraph=True against eager: graph breaks,
    and per batch size (the second makes Dynamo's shapes dynamic) whether
    the loss, metrics, broadcast and gradient equal the eager step's."""
    import torch._dynamo as dynamo

    dynamo.reset()
    w, x, labels = _inputs(5)
    out: dict[str, Any] = {"breaks": dynamo.explain(_step)(w, x, labels).graph_break_count}
    dynamo.reset()
    compiled = torch.compile(_step, backend=backend, fullgraph=True)
    exact = backend != "inductor"
    for batch in (5, 6):
        w, x, labels = _inputs(batch)
        got = {}
        for name, f in (("eager", _step), ("compiled", compiled)):
            wg = w.clone().requires_grad_()
            loss, metrics, seed = f(wg, x, labels)
            loss.backward()
            got[name] = (loss.detach(), metrics, seed, wg.grad)
        (le, me, se, ge), (lc, mc, sc, gc) = got["eager"], got["compiled"]
        out[batch] = {
            "loss": _equal(le, lc, exact),
            "metrics": sorted(me) == sorted(mc) and all(_equal(me[k], mc[k], exact) for k in me),
            "broadcast": all(torch.equal(se[k], sc[k]) for k in se),
            "gradient": _equal(ge, gc, exact),
        }
    return out


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("world", ["gloo-2", "gloo-4"])
def test_a_training_step_compiles_whole_with_the_eager_values_and_gradients(world, backend):
    pool = shared_pool(world)
    same = {"loss": True, "metrics": True, "broadcast": True, "gradient": True}
    for out in pool.run(_compiled_step, [backend] * pool.world_size, timeout=600):
        assert out == {"breaks": 0, 5: same, 6: same}, out


def _one_backward_each(x: torch.Tensor) -> torch.Tensor:
    """Two differentiable gathers of one signature; rank 0's loss through
    the first, the others' through the second: each backward would meet the
    other call's (the forwards agree)."""
    a = xcoll.gather(x, grad=True)
    b = xcoll.gather(x * 2, grad=True)
    return (a if xcoll.rank() == 0 else b).sum()


def _differing(case: str):
    """Rank 0's compiled call differs from the others': each replica's error
    (or its result), then an eager call on the group, which goes on."""
    import torch._dynamo as dynamo

    rank = xcoll.rank()
    x = torch.arange(6.0).reshape(2, 3)
    calls = {
        "gather keys": lambda x: xcoll.gather({"a" if rank == 0 else "b": x}),
        "gather shapes": lambda x: xcoll.gather(x if rank == 0 else x.reshape(3, 2)),
        "reduce ops": lambda x: xcoll.reduce(x, "max" if rank == 0 else "min"),
        "reduce shapes": lambda x: xcoll.reduce(x if rank == 0 else x.reshape(3, 2)),
        "large reduce shapes": lambda x: xcoll.reduce(x.repeat(400, 1) if rank == 0 else x.repeat(400, 1).reshape(1200, 2)),
        "broadcast sources": lambda x: xcoll.broadcast(x, src=0 if rank == 0 else 1),
        "differentiable gather dims": lambda x: xcoll.gather(x, dim=0 if rank == 0 else 1, grad=True),
        "backwards of two calls": _one_backward_each,
    }
    x.requires_grad_(case == "backwards of two calls")
    dynamo.reset()
    try:
        got: Any = torch.compile(calls[case], backend="aot_eager", fullgraph=True)(x)
        if got.requires_grad:  # (the backward graph runs here)
            got.backward()
            got = x.grad
    except RuntimeError as e:
        got = str(e)
    return got, xcoll.reduce(torch.ones(1)).item()


DIFFERING = ["gather keys", "gather shapes", "reduce ops", "reduce shapes", "large reduce shapes", "broadcast sources"]


@pytest.mark.parametrize("case", [*DIFFERING, "differentiable gather dims", "backwards of two calls"])
@pytest.mark.parametrize("world", ["gloo-2", "gloo-4"])
def test_replicas_whose_compiled_calls_differ_raise_on_every_replica(world, case):
    pool = shared_pool(world)
    w = pool.world_size
    name = {"differentiable gather dims": "gather", "backwards of two calls": "gather backward"}.get(case) or case.split()[-2]
    for rank, (got, after) in enumerate(pool.run(_differing, [case] * w, timeout=300)):
        assert isinstance(got, str), (rank, got)  # never a result
        assert f"xcoll.{name}: replicas made different calls (checked in a graph compiled by torch.compile" in got, (
            rank,
            got,
        )
        assert after == w  # (the group goes on)


def _metrics(x: torch.Tensor) -> torch.Tensor:
    m = xcoll.reduce({"a": x * 2, "n": x.sum()}, {"a": "mean", "n": "sum"})
    return m["a"] + m["n"]


def _python_scalars(x: torch.Tensor) -> torch.Tensor:
    return xcoll.gather({"x": x * 2, "n": 3})["x"] * 2


def _to_cpu(x: torch.Tensor) -> torch.Tensor:
    return xcoll.reduce(x + 1, to_cpu=True) * 2


def _in_flight(x: torch.Tensor) -> torch.Tensor:
    return xcoll.reduce(x + 1, sync=False) * 2


def _broadcast_grad(x: torch.Tensor) -> torch.Tensor:
    return xcoll.broadcast(x * 3, src=1, grad=True) - x


#: name -> (function, its graph breaks: its calls that are not traced)
UNTRACED = {
    "a tree of ops": (_metrics, 1),
    "Python scalar leaves": (_python_scalars, 1),
    "to_cpu": (_to_cpu, 1),
    "broadcast grad=True": (_broadcast_grad, 1),
    "sync=False (traced: the graph waits where it uses the output)": (_in_flight, 0),
}


def _untraced(_: Any = None) -> dict[str, Any]:
    """Per function: its graph breaks, whether the compiled function's
    values equal the eager ones, and (where it is differentiable) its
    input gradients."""
    import torch._dynamo as dynamo

    x = torch.arange(3.0) + 10 * xcoll.rank()
    out: dict[str, Any] = {}
    for name, (f, _) in UNTRACED.items():
        dynamo.reset()
        out[f"{name} breaks"] = dynamo.explain(f)(x).graph_break_count
        dynamo.reset()
        xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        compiled, eager = torch.compile(f, backend="aot_eager")(xc), f(xe)
        out[f"{name} values"] = torch.equal(compiled, eager)
        if compiled.requires_grad:
            compiled.sum().backward()
            eager.sum().backward()
            out[f"{name} gradients"] = torch.equal(xc.grad, xe.grad)
    return out


def test_each_call_that_is_not_traced_is_one_graph_break_with_the_eager_values():
    got = shared_pool("gloo-2").run(_untraced, [None, None])
    expected: dict[str, Any] = {}
    for name, (_, breaks) in UNTRACED.items():
        expected |= {f"{name} breaks": breaks, f"{name} values": True}
    expected["broadcast grad=True gradients"] = True  # (the others' outputs need no gradient)
    assert got == [expected, expected]
