"""torch.compile around xcoll (gloo, W=2): each public call is one graph
break, outside the traced graph, and the compiled function gives the eager
function's values and, with ``grad=True``, its gradients."""

from __future__ import annotations

from typing import Any

import torch

import xcoll
from tests.replicas import shared_pool


def _metrics(x: torch.Tensor) -> torch.Tensor:
    m = xcoll.reduce({"a": x * 2, "n": x.sum()}, {"a": "mean", "n": "sum"})
    return m["a"] + m["n"]


def _contrastive(x: torch.Tensor) -> torch.Tensor:
    every = xcoll.gather(x * 2, grad=True)
    return (every * every).sum()


def _broadcast_twice(x: torch.Tensor) -> torch.Tensor:
    y = xcoll.broadcast(x + 1, src=1)
    return xcoll.broadcast(y * 3, src=0) - x


#: name -> (function, its xcoll calls: the graph breaks expected)
FUNCTIONS = {
    "metrics": (_metrics, 1),
    "contrastive": (_contrastive, 1),
    "broadcast twice": (_broadcast_twice, 2),
}


def _compiled(_: Any = None) -> dict[str, Any]:
    """Per function: its graph breaks under Dynamo, whether the compiled
    function's values equal the eager ones, and (where it is differentiable)
    its input gradients."""
    import torch._dynamo as dynamo

    x = torch.arange(3.0) + 10 * xcoll.rank()
    out: dict[str, Any] = {}
    for name, (f, _) in FUNCTIONS.items():
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


def test_each_call_is_one_graph_break_with_the_eager_values_and_gradients():
    got = shared_pool("gloo-2").run(_compiled, [None, None])
    expected: dict[str, Any] = {}
    for name, (_, calls) in FUNCTIONS.items():
        expected |= {f"{name} breaks": calls, f"{name} values": True}
    # (the broadcasts' outputs do not require grad; "- x" does)
    expected["contrastive gradients"] = expected["broadcast twice gradients"] = True
    assert got == [expected, expected]
