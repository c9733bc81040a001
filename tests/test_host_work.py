"""Host work per call, counted (``bench/host_work.py``): the Python-level
function calls of one warm call on rank 0 of a world of 2 stay within their
bounds, on gloo and on XLA:CPU. Counts, not times: they are the same on
every run and every machine with these torch and torch_xla versions.

On a fresh gloo world each cell meets issue 36's target (:data:`TARGETS`).
On the suite's shared pools the bounds are today's counts with a little
room: a change that adds host work to every call fails here, and one that
removes some lowers them."""

from __future__ import annotations

import pytest

from bench.host_work import CELLS, count, frames
from tests.replicas import shared_pool
from xcoll.testing import GlooPool

#: Issue 36's targets (a warm 1-leaf call at most 100 Python-level calls, the
#: 3-leaf metrics reduce 120, the 1-leaf differentiable gather 150; gloo,
#: rank 0 of 2, a fresh world: no state from other tests' calls), raised by
#: the cost of hosting small calls on gloo (issue 56: every small call one
#: all-gather of 4 KiB, which catches calls of different kinds; about 20
#: calls more). Issue 59 asks for 60 to 90.
TARGETS = {
    "reduce, 1 leaf": 125,
    "gather, 1 leaf": 125,
    "broadcast, 1 leaf": 125,
    "reduce, 3-leaf metrics": 125,
    "gather grad=True, 1 leaf": 150,
}
# Measured on a fresh pool, plus room: a pool that has run other tests counts
# a few more in some cells, from the caches and state its earlier calls left
# (measured on the suite's shared XLA pool: a broadcast 8 more, a grad=True
# gather 22 more; on gloo the counts were those of a fresh pool).
BOUNDS = {
    "gloo-2": {
        "reduce, 1 leaf": 112 + 15,
        "gather, 1 leaf": 117 + 15,
        "broadcast, 1 leaf": 115 + 15,
        "reduce, 3-leaf metrics": 115 + 15,
        "gather grad=True, 1 leaf": 139 + 15,
        "reduce in a step, 1 leaf": 197 + 15,
    },
    "xla-cpu-2": {
        "reduce, 1 leaf": 172 + 30,
        "gather, 1 leaf": 187 + 30,
        "broadcast, 1 leaf": 186 + 30,
        "reduce, 3-leaf metrics": 175 + 30,
        "gather grad=True, 1 leaf": 208 + 30,
        "reduce in a step, 1 leaf": 297 + 30,
    },
}


#: A step block's Python-level calls around a 1-leaf reduce: its tag, the
#: place read from the frames (the call's header, kept per tag, made once:
#: the bench's step has a fixed name),
#: and its end's check (a small guarded exchange
#: of its own, which compares the block's number of calls on every replica;
#: on XLA an execution of the small calls' program).
STEP = {"gloo-2": 85, "xla-cpu-2": 116}


@pytest.mark.parametrize("world", sorted(BOUNDS))
def test_a_warm_call_makes_at_most_its_bound_of_python_level_calls(world):
    counts = shared_pool(world).run(count, [None, None])[0]
    assert set(counts) == set(CELLS)
    over = {c: (counts[c], b) for c, b in BOUNDS[world].items() if counts[c] > b}
    assert not over, f"(count, bound) per cell over its bound: {over}; all counts: {counts}"
    # (the plain engine call is counted by the same profiler: the count is not empty)
    assert 0 < counts["plain"] < min(BOUNDS[world].values())
    # A step block's own cost, whatever state the pool's earlier calls left
    # (which adds alike to both cells): its tag, the place read from the
    # frames and known again (its text made each call instead: 12 more), its
    # end's check.
    step = counts["reduce in a step, 1 leaf"] - counts["reduce, 1 leaf"]
    assert step <= STEP[world] + 4, (step, counts)


def test_a_warm_call_on_a_fresh_gloo_world_meets_its_target():
    with GlooPool(2) as pool:
        counts = pool.run(count, [None, None])[0]
    over = {c: (counts[c], t) for c, t in TARGETS.items() if counts[c] > t}
    assert not over, f"(count, target) per cell over its target: {over}; all counts: {counts}"
    assert 0 < counts["plain"] < min(TARGETS.values())


#: The most xcoll frames on the stack when a warm call reaches its engine's
#: collective (``bench.host_work.frames``: the public function's frame and
#: the one that calls the engine included), today's counts: a change that
#: deepens the call line fails here. Issue 59 asks for 6 (plus the frame
#: that calls the engine).
FRAMES = {
    "gloo-2": {"gather grad=True, 1 leaf": 11, "gather, 64 KiB": 9, "other": 9},
    "xla-cpu-2": {"gather grad=True, 1 leaf": 14, "gather, 64 KiB": 9, "other": 12},
}


@pytest.mark.parametrize("world", sorted(FRAMES))
def test_a_warm_call_reaches_its_engine_within_its_bound_of_frames(world):
    depths = shared_pool(world).run(frames, [None, None])[0]
    bounds = FRAMES[world]
    over = {c: d for c, d in depths.items() if d > bounds.get(c, bounds["other"])}
    assert not over, f"frames per cell over its bound: {over}; all: {depths}"
    # (the engine's call was seen in every cell: a count of 0 would pass any bound)
    assert min(depths.values()) >= 5, depths
