"""Host work per call, counted (``bench/host_work.py``): the Python-level
function calls of one warm call on rank 0 of a world of 2 stay within their
bounds, on gloo and on XLA:CPU. Counts, not times: they are the same on
every run and every machine with these torch and torch_xla versions.

The bounds are today's counts with a little room: a change that adds host
work to every call fails here, and one that removes some lowers them. (Issue
36 aims at 100 for a 1-leaf call, 120 for the 3-leaf metrics reduce and 150
for the differentiable gather.)"""

from __future__ import annotations

import pytest

from bench.host_work import CELLS, count
from tests.replicas import shared_pool

# Measured on a fresh pool, plus 15: a pool that has run other tests counts
# a few more in some cells (measured: a broadcast 8 more on .ci/run's shared
# XLA pool), from the caches and state its earlier calls left.
BOUNDS = {
    "gloo-2": {
        "reduce, 1 leaf": 136 + 15,
        "gather, 1 leaf": 175 + 15,
        "broadcast, 1 leaf": 147 + 15,
        "reduce, 3-leaf metrics": 139 + 15,
        "gather grad=True, 1 leaf": 214 + 15,
    },
    "xla-cpu-2": {
        "reduce, 1 leaf": 215 + 15,
        "gather, 1 leaf": 245 + 15,
        "broadcast, 1 leaf": 235 + 15,
        "reduce, 3-leaf metrics": 218 + 15,
        "gather grad=True, 1 leaf": 285 + 15,
    },
}


@pytest.mark.parametrize("world", sorted(BOUNDS))
def test_a_warm_call_makes_at_most_its_bound_of_python_level_calls(world):
    counts = shared_pool(world).run(count, [None, None])[0]
    assert set(counts) == set(CELLS)
    over = {c: (counts[c], b) for c, b in BOUNDS[world].items() if counts[c] > b}
    assert not over, f"(count, bound) per cell over its bound: {over}; all counts: {counts}"
    # (the plain engine call is counted by the same profiler: the count is not empty)
    assert 0 < counts["plain"] < min(BOUNDS[world].values())
