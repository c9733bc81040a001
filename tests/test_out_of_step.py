"""Replicas that fall out of step: a replica that skips a call, two threads on
one group, a peer that never arrives. Never silently wrong data: every replica
raises, naming what differs, or waits with xcoll's diagnosis."""

from __future__ import annotations

import contextlib
import datetime
import io
import pathlib
import re
import sys
import threading
import time

import pytest
import torch

import xcoll
from tests.replicas import device, shared_pool

WORLDS = ["gloo-2", "gloo-4", "xla-cpu-2", "xla-cpu-4"]
MISMATCH = "xcoll.CollectiveMismatchError"


def _loop(how: str):
    """An eval loop of 4 steps whose last replica's own code raises at step 1
    (``how="skip"``: before the call; ``"invalid"``: inside the call, on a leaf
    only that replica has), catches the error and goes on, as a loop that
    skips a bad batch does. Returns each step's result (or the error)."""
    rank, world = xcoll.rank(), xcoll.world_size()
    dev = device()
    out = []
    for step in range(4):
        x = torch.tensor([float(10 * step + rank)]).to(dev)
        try:
            with xcoll.step(step):
                if step == 1 and rank == world - 1:
                    if how == "skip":
                        raise ValueError("a bad batch")
                    xcoll.reduce({"x": x, "bad": "not a tensor"})
                total = xcoll.reduce({"x": x})["x"].item()
                out.append(("ok", step, total))
        except (ValueError, TypeError) as e:
            out.append(("skipped", step, type(e).__name__))
        except xcoll.CollectiveMismatchError as e:
            out.append(("mismatch", step, str(e)))
            break
    return out


@pytest.mark.parametrize("how", ["skip", "invalid"])
@pytest.mark.parametrize("world", WORLDS)
def test_a_replica_that_skips_a_tagged_call_makes_every_replica_raise(world, how):
    pool = shared_pool(world)
    w = pool.world_size
    results = pool.run(_loop, [how] * w)
    expected = sum(10.0 * 0 + r for r in range(w))
    for rank, steps in enumerate(results):
        assert steps[0] == ("ok", 0, expected), (rank, steps)  # before the skip: right
        ok = [s for s in steps if s[0] == "ok"]
        assert len(ok) == 1, (rank, steps)  # never a result paired with another step's
        kind, _, text = steps[-1]
        assert kind == "mismatch", (rank, steps)
        # the last replica's step 2 met the others' step 1: both tags named
        assert "step 1, call" in text and "step 2, call" in text, text


def _tagged(sync: bool):
    rank = xcoll.rank()
    x = torch.ones(2).to(device())
    try:  # (sync=False on XLA: the guard is read after the caller's sync)
        xcoll.gather({"x": x}, tag="eval" if rank == 0 else "train", sync=sync)
        xcoll.sync()
    except xcoll.CollectiveMismatchError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("sync", [True, False])
@pytest.mark.parametrize("world", WORLDS)
def test_calls_with_different_tags_raise_naming_both(world, sync):
    pool = shared_pool(world)
    for text in pool.run(_tagged, [sync] * pool.world_size):
        assert "tag='eval'" in text and "tag='train'" in text, text


def _untagged_against_tagged(what: str):
    """Rank 0's call is untagged (and, with ``what="error"``, has a leaf that
    is not a tensor: checked in full, as a group's first call is, so that
    every replica learns of it), the others' are tagged "train"."""
    rank = xcoll.rank()
    x = torch.ones(2).to(device())
    tree = {"x": x, "bad": "not a tensor"} if what == "error" and rank == 0 else {"x": x}
    try:
        with xcoll.consistency_checks("always" if what == "error" else "guard"):
            xcoll.gather(tree, tag=None if rank == 0 else "train")
    except (xcoll.CollectiveMismatchError, TypeError) as e:
        return type(e).__name__, str(e)
    return "no error", ""


def _falsy_tag(tag):
    """Rank 0's call untagged, the others' tagged ``tag``: each replica's error."""
    try:
        xcoll.reduce(torch.ones(2).to(device()), tag=None if xcoll.rank() == 0 else tag)
    except xcoll.CollectiveMismatchError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("tag", [0, ""])
@pytest.mark.parametrize("world", ["gloo-2", "xla-cpu-2"])
def test_a_falsy_tag_is_a_tag_and_differs_from_none(world, tag):
    # (a tag of 0 or "" read as untagged would pair with the untagged call)
    pool = shared_pool(world)
    for text in pool.run(_falsy_tag, [tag] * pool.world_size):
        assert "tag: (none)" in text and f"tag: tag={tag!r}" in text, text


@pytest.mark.parametrize("world", ["gloo-2", "xla-cpu-2"])
def test_an_untagged_call_is_named_as_such_and_a_local_error_before_the_tags(world):
    pool = shared_pool(world)
    w = pool.world_size
    for rank, (kind, text) in enumerate(pool.run(_untagged_against_tagged, ["tags"] * w)):
        assert kind == "CollectiveMismatchError", (rank, kind, text)
        assert "tag: (none)" in text and "tag: tag='train'" in text, text
    # the local error is what the other replicas are told, not that the tags differ
    results = pool.run(_untagged_against_tagged, ["error"] * w)
    assert results[0][0] == "TypeError" and "tree['bad']" in results[0][1], results[0]
    for kind, text in results[1:]:
        assert kind == "CollectiveMismatchError", (kind, text)
        assert "rank 0 raised before communicating (TypeError: tree['bad']" in text, text


def _barrier_in_mixed_modes(r):
    """After a first call checked in full, rank 0 enters a barrier in mode
    "never", rank 1 in the default mode."""
    xcoll.barrier("first")
    try:
        with xcoll.consistency_checks("never" if r == 0 else "guard"):
            xcoll.barrier("epoch")
    except (xcoll.CollectiveMismatchError, RuntimeError) as e:
        return type(e).__name__, str(e)
    return "no error", ""


