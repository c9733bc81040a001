"""The consistency check's "first call" is counted per process group (per
replica on XLA), never per thread, so every member of a group agrees on which
of its calls is checked. Fresh pools: the state lives as long as a process."""

from __future__ import annotations

import threading

import torch

import xcoll
from xcoll.testing import GlooPool


def _subgroup_first(r):
    import torch.distributed as dist

    pair = dist.new_group([0, 1])  # every rank creates it; only 0 and 1 use it
    if r in (0, 1):  # their first call is on the pair, the others' on the world
        assert xcoll.gather(torch.tensor([r]), group=pair).tolist() == [0, 1]
    return xcoll.gather({"x": torch.tensor([10 * r])})["x"].tolist()


def test_a_first_call_on_a_subgroup_is_not_one_on_the_world():
    with GlooPool(4, timeout=120, collective_timeout=30) as pool:
        assert pool.run(_subgroup_first, list(range(4))) == [[0, 10, 20, 30]] * 4


def _second_call_from_a_new_thread(r):
    first = xcoll.reduce(torch.tensor([r + 1]))
    out = {}
    call = lambda: out.update(second=xcoll.gather({"k": torch.tensor([r])})["k"])  # noqa: E731
    if r == 0:  # rank 0 makes its second call from a thread of its own
        t = threading.Thread(target=call)
        t.start()
        t.join()
    else:
        call()
    return first.tolist(), out["second"].tolist()


def test_a_new_thread_does_not_make_a_first_call_again():
    with GlooPool(2, timeout=120, collective_timeout=30) as pool:
        assert pool.run(_second_call_from_a_new_thread, [0, 1]) == [([3], [0, 1])] * 2


def _called_keys(_):
    import torch.distributed as dist

    from xcoll._guard import check as _check

    xcoll.gather(torch.tensor([1]))
    return [k for k in _check._called if any(isinstance(x, dist.ProcessGroup) for x in k)]


def test_the_first_call_state_holds_no_process_group():
    # holding the group object kept it alive past destroy_process_group, and
    # its destructor at interpreter exit aborted gloo processes
    with GlooPool(2, timeout=120, collective_timeout=30) as pool:
        assert pool.run(_called_keys, [None, None]) == [[], []]


def _checked_calls(_):
    """The full checks made by a call in mode "never", then by two calls in
    the default mode."""
    from xcoll._guard import check as _check

    made = []
    verify = _check.verify
    _check.verify = lambda *a, **k: (made.append(1), verify(*a, **k))[1]
    try:
        counts = []
        for mode in ("never", "guard", "guard"):
            before = len(made)
            with xcoll.consistency_checks(mode):
                assert xcoll.gather(torch.tensor([xcoll.rank()])).tolist() == [0, 1]
            counts.append(len(made) - before)
        return counts
    finally:
        _check.verify = verify


def test_a_call_in_mode_never_leaves_the_first_check_to_come():
    # a "never" call checks nothing: the group's first checked call is the next one
    with GlooPool(2, timeout=120, collective_timeout=30) as pool:
        assert pool.run(_checked_calls, [None, None]) == [[0, 1, 0]] * 2


def _later_object_calls_checked(_):
    """The full checks made by object, barrier and RNG calls after a group's
    first call (checked in full)."""
    from xcoll._guard import check as _check

    made = []
    verify = _check.verify
    _check.verify = lambda *a, **k: (made.append(1), verify(*a, **k))[1]
    try:
        xcoll.barrier("first")
        before = len(made)
        assert xcoll.gather_object(xcoll.rank()) == [0, 1]
        assert xcoll.broadcast_object("a") == "a"
        xcoll.barrier("then")
        xcoll.sync_rng_state()
        return before, len(made) - before
    finally:
        _check.verify = verify


def test_later_object_calls_are_guarded_not_checked_in_full():
    # their fingerprint travels with their own exchanges: no extra one
    with GlooPool(2, timeout=120, collective_timeout=30) as pool:
        assert pool.run(_later_object_calls_checked, [None, None]) == [(1, 0)] * 2

