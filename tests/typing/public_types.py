"""What a type checker reads of xcoll's public calls: checked by mypy (CI's
``mypy`` run, pyproject.toml's ``files``), never run. A tensor in, a tensor
out; a dict or a list of tensors in, the same type out; a Python scalar's
gather is a list; reduce and broadcast return their input's type; ``op`` is
one of the reductions' names (tests/test_typing.py: a misspelt one fails)."""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import assert_type

import xcoll

t = torch.ones(2)
metrics: dict[str, torch.Tensor] = {"loss": t, "n": t}
pair: list[torch.Tensor] = [t, t]
mixed: dict[str, Any] = {"loss": t, "seen": 8}

assert_type(xcoll.gather(t), torch.Tensor)
assert_type(xcoll.gather(t, dim=1, stack=True, to_cpu=True), torch.Tensor)
assert_type(xcoll.gather(metrics, uneven=True), dict[str, torch.Tensor])
assert_type(xcoll.gather(pair, grad=True), list[torch.Tensor])
assert_type(xcoll.gather(3), list[Any])
assert_type(xcoll.gather(mixed), Any)  # (Any values match several overloads)

assert_type(xcoll.reduce(t), torch.Tensor)
assert_type(xcoll.reduce(metrics, "mean"), dict[str, torch.Tensor])
assert_type(xcoll.reduce(mixed, {"loss": "mean", "seen": "sum"}), dict[str, Any])
assert_type(xcoll.reduce(8, "max"), int)

assert_type(xcoll.broadcast(metrics, src=1), dict[str, torch.Tensor])
assert_type(xcoll.broadcast(0.5), float)

# A dict literal of tensors and Python scalars (what the README reduces):
# its values are Any, so that each is used as what it is.
stats = xcoll.reduce({"loss": t, "seen": 8}, {"loss": "mean", "seen": "sum"})
assert_type(stats, dict[str, Any])
loss: float = stats["loss"].item()
seen: int = stats["seen"]
assert_type(xcoll.broadcast({"seed": 1234, "w": t}, src=0), dict[str, Any])
scalars: dict[str, float] = {"lr": 0.1, "step": 3}
assert_type(xcoll.reduce(scalars, "max"), dict[str, float])
assert_type(xcoll.broadcast(scalars), dict[str, float])