def test_a_replica_in_mode_never_among_checked_ones_is_told_so():
    """The mode itself differs, so the barriers' digests do while their tags
    agree: the replica in mode "never" says so at once; the other, whose
    attempt to name the difference meets no peer, says that too when gloo
    gives up (a fresh pool with a short timeout)."""
    from xcoll.testing import GlooPool

    with GlooPool(2, timeout=120, collective_timeout=5) as pool:
        (k0, m0), (k1, m1) = pool.run(_barrier_in_mixed_modes, [0, 1])
    assert k0 == "CollectiveMismatchError", (k0, m0)
    assert m0.startswith("rank 0: the replicas' calls differ, or their XCOLL_CHECK modes do")
    assert "this replica's is \"never\"; every replica must use the same mode" in m0, m0
    assert k1 == "CollectiveMismatchError" and "naming the difference failed" in m1, (k1, m1)


def _bad_tag(_):
    try:
        xcoll.reduce(torch.ones(1).to(device()), tag=1.5)
    except TypeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("world", ["gloo-2", "xla-cpu-2"])
def test_a_tag_that_is_not_a_str_or_int_is_refused(world):
    pool = shared_pool(world)
    for text in pool.run(_bad_tag, [None] * pool.world_size):
        assert "tag must be a str or an int, got float" in text, text


def _reliability_snippet(_):
    namespace = {"torch": torch, "xcoll": xcoll, "dev": device()}
    exec(SNIPPET, namespace)
    return namespace["stats"]["loss"].item(), namespace["stats"]["seen"]


def snippet() -> str:
    """docs/reliability.md's training loop tagged with ``xcoll.step``."""
    from tests.test_docs_run import blocks

    (code,) = blocks(ROOT / "docs" / "reliability.md")
    return code


ROOT = pathlib.Path(__file__).resolve().parents[1]
SNIPPET = snippet()


@pytest.mark.parametrize("world", ["gloo-2", "xla-cpu-2"])
def test_the_tagged_loop_of_the_docs_runs(world):
    pool = shared_pool(world)
    results = pool.run(_reliability_snippet, [None] * pool.world_size)
    assert len(set(results)) == 1 and results[0][1] == 8 * pool.world_size, results


def _steps_per_group(_):
    import torch.distributed as dist

    rank = dist.get_rank()
    solo = dist.new_group([0])  # every rank creates it; rank 0 alone is in it
    with xcoll.step("eval"):
        if rank == 0:  # a call on its own group first: call 0 there
            xcoll.reduce({"x": torch.ones(1)}, group=solo)
        total = xcoll.reduce({"x": torch.ones(1)})["x"].item()  # call 0 on the world
    if rank == 0:
        dist.destroy_process_group(solo)
    return total


def test_a_steps_calls_are_numbered_per_process_group():
    # a call on a group that some replicas are not in does not shift the
    # numbers of their calls on the world group
    assert shared_pool("gloo-2").run(_steps_per_group, [None, None]) == [2.0, 2.0]


def _local_error_diagnosed(_):
    rank = xcoll.rank()
    with _stderr_and_watchdog(1.0) as err, xcoll.consistency_checks("always"):
        if rank == 1:
            time.sleep(2.5)  # rank 0's check (its error shared with every replica) waits
        try:
            xcoll.gather({"x": torch.ones(2), "bad": "not a tensor"}, tag="late")
        except TypeError:
            pass
    return err.getvalue()


def test_a_call_that_raised_locally_and_waits_is_diagnosed():
    printed = shared_pool("gloo-2").run(_local_error_diagnosed, [None, None])[0]
    assert (
        "xcoll: xcoll.gather on rank 0 has waited 1 s for the other replicas. This replica's"
        in printed
    ), printed
    assert "This replica's call: tag: tag='late'; parameters: dim=0 " in printed, printed
    # gloo: no XLA program, no PJRT client among the causes
    assert "Causes that fit this wait: (1) a replica has not reached" in printed, printed
    assert "programs" not in printed and "PJRT" not in printed, printed
    assert "; no leaves; description " in printed, printed


# ---- two threads on one group ----------------------------------------------------


def _overlap(timeout: float):
    """Rank 0 calls from two threads at once on a fresh group; the other ranks
    call twice from one thread (their two threads' calls one after the other).
    Then every rank goes on with a third call. Returns what each call gave."""
    import torch.distributed as dist

    rank = dist.get_rank()
    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout))
    x = torch.tensor([float(rank)])
    outcomes = []

    def call(label):
        try:
            got = xcoll.reduce({"x": x}, group=group)["x"].item()
            outcomes.append((label, "ok", got))
        except Exception as e:
            outcomes.append((label, f"{type(e).__module__}.{type(e).__name__}", str(e)))

    if rank == 0:
        first = threading.Thread(target=call, args=("first",))
        first.start()
        time.sleep(0.5)  # the first thread's call is waiting for the others
        call("second")
        first.join()
    else:
        time.sleep(1.5)
        call("first")
        call("second")
    call("after")
    dist.destroy_process_group(group)
    return outcomes


