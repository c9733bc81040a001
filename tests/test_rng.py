"""sync_rng_state: replica src's generator states everywhere, in one call."""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest
import torch

import xcoll
from tests.replicas import counters, device, shared_pool


def _sync_then_draw(src):
    rank, dev = xcoll.rank(), device()
    g = torch.Generator().manual_seed(100 + rank)  # one per replica, passed in
    on_xla = dev.type == "xla"
    if on_xla:  # the CPU, Python and NumPy generators are shared by the replica threads
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(1000 + rank, dev)
    else:
        torch.manual_seed(rank)
        random.seed(rank)
        np.random.seed(rank)
    synced = xcoll.sync_rng_state(src=src, generators=[g])
    out = {"generator": torch.rand(3, generator=g)}
    if on_xla:
        out["xla seed"] = xm.get_rng_state(dev)  # (drawing advances it)
        out["xla"] = torch.rand(3, device=dev).cpu()
        xcoll.barrier()  # (every replica set the shared ones: now each draws from one stream)
        shared = torch.rand(3)
        xcoll.barrier()
        return out, synced, shared
    out.update(torch=torch.rand(3), python=random.random(), numpy=float(np.random.rand()))
    return out, synced, None


def test_every_generator_draws_what_src_draws(pool):
    w = pool.world_size
    src = w - 1
    results, synced, shared = zip(*pool.run(_sync_then_draw, [src] * w), strict=True)
    # what it says it synced: on XLA:CPU replica threads, not the generators
    # they share (each draw moves them on for every replica)
    if pool.device_type == "xla" and w > 1:
        assert synced == (("xla", "generators[0]"),) * w, synced
        assert not torch.equal(shared[0], shared[1]), shared  # (why they are not named)
    elif pool.device_type == "xla":  # (one replica: nothing shared)
        assert synced == (("torch", "python", "numpy", "xla", "generators[0]"),), synced
    else:
        assert synced == (("torch", "python", "numpy", "generators[0]"),) * w, synced
    assert torch.equal(
        results[0]["generator"], torch.rand(3, generator=torch.Generator().manual_seed(100 + src))
    )
    if pool.device_type == "xla":
        # src's state after the sync of its pending work (a sync moves the XLA
        # seed on from the one set), on every replica
        assert all(r["xla seed"] == results[src]["xla seed"] for r in results)
        assert all(torch.equal(r["xla"], results[0]["xla"]) for r in results)
    else:
        torch.manual_seed(src)
        random.seed(src)
        np.random.seed(src)
        assert torch.equal(results[0]["torch"], torch.rand(3))
        assert results[0]["python"] == random.random()
        assert results[0]["numpy"] == float(np.random.rand())
    for r in results[1:]:
        assert r.keys() == results[0].keys()
        for k in r:
            assert torch.equal(torch.as_tensor(r[k]), torch.as_tensor(results[0][k])), k


@pytest.mark.parametrize("setting", ["XLA_USE_32BIT_LONG", "XLA_USE_BF16"])
def test_states_cross_the_dtypes_an_xla_setting_narrows(setting):
    """torch_xla's settings that keep int64 as int32 or floats as bfloat16
    would change a state in transit (Python's and NumPy's hold int64 and
    float64 values): the states travel as their bytes."""
    pytest.importorskip("torch_xla")
    from xcoll.testing import XlaPool

    with XlaPool(2, env={setting: "1"}) as pool:
        results = [r for r, _, _ in pool.run(_sync_then_draw, [1, 1])]
        pool.run(_cached_gaussians, [None, None])
        kept = pool.run(_shared_states_kept, [None, None])
    want = torch.rand(3, generator=torch.Generator().manual_seed(101))
    assert all(torch.equal(r["generator"], want) for r in results), results
    assert results[0]["xla seed"] == results[1]["xla seed"]
    assert torch.equal(results[0]["xla"], results[1]["xla"])
    # Python's and NumPy's states (their int64 words, their cached float
    # gaussians) bit for bit: the replica threads share them, so a sync from
    # either gives back what both held
    assert kept == [True, True]


def _cached_gaussians(_):
    random.seed(7)
    random.gauss(0.0, 1.0)  # (caches its second value: a float in the state)
    np.random.seed(7)
    np.random.standard_normal()  # (likewise NumPy's legacy generator)


def _python_and_numpy():
    _, keys, pos, has_gauss, cached = np.random.get_state()
    return random.getstate(), (keys.tolist(), pos, has_gauss, repr(cached))


def _shared_states_kept(_):
    before = _python_and_numpy()
    assert before[0][2] is not None and before[1][2] == 1  # (a cached gaussian each)
    xcoll.sync_rng_state(src=1)
    return _python_and_numpy() == before


def _later_tags_differ(_):
    """A group's first call (checked in full), then a sync whose tags
    differ: only the guard's header can tell."""
    xcoll.reduce(torch.ones(1).to(device()))
    try:
        xcoll.sync_rng_state(tag="a" if xcoll.rank() == 0 else "b")
    except xcoll.CollectiveMismatchError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("world", ["gloo-2", "xla-cpu-2"])