@pytest.mark.parametrize("world", ["gloo-2", "gloo-4"])
def test_after_an_overlap_no_replica_returns_another_calls_data(world):
    pool = shared_pool(world)
    w = pool.world_size
    results = pool.run(_overlap, [3.0] * w, timeout=120)
    total = float(sum(range(w)))
    zero = dict((label, (kind, v)) for label, kind, v in results[0])
    # rank 0: the overlapping call and the one it overlapped both raise, and so
    # does every later call, without communicating
    for label in ("first", "second", "after"):
        assert zero[label][0] == "xcoll.ConcurrentCallError", results[0]
    assert "unusable" in zero["after"][1], results[0]
    # (the messages say which: the call that overlapped, the one it overlapped)
    overlapping = (
        r"xcoll\.reduce: called on rank 0 of the group \(global rank 0\) from thread .* while "
        r"another thread has a call in flight on the same process group; calls .* The group is "
        r"unusable from now on: make a new one \(on XLA, restart the replicas\)"
    )
    overlapped = (
        r"xcoll\.reduce: another thread called xcoll on the same process group while this call "
        r".* its result may be paired with that call's on other replicas\. The group is "
        r"unusable from now on"
    )
    assert re.fullmatch(overlapping, zero["second"][1], re.S), results[0]
    assert re.fullmatch(overlapped, zero["first"][1], re.S), results[0]
    for rank, outcomes in enumerate(results[1:], 1):
        got = dict((label, (kind, v)) for label, kind, v in outcomes)
        # the call paired with rank 0's first thread completed; no later call
        # returns: each waits for rank 0, which makes no more collectives
        assert got["first"] == ("ok", total), (rank, outcomes)
        for label in ("second", "after"):
            kind, text = got[label]
            assert kind == "builtins.RuntimeError", (rank, outcomes)
            assert "did not complete" in text or "Connection closed" in text, (rank, outcomes)


def _xla_overlap(_):
    rank = xcoll.rank()
    x = torch.tensor([float(rank)]).to(device())
    outcomes = []

    def call(label):
        try:
            outcomes.append((label, "ok", xcoll.reduce({"x": x})["x"].item()))
        except Exception as e:
            outcomes.append((label, f"{type(e).__module__}.{type(e).__name__}", str(e)[:300]))

    if rank == 0:
        # a second thread of this replica calls while the replica's own call
        # waits for rank 1
        second = threading.Thread(target=lambda: (time.sleep(0.5), call("second")))
        second.start()
        call("first")
        second.join()
        call("after")  # raises at once: rank 0 makes no more collectives
    else:
        time.sleep(1.5)
        call("first")
    return outcomes


def test_after_an_overlap_an_xla_replica_makes_no_more_collectives():
    from xcoll.testing import XlaPool

    with XlaPool(2, grace=2) as pool:  # its own pool: the overlap ends its world
        results = pool.run(_xla_overlap, [None, None], timeout=120)
    zero = dict((label, kind) for label, kind, _ in results[0])
    assert zero == dict.fromkeys(("first", "second", "after"), "xcoll.ConcurrentCallError"), results
    assert results[1] == [("first", "ok", 1.0)], results


# ---- every wait diagnosed -------------------------------------------------------


def _shorter_than_the_delay(_):
    """Rank 1 calls a second late: rank 0's call waits less than the
    watchdog's delay (2 s here), so nothing is printed on either."""
    with _stderr_and_watchdog(2.0) as err:
        xcoll.barrier()  # (the pool's processes started at their own times)
        if xcoll.rank() == 1:
            time.sleep(1.0)
        xcoll.gather(torch.ones(2))
    return err.getvalue()


def test_a_call_shorter_than_the_watchdogs_delay_prints_nothing():
    # (the watchdog polls 10 times per delay: a poll that printed every
    # call it found, due or not, would print rank 0's)
    assert shared_pool("gloo-2").run(_shorter_than_the_delay, [None, None]) == ["", ""]


def test_one_daemon_thread_named_xcoll_watchdog_serves_every_call():
    # (named, so that a thread dump says whose it is; a daemon, so that it
    # never keeps a finished program alive)
    from xcoll._guard import watchdog as _watchdog

    for _ in range(2):
        with _watchdog.watch(str):
            pass
    threads = [t for t in threading.enumerate() if t.name == "xcoll-watchdog"]
    assert len(threads) == 1 and threads[0].daemon, threading.enumerate()


def test_each_watched_call_is_its_own():
    # (one call that ends, a call in flight completed inside another call
    # say, leaves the other's diagnosis due)
    from xcoll._guard import watchdog as _watchdog

    with _stderr_and_watchdog(1.0) as err:
        first = _watchdog.watch(lambda seconds: "first")
        second = _watchdog.watch(lambda seconds: f"second, after {seconds:.0f} s")
        first.__exit__(None, None, None)
        time.sleep(3.0)  # (the delay, a poll of the thread's old period, and room)
        second.__exit__(None, None, None)
    assert err.getvalue() == "second, after 1 s\n"


def test_a_diagnosis_that_fails_still_says_that_a_call_has_waited():
    from xcoll._guard import watchdog as _watchdog

    def broken(seconds: float) -> str:
        raise RuntimeError("no account")

    with _stderr_and_watchdog(1.0) as err, _watchdog.watch(broken):
        time.sleep(3.0)  # (the delay, a poll of the thread's old period, and room)
    assert err.getvalue() == "xcoll: a call has waited 1 s (RuntimeError('no account'))\n"


@contextlib.contextmanager
def _stderr_and_watchdog(after: float):
    """Captures what the watchdog prints (it resolves sys.stderr when it
    prints), with its delay shortened to ``after`` seconds."""
    from xcoll._guard import watchdog as _watchdog

    saved, err = (_watchdog.AFTER, sys.stderr), io.StringIO()
    _watchdog.AFTER, sys.stderr = after, err
    try:
        yield err
    finally:
        _watchdog.AFTER, sys.stderr = saved


def _skipped(what: str):
    """The last rank skips a call on a fresh group whose timeout is 3 s (after
    a consistent first call, except where the skipped call is the first); the
    others' call waits. Returns their error and what the watchdog printed."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(timeout=datetime.timedelta(seconds=3))
    x = {"x": torch.ones(3)}
    if what != "first call":
        xcoll.reduce(x, group=group)
    outcome = "skipped"
    with _stderr_and_watchdog(1.0) as err:
        if rank != world - 1:
            try:
                _call_of(what, x, group)
                outcome = "returned"
            except RuntimeError as e:
                outcome = f"{type(e).__name__}: {e}"
    dist.barrier()  # (the skipping rank keeps its connections open meanwhile)
    dist.destroy_process_group(group)
    return outcome, err.getvalue()


def _call_of(what: str, x, group) -> None:
    if what == "always":
        with xcoll.consistency_checks("always"):
            xcoll.gather(x, group=group)
    elif what in ("first call", "later call"):
        xcoll.gather(x, group=group)
    elif what == "barrier":
        xcoll.barrier("end", group=group)
    elif what == "gather_object":
        xcoll.gather_object({"a": 1}, group=group)
    elif what == "broadcast_object":  # (from the missing rank: a star from src waits for it)
        xcoll.broadcast_object({"a": 1}, src=group.size() - 1, group=group)
    elif what == "sync_rng_state":
        xcoll.sync_rng_state(src=group.size() - 1, group=group)
    elif what == "uneven":
        xcoll.gather(x, uneven=True, group=group)
    else:
        raise AssertionError(what)


WAITS = [
    "first call",
    "always",
    "later call",
    "barrier",
    "gather_object",
    "broadcast_object",
    "sync_rng_state",
    "uneven",
]
NAMES = {"first call": "gather", "always": "gather", "later call": "gather", "uneven": "gather"}


# (every wait on W=4, two of them on W=2 as well: each case waits for the
# engine's timeout)
@pytest.mark.parametrize(
    "world, what",
    [("gloo-4", what) for what in WAITS] + [("gloo-2", "first call"), ("gloo-2", "uneven")],
)
def test_every_wait_for_a_missing_replica_is_diagnosed(world, what):
    pool = shared_pool(world)
    w = pool.world_size
    results = pool.run(_skipped, [what] * w, timeout=120)
    assert results[-1][0] == "skipped"
    name = f"xcoll.{NAMES.get(what, what)}"
    for rank, (outcome, printed) in enumerate(results[:-1]):
        assert outcome.startswith(f"RuntimeError: {name}: a collective did not complete"), (
            rank,
            outcome,
        )
        assert "(a replica that never arrived, or that the engine stopped. " in outcome, outcome
        assert f"xcoll: {name} on rank {rank} of the group" in printed, (rank, printed)
        assert "has waited 1 s for the other replicas" in printed, printed
        # the call in a line: its tree's leaves, or none (objects and RNG states travel as bytes)
        no_tree = ("barrier", "gather_object", "broadcast_object", "sync_rng_state")
        leaves = "no leaves" if what in no_tree else " leaf: "
        assert leaves in printed, (rank, printed)
        if what in ("barrier", "gather_object"):  # (calls without parameters)
            assert "; parameters: (none); no leaves" in printed, (rank, printed)


def _xla_first_call_skipped(_):
    if xcoll.rank() == 0:
        xcoll.gather({"x": torch.ones(2).to(device())})
    return "returned"


def test_an_xla_first_call_that_a_peer_skips_is_diagnosed_before_xla_aborts():
    from xcoll.testing import PoolCrashed, XlaPool

    with XlaPool(2, grace=2) as pool:
        with pytest.raises(PoolCrashed) as e:
            pool.run(_xla_first_call_skipped, [None, None], timeout=120)
    text = str(e.value)
    assert "xcoll: xcoll.gather on rank 0 has waited" in text, text
    assert text.index("xcoll: xcoll.gather") < text.index("Termination timeout"), text


# ---- messages -------------------------------------------------------------------


def test_public_exceptions_are_named_from_xcoll():
    assert repr(xcoll.CollectiveMismatchError("x")) == "CollectiveMismatchError('x')"
    assert xcoll.CollectiveMismatchError.__module__ == "xcoll"
    assert xcoll.ConcurrentCallError.__module__ == "xcoll"


def _barrier_tag(_):
    rank = xcoll.rank()
    try:  # (a later call shares a local error only when checked in full)
        with xcoll.consistency_checks("always"):
            xcoll.barrier(3 if rank == 0 else "end")
    except (TypeError, xcoll.CollectiveMismatchError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("world", ["gloo-2", "xla-cpu-2"])
def test_a_barrier_tag_that_is_not_a_str_is_named_on_every_replica(world):
    pool = shared_pool(world)
    zero, *others = pool.run(_barrier_tag, [None] * pool.world_size)
    assert zero.startswith("TypeError: barrier tag must be a str, got int"), zero
    for text in others:
        assert text == (
            "CollectiveMismatchError: xcoll.barrier: rank 0 raised before communicating "
            "(TypeError: barrier tag must be a str, got int)"
        ), text


def _subgroup_mismatch(_):
    import torch.distributed as dist

    rank = dist.get_rank()
    group = dist.new_group([1, 2, 3])
    text = "not a member"
    if rank in (1, 2, 3):
        try:
            with xcoll.consistency_checks("always"):
                xcoll.gather({"x": torch.ones(2 if rank == 1 else 3)}, group=group)
        except xcoll.CollectiveMismatchError as e:
            text = str(e)
    dist.destroy_process_group(group)
    return text


def test_sub_group_messages_say_which_ranks_they_name():
    results = shared_pool("gloo-4").run(_subgroup_mismatch, [None] * 4)
    assert "this replica (rank 0 of the group (global rank 1))" in results[1], results[1]
    assert "rank 1 of the group (global rank 2) has" in results[1], results[1]
    assert "item" not in results[1], results[1]


def _crossed(_):
    """Ranks 1 and 2 call on two overlapping groups in opposite orders: every
    first call waits for a rank that is in the other group's call."""
    import torch.distributed as dist

    rank = dist.get_rank()
    timeout = datetime.timedelta(seconds=3)
    low, high = dist.new_group([0, 1, 2], timeout=timeout), dist.new_group([1, 2, 3], timeout=timeout)
    order = {0: [low], 1: [low, high], 2: [high, low], 3: [high]}[rank]
    outcome = ""
    with _stderr_and_watchdog(1.0) as err:
        try:
            xcoll.reduce({"x": torch.ones(2)}, group=order[0])
            outcome = "returned"
        except RuntimeError as e:
            outcome = str(e)
    dist.barrier()
    for g in (low, high):
        dist.destroy_process_group(g)
    return outcome, err.getvalue()