def test_a_later_sync_whose_tags_differ_raises(world):
    # (on gloo the states follow a small guarded call, which every replica
    # reads: src raises too)
    first, second = shared_pool(world).run(_later_tags_differ, [None, None])
    for rank, (mine, theirs), text in [(0, "ab", first), (1, "ba", second)]:
        assert text == (
            "xcoll.sync_rng_state: replicas made different calls; the first difference: this "
            f"replica (rank {rank}) has tag: tag='{mine}'; rank {1 - rank} has tag: tag='{theirs}'"
        ), text


def _sync(_):
    xcoll.sync_rng_state()


def test_two_executions_per_replica_on_xla(xla4):
    # a small guarded call first (the states' count: the program every small
    # call shares, which a replica making another call meets), then the
    # states, unguarded
    w = xla4.world_size
    xla4.run(_sync, [None] * w)  # compile
    before = xla4.run(counters)[0]
    xla4.run(_sync, [None] * w)
    after = xla4.run(counters)[0]
    assert after["executions"] - before["executions"] == 2 * w
    assert after["compiles"] - before["compiles"] == 0


def test_state_round_trip_in_one_process():
    g = torch.Generator().manual_seed(5)
    state = xcoll.rng_state([g])
    first = (torch.rand(2), random.random(), np.random.rand(), torch.rand(2, generator=g))
    xcoll.set_rng_state(state, [g])
    again = (torch.rand(2), random.random(), np.random.rand(), torch.rand(2, generator=g))
    assert (
        torch.equal(first[0], again[0])
        and first[1:3] == again[1:3]
        and torch.equal(first[3], again[3])
    )
    with pytest.raises(ValueError, match="1 generators, 0 were passed"):
        xcoll.set_rng_state(state)


@pytest.mark.parametrize("cached", [False, True], ids=["no gaussian cached", "a gaussian cached"])
def test_pythons_cached_gaussian_round_trips(cached):
    # (random.gauss computes two values and keeps the second for its next call)
    random.seed(3)
    if cached:
        random.gauss(0.0, 1.0)
    state = xcoll.rng_state()
    first = [random.gauss(0.0, 1.0) for _ in range(3)]
    xcoll.set_rng_state(state)
    assert [random.gauss(0.0, 1.0) for _ in range(3)] == first


def _xla_seeds(seeds):
    import torch_xla.core.xla_model as xm

    out = []
    for seed in seeds:
        xm.set_rng_state(seed, device())
        state = xcoll.rng_state()
        xm.set_rng_state(7, device())
        xcoll.set_rng_state(state)
        out.append((state["xla"], xm.get_rng_state(device())))
    return out


def test_xla_seeds_of_64_bits_round_trip_as_the_int64_of_their_bits():
    # (torch_xla's seed is a uint64; a state's ints travel as int64)
    seeds = [0, 2**63 - 1, 2**63, 2**63 + 5, 2**64 - 1]
    got = shared_pool("xla-cpu-1").run(_xla_seeds, [seeds])[0]
    assert got == [(s - 2**64 if s >= 2**63 else s, s) for s in seeds], got


_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda: no CUDA device here")


@_NO_CUDA
def test_cuda_generators_round_trip():
    torch.cuda.init()
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    state = xcoll.rng_state()
    assert len(state["cuda"]) == len(devices)
    first = [torch.rand(3, device=d) for d in devices]
    xcoll.set_rng_state(state)
    assert all(torch.equal(torch.rand(3, device=d), f) for d, f in zip(devices, first, strict=True))


@_NO_CUDA
def test_reading_the_states_leaves_cuda_uninitialised():
    # (a process that never used CUDA, as a forked worker must not have)
    code = "import torch, xcoll; s = xcoll.rng_state(); print(torch.cuda.is_initialized(), 'cuda' in s)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"], out


def test_a_state_whose_tensors_are_views_is_applied():
    # (what a collective may return: a strided view into its buffer, which
    # torch.set_rng_state refuses as it is)
    state = xcoll.rng_state()
    first = torch.rand(3)
    views = {**state, "torch": torch.stack([state["torch"]] * 2, 1)[:, 0]}
    xcoll.set_rng_state(views)
    assert torch.equal(torch.rand(3), first)


def _sync_with_pending_draws(_):
    import torch_xla

    dev = torch_xla.device()
    # a different number of pending (not yet executed) draws on each replica:
    # exactly when replicas need their generators synced
    pending = [torch.rand(3, device=dev) * 2 for _ in range(xcoll.rank() + 1)]
    xcoll.sync_rng_state()
    after = torch.rand(4, device=dev)
    return after.cpu(), [p.cpu() for p in pending]


@pytest.mark.parametrize("w", [2, 4])
def test_sync_with_pending_per_replica_work_on_xla(w):
    results = shared_pool(f"xla-cpu-{w}").run(_sync_with_pending_draws, [None] * w)
    for after, _ in results:
        assert torch.equal(after, results[0][0])
    assert [len(p) for _, p in results] == list(range(1, w + 1))