def test_crossed_calls_on_overlapping_sub_groups_are_diagnosed():
    results = shared_pool("gloo-4").run(_crossed, [None] * 4, timeout=120)
    for rank, (outcome, printed) in enumerate(results):
        assert "xcoll.reduce: a collective did not complete" in outcome, (rank, outcome)
        assert "xcoll: xcoll.reduce on rank" in printed and "of the group (global rank" in printed, (
            rank,
            printed,
        )


def _skip_within_a_step(nested: bool):
    """A loop of 3 steps, each making two reduces of one signature; at step
    1 the last replica's own code raises before the first (caught inside the
    step block) and goes on to the second. Its second call meets the others'
    first: both are "call 0" of the step, so only their places tell them
    apart. Returns each step's results (or the error's text)."""
    rank, world = xcoll.rank(), xcoll.world_size()
    dev = device()
    out = []
    for i in range(3):
        # (uploads, not device arithmetic: on XLA the two calls' programs are one)
        x = torch.tensor([float(rank)]).to(dev)
        y = torch.tensor([10.0 * rank]).to(dev)
        try:
            with xcoll.step(i), xcoll.step("inner") if nested else contextlib.nullcontext():
                try:
                    if i == 1 and rank == world - 1:
                        raise ValueError("a bad batch")
                    a = xcoll.reduce({"x": x})["x"].item()
                except ValueError:
                    a = None
                b = xcoll.reduce({"x": y})["x"].item()
            out.append(("ok", i, a, b))
        except xcoll.CollectiveMismatchError as e:
            out.append(("mismatch", i, str(e)))
            break
    return out


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("world", WORLDS)
def test_a_call_skipped_inside_a_step_raises_at_the_next_call_naming_both_places(world, nested):
    pool = shared_pool(world)
    w = pool.world_size
    total = sum(range(w))
    for rank, steps in enumerate(pool.run(_skip_within_a_step, [nested] * w)):
        assert steps[0] == ("ok", 0, total, 10.0 * total), (rank, steps)
        assert len(steps) == 2, (rank, steps)  # never a result paired with the other call
        kind, i, text = steps[1]
        assert (kind, i) == ("mismatch", 1), (rank, steps)
        # both places, each "line <n> in <function>"
        places = re.findall(r"call 0 at (line \d+ in _skip_within_a_step)", text)
        assert len(set(places)) == 2, text


def _branches_on_the_rank(tagged: bool):
    """One collective that rank 0 makes from one line and the others from
    another, inside a step: a correct program once the call has one tag."""
    rank = xcoll.rank()
    x = torch.tensor([float(rank)]).to(device())
    tag = "seed" if tagged else None
    try:
        with xcoll.step(0):
            if rank == 0:
                out = xcoll.broadcast({"x": x}, tag=tag)
            else:
                out = xcoll.broadcast({"x": x}, tag=tag)
    except xcoll.CollectiveMismatchError as e:
        return str(e)
    return out["x"].item()


@pytest.mark.parametrize("world", ["gloo-2", "xla-cpu-2"])
def test_one_call_made_from_two_lines_in_a_step_pairs_with_one_tag(world):
    pool = shared_pool(world)
    w = pool.world_size
    assert pool.run(_branches_on_the_rank, [True] * w) == [0.0] * w
    # untagged, the two places differ: named on the receivers (gloo's
    # broadcast is a star from src, whose result is its own either way)
    for rank, text in enumerate(pool.run(_branches_on_the_rank, [False] * w)):
        if rank or world.startswith("xla"):
            assert isinstance(text, str) and "in _branches_on_the_rank" in text, (rank, text)


def _helper(tree):
    """A user's helper around xcoll: the place of its call is its own line,
    and the lines that called it."""
    return xcoll.reduce(tree)


def _skip_through_a_helper(_):
    rank, world = xcoll.rank(), xcoll.world_size()
    x = torch.tensor([float(rank)]).to(device())
    y = torch.tensor([10.0 * rank]).to(device())
    try:
        with xcoll.step(0):
            try:
                if rank == world - 1:
                    raise ValueError("a bad batch")
                _helper({"x": x})
            except ValueError:
                pass
            return ("ok", _helper({"x": y})["x"].item())
    except xcoll.CollectiveMismatchError as e:
        return ("mismatch", str(e))


@pytest.mark.parametrize("world", ["gloo-2", "xla-cpu-4"])
def test_a_skip_through_a_helper_is_named_by_the_lines_that_called_it(world):
    pool = shared_pool(world)
    for rank, (kind, text) in enumerate(pool.run(_skip_through_a_helper, [None] * pool.world_size)):
        assert kind == "mismatch", (rank, text)
        assert "in _helper <- line " in text, text


def _one_backward_each(step: bool):
    """Two differentiable gathers A and B of one signature; rank 0's loss
    uses A only, the others' B only: each backward would pair with the other
    call's backward (the same signature, the same tag)."""
    dev = device()
    x = torch.tensor([1.0, 2.0]).to(dev).requires_grad_()
    try:
        with xcoll.step(0) if step else contextlib.nullcontext():
            a = xcoll.gather({"x": x}, grad=True)["x"]
            b = xcoll.gather({"x": x}, grad=True)["x"]
            (a if xcoll.rank() == 0 else b).sum().backward()
            xcoll.sync()
    except xcoll.CollectiveMismatchError as e:
        return str(e)
    return x.grad.cpu().tolist()


@pytest.mark.parametrize("step", [False, True])
@pytest.mark.parametrize("world", WORLDS)
def test_backwards_of_different_calls_never_pair(world, step):
    pool = shared_pool(world)
    for rank, text in enumerate(pool.run(_one_backward_each, [step] * pool.world_size)):
        assert isinstance(text, str), (rank, text)  # never a gradient
        assert "xcoll.gather backward" in text, text
        # named by the forward's number, or in a step by its step tag, whose
        # place is the program's one frame (not autograd's nor xcoll's)
        numbers = re.findall(r"backward of (call \d+|step 0, call \d+ at line \d+ in _one_backward_each)(?:;|$)", text)
        assert len(set(numbers)) == 2, text


def _long_tags(_):
    """Tags of a million characters that differ only at their end."""
    x = torch.ones(2).to(device())
    try:
        xcoll.gather({"x": x}, tag="t" * 10**6 + str(xcoll.rank()))
    except xcoll.CollectiveMismatchError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("world", WORLDS)
def test_a_long_tag_is_cut_in_messages(world):
    pool = shared_pool(world)
    for text in pool.run(_long_tags, [None] * pool.world_size):
        assert len(text) < 1000, text[:2000]  # (each tag's 1 MB, in full, before the cut)
        # the two tags, cut, differ by the hash of the whole
        hashes = re.findall(r"tag='t+\.\.\. \(sha256 ([0-9a-f]{16})\)", text)
        assert len(set(hashes)) == 2, text


def _recovers_with_steps(_):
    """At step 0 the last replica's own call raises on it alone (a leaf that
    is not a tensor: it counts there, not elsewhere) and the step's next
    call meets the others' first: every replica raises and the loop goes
    on. At step 1 a differentiable gather's backward is named by its step,
    which has realigned: the gradients are right."""
    rank, world = xcoll.rank(), xcoll.world_size()
    dev = device()
    out = []
    # (a group's first call is checked in full, which would share the error)
    xcoll.reduce({"x": torch.ones(1).to(dev)})
    for i in range(2):
        x = torch.tensor([float(rank + 1)]).to(dev)
        try:
            with xcoll.step(i):
                if i == 0:
                    try:
                        if rank == world - 1:
                            xcoll.reduce({"x": x, "bad": "not a tensor"})
                    except TypeError:
                        pass
                    xcoll.reduce({"x": x})
                    out.append("no error")
                else:
                    p = x.clone().requires_grad_()
                    g = xcoll.gather({"p": p}, grad=True)["p"]
                    (g * g).sum().backward()
                    xcoll.sync()
                    out.append(p.grad.cpu().tolist())
        except xcoll.CollectiveMismatchError:
            out.append("mismatch")
    # and outside any step: the call that raised on one replica alone took no
    # number there, so an untagged backward (named by its forward's number)
    # pairs with the same call's on every replica
    p = torch.tensor([float(rank + 1)]).to(dev).requires_grad_()
    g = xcoll.gather({"p": p}, grad=True)["p"]
    (g * g).sum().backward()
    xcoll.sync()
    out.append(p.grad.cpu().tolist())
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_after_a_mismatch_in_a_step_later_steps_backwards_pair_again(world):
    pool = shared_pool(world)
    w = pool.world_size
    for rank, out in enumerate(pool.run(_recovers_with_steps, [None] * w)):
        # d/dp of sum over replicas of sum(g*g) = 2 p * W (each replica's loss sees every p)
        grad = [2.0 * (rank + 1) * w]
        assert out == ["mismatch", grad, grad], (rank, out)


def _deep(n: int, x):
    """A call made ``n`` frames below its caller (a user's recursive helper)."""
    if n:
        return _deep(n - 1, x)
    return xcoll.reduce(x)


@contextlib.contextmanager
def _ends_raising(start: str):
    """The block raises CollectiveMismatchError, its text starting ``start``
    (a step inside which a call raised it raises it again at its end)."""
    try:
        yield
    except xcoll.CollectiveMismatchError as e:
        assert str(e).startswith(start), str(e)
    else:
        raise AssertionError(f"no error starting {start!r}")


def _tags_read_whole(_):
    """Four mismatches (rank 0 against the others) whose tags the test reads
    whole: nested blocks with a call's own tag=, a place more than 8 frames
    deep, and tags whose text is 80 and 81 characters long."""
    rank = xcoll.rank()
    x = torch.ones(1).to(device())
    texts = []

    def mismatch(**kwargs):
        try:
            xcoll.reduce(x, **kwargs)
        except xcoll.CollectiveMismatchError as e:
            texts.append(str(e).rpartition("the first difference: ")[2])

    with _ends_raising("xcoll.step(3): "), xcoll.step("eval"), xcoll.step(3):
        xcoll.reduce(x)
        mismatch(tag="a" if rank == 0 else "b")
    with _ends_raising("xcoll.step(0): "), xcoll.step(0):
        try:
            _deep(10 if rank == 0 else 0, x)  # (the line the test names)
        except xcoll.CollectiveMismatchError as e:
            texts.append(str(e).rpartition("the first difference: ")[2])
    for n in (78, 79):  # (a tag's text is its repr: n + 2 characters)
        mismatch(tag=("t" if rank == 0 else "u") * n)
    return texts


def test_a_calls_tag_is_read_whole_in_messages():
    """A tag's exact text: the blocks outermost first, the call's number in
    the innermost, its own tag=; a place of 8 frames at most, innermost
    first, up to the block's own line; a text of 80 characters kept whole,
    a longer one cut to 56 and the whole's hash."""
    import hashlib
    import inspect

    line = _deep.__code__.co_firstlineno
    call, recurse = f"line {line + 4} in _deep", f"line {line + 3} in _deep"
    deep = " <- ".join([call] + [recurse] * 7)
    lines, first = inspect.getsourcelines(_tags_read_whole)
    (k,) = [k for k, text in enumerate(lines) if "(the line the test names)" in text]
    shallow = f"{call} <- line {first + k} in _tags_read_whole"

    def cut(text):
        return f"{text[:56]}... (sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]})"

    for rank, texts in enumerate(shared_pool("gloo-2").run(_tags_read_whole, [None] * 2)):
        if rank == 0:
            mine, theirs = ("t", "a", deep), ("u", "b", shallow)
        else:
            mine, theirs = ("u", "b", shallow), ("t", "a", deep)
        pair = f"this replica (rank {rank}) has tag: {{}}; rank {1 - rank} has tag: {{}}".format
        assert texts == [
            pair(f"step 'eval'/3, call 1; tag='{mine[1]}'", f"step 'eval'/3, call 1; tag='{theirs[1]}'"),
            pair(f"step 0, call 0 at {mine[2]}", f"step 0, call 0 at {theirs[2]}"),
            pair(f"tag='{mine[0] * 78}'", f"tag='{theirs[0] * 78}'"),
            pair(f"tag={cut(repr(mine[0] * 79))}", f"tag={cut(repr(theirs[0] * 79))}"),
        ], texts


@pytest.mark.parametrize("tag", [True, 1.0, None, b"x"])
def test_a_step_tag_that_is_not_a_str_or_int_is_refused(tag):
    # (a bool is an int to Python, but True and 1 would name one step)
    with pytest.raises(TypeError, match=f"a step or call tag must be a str or an int, got {type(tag).__name__}"):
        xcoll.step(tag)


def test_a_long_tag_with_a_lone_surrogate_is_accepted():
    # (a file name that os.fsdecode could not decode; its repr escapes the surrogate)
    tag = "run-\udcff" * 20
    with xcoll.step(tag):
        assert xcoll.reduce(torch.ones(1), tag=tag).tolist() == [1.0]


#: A user's helper module, compiled twice under two file names (two copies
#: of one script): the same lines in two code objects.
_HELPERS = '''
class Metrics:
    def log(self, first, x):
        if first:
            return xcoll.reduce(x)
        return xcoll.reduce(x)
'''


def _helpers(name: str):
    namespace = {"xcoll": xcoll, "__name__": name}
    exec(compile(_HELPERS, f"{name}.py", "exec"), namespace)
    return namespace["Metrics"]()


def _places_met_again(_):
    """Each step's one call, made from one line of this loop through a
    helper method: step 0 the same on every replica; step 1 rank 0's from
    the helper's other line; step 2 rank 0's from the other copy of the
    helper, at the same lines. Returns each step's outcome."""
    rank = xcoll.rank()
    x = torch.ones(1).to(device())
    a, b = _helpers("helpers_a"), _helpers("helpers_b")
    calls = [(a, True), (a, rank != 0), (b if rank == 0 else a, True)]
    out = []
    for i, (helper, first) in enumerate(calls):
        try:
            with xcoll.step(i):
                helper.log(first, x)
            out.append("ok")
        except xcoll.CollectiveMismatchError as e:
            out.append(str(e).rpartition("the first difference: ")[2])
    return out


def test_a_place_met_again_from_other_lines_is_told_apart_and_from_a_copy_of_its_file_is_not():
    """A call's place is known again by every frame's code and line, not
    by the frame that opened the step alone, nor by the lines alone; each
    frame named by its qualified name, not its file: the same code in a
    file of another name (a copy, a link, a notebook cell named per
    replica) is the same place."""
    line = 5  # (the first return in _HELPERS, its 5th line)
    for rank, out in enumerate(shared_pool("gloo-2").run(_places_met_again, [None] * 2)):
        assert out[0] == out[2] == "ok", (rank, out)
        mine, theirs = f"line {line + 1} in Metrics.log", f"line {line} in Metrics.log"
        if rank:
            mine, theirs = theirs, mine
        assert re.fullmatch(
            rf"this replica \(rank {rank}\) has tag: step 1, call 0 at {mine} <- "
            rf"line \d+ in _places_met_again; rank {1 - rank} has tag: "
            rf"step 1, call 0 at {theirs} <- line \d+ in _places_met_again",
            out[1],
        ), (rank, out[1])


def _numbered_backwards(_):
    """In a new thread (whose calls are numbered from 0): a reduce, then
    two differentiable gathers of one signature, and each replica's loss
    through a different one (rank 0's through the first)."""
    rank = xcoll.rank()
    out = []

    def run():
        x = torch.ones(2).requires_grad_()
        xcoll.reduce(x)
        a = xcoll.gather({"x": x}, grad=True)["x"]
        b = xcoll.gather({"x": x}, grad=True)["x"]
        try:
            (a if rank == 0 else b).sum().backward()
        except xcoll.CollectiveMismatchError as e:
            out.append(str(e))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out


def test_an_untagged_backward_is_named_by_its_forwards_number_in_its_thread():
    mine = {0: "backward of call 1", 1: "backward of call 2"}
    for rank, out in enumerate(shared_pool("gloo-2").run(_numbered_backwards, [None] * 2)):
        assert out == [
            f"xcoll.gather backward: replicas made different calls; the first difference: "
            f"this replica (rank {rank}) has tag: {mine[rank]}; rank {1 - rank} has tag: {mine[1 - rank]}"
        ], (rank, out)


# ---- a skip inside a step: every replica raises by the block's end ---------------


def _skip_inside_a_step(pattern: str):
    """The last replica's own code raises (caught) before one call of a
    loop inside a step, whose calls come from one line: the block's error
    text on this replica (or "returned"), then a consistent call's result."""
    rank, w, dev = xcoll.rank(), xcoll.world_size(), device()
    skipper = rank == w - 1
    got: dict = {}
    xcoll.barrier()  # (a group's first call is checked in full: these are not)
    try:
        with xcoll.step(0):
            if pattern == "metric keys":
                for i, key in enumerate(("loss", "acc", "count")):
                    try:
                        if skipper and key == "acc":
                            raise KeyError(key)
                        got[key] = xcoll.reduce(torch.full((2,), float(i + 1)).to(dev))
                    except Exception:  # (as loops that go on past a bad key do)
                        continue
            elif pattern == "an epoch":
                for batch in range(3):
                    try:
                        if skipper and batch == 1:
                            raise ValueError("a bad batch")
                        got[batch] = xcoll.gather(torch.full((2,), float(10 * batch + rank)).to(dev))
                    except Exception:
                        continue
            elif pattern == "two calls on one line":
                for i in range(2):
                    got[i] = (xcoll.reduce(torch.ones(1).to(dev)) if not (skipper and i == 0) else None), xcoll.reduce(torch.full((1,), 7.0).to(dev))
            else:  # snippets run with exec, from one loop line
                for i in range(3):
                    code = f"if skipper and {i} == 1: raise KeyError({i})\ngot[{i}] = xcoll.reduce(torch.full((2,), {i + 1.0}).to(dev))"
                    try:
                        exec(code, {"xcoll": xcoll, "torch": torch, "dev": dev, "skipper": skipper, "got": got})
                    except Exception:  # (as loops that go on past a bad key do)
                        continue
        text = "returned"
    except xcoll.CollectiveMismatchError as e:
        text = str(e)
    return text, xcoll.reduce(torch.ones(1).to(dev)).item()


@pytest.mark.parametrize("pattern", ["metric keys", "an epoch", "two calls on one line", "exec"])
@pytest.mark.parametrize("world", WORLDS)
def test_a_skip_inside_a_step_raises_on_every_replica_by_the_blocks_end(world, pattern):
    # (the skipped call's place and number agree with the others' next call:
    # they pair, and only the block's end can tell; no result leaves it)
    pool = shared_pool(world)
    w = pool.world_size
    for r, (text, after) in enumerate(pool.run(_skip_inside_a_step, [pattern] * w, timeout=120)):
        assert text.startswith(("xcoll.step", "xcoll.reduce", "xcoll.gather")), (r, text)
        if r == w - 1:  # (its end met another replica's call, and names both)
            assert "has call xcoll.step; rank " in text, (r, text)
        assert after == w, (r, text)  # (the group goes on)


# ---- correct programs whose stacks differ: a step's places agree -------------------


@contextlib.contextmanager
def _my_step(i):
    """A user's own context manager around a step."""
    with xcoll.step(i):
        yield


def _opened_by_my_step(x):
    with _my_step(0):
        return xcoll.reduce(x), xcoll.reduce(x * 10)


def _frames_above(n: int, fn, *args):
    """``fn(*args)`` called ``n`` frames further down."""
    return fn(*args) if n == 0 else _frames_above(n - 1, fn, *args)


def _two_calls(x):
    """A step body: compiled on one replica, eager on the others (each call
    a graph break, the second one's frame Dynamo's resume function)."""
    a = xcoll.reduce(x)
    return a, xcoll.reduce(x * 10)


_CELL = """
def cell(x):
    return xcoll.reduce(x), xcoll.reduce(x * 10)
"""


def _helper_module(path: str):
    import importlib.util

    name = pathlib.Path(path).stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _correct_program(args: tuple[str, str]):
    """A correct program whose replicas' stacks differ at each call of a
    step: its two results (or the error's text)."""
    program, folder = args
    rank = xcoll.rank()
    x = torch.tensor([rank + 1.0]).to(device())
    try:
        if program == "own context manager":  # (a frame more above it on rank 0)
            out = _frames_above(1 if rank == 0 else 0, _opened_by_my_step, x)
        else:
            if program == "compiled on one replica":
                body = torch.compile(_two_calls, backend="aot_eager") if rank == 0 else _two_calls
            elif program == "notebook cells":  # (cells named per replica, as IPython numbers them)
                namespace = {"xcoll": xcoll}
                exec(compile(_CELL, f"<ipython-input-{rank + 3}-5b7c0a>", "exec"), namespace)
                body = namespace["cell"]
            else:  # one file under two names: rank 0 imports it through a link
                body = _helper_module(f"{folder}/{'linked' if rank == 0 else 'helpers'}.py").cell
            with xcoll.step(0):
                out = body(x)
    except xcoll.CollectiveMismatchError as e:
        return str(e)
    return [t.item() for t in out]


PROGRAMS = ["own context manager", "compiled on one replica", "notebook cells", "a file under two names"]


@pytest.mark.parametrize("program", PROGRAMS)
@pytest.mark.parametrize("world", WORLDS)
def test_a_correct_program_whose_stacks_differ_runs_in_a_step(world, program, tmp_path):
    # (the frames that are not the program's own: a launcher's, torch's,
    # contextlib's, the file's name; the block's end agrees too)
    (tmp_path / "helpers.py").write_text("import xcoll\n" + _CELL)
    (tmp_path / "linked.py").symlink_to(tmp_path / "helpers.py")
    pool = shared_pool(world)
    w = pool.world_size
    total = w * (w + 1) / 2
    assert pool.run(_correct_program, [(program, str(tmp_path))] * w) == [[total, 10 * total]] * w
