"""The guard: a call that differs between replicas on a *later* call, in the
default mode (no description exchange), raises CollectiveMismatchError on
every replica, naming the first difference; no replica returns normally.

Each replica first makes a consistent call (its group's first call, which the
default mode checks in full), so the mismatch below is caught by the guard
header that travels inside the call's own collective.
"""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
import torch

import xcoll
from tests.replicas import device, processes, shared_pool

MISMATCH = "xcoll.CollectiveMismatchError"


def later_case(name: str, odd: bool, dev, rows: int = 2):
    """(function, tree, kwargs) for the odd replica or the others: the same
    buffer sizes on every replica, so the engine cannot notice. Each differs
    in one part of the fingerprint alone: a leaf's shape, dtype, path or op,
    the tree's structure, or a parameter. ``rows`` sets the size: with 2 the
    calls are small (:data:`xcoll._encode.pack.SMALL`), with 512 they are not."""
    t = torch.ones(rows, 3).to(dev)
    if name == "structure, list vs tuple":  # (the same paths, dtypes and shapes)
        return "gather", {"x": [t] if odd else (t,)}, {}
    if name == "parameter, gather dim":  # (dim -1 of a 1-d leaf is dim 0: the same output)
        return "gather", {"x": torch.ones(3 * rows).to(dev)}, {"dim": -1 if odd else 0}
    if name == "shape, same numel":
        return "gather", {"x": torch.ones(3, rows).to(dev) if odd else t}, {}
    if name == "dtype, same width":
        return "reduce", {"x": torch.ones(rows, 3, dtype=torch.int32).to(dev) if odd else t}, {}
    if name == "dict key":
        return "gather", {("loss" if odd else "acc"): t}, {}
    if name == "op sum vs max":
        return "reduce", {"x": t}, {"op": "max" if odd else "sum"}
    if name == "op sum vs mean":
        return "reduce", {"x": t}, {"op": "mean" if odd else "sum"}
    if name == "Python int vs float":
        return "reduce", {"x": 7 if odd else 7.0, **({"t": t} if rows > 2 else {})}, {}
    if name == "src":
        return "broadcast", {"x": t}, {"src": 1 if odd else 0}
    raise AssertionError(name)


# Classes whose replicas trace the same XLA program when the call is large
# (the others compile different programs, which XLA aborts on:
# test_different_programs_are_diagnosed); a small call's is the same program
# whatever the call (xcoll._backends.hosted).
SAME_PROGRAM = ["dict key", "src", "structure, list vs tuple", "parameter, gather dim"]
EVERY = [
    "structure, list vs tuple",
    "parameter, gather dim",
    "shape, same numel",
    "dtype, same width",
    "dict key",
    "op sum vs max",
    "op sum vs mean",
    "Python int vs float",
    "src",
]


def _later(case):
    """A consistent first call, then ``case``'s (name, rows) later call."""
    name, rows = case
    assert xcoll._guard.check.mode() == "guard"  # the default
    rank, world = xcoll.rank(), xcoll.world_size()
    dev = device()
    xcoll.gather({"warm": torch.ones(1).to(dev)})  # a consistent earlier call
    fn, tree, kwargs = later_case(name, rank == world - 1, dev, rows)
    out = getattr(xcoll, fn)(tree, **kwargs)
    return f"returned {out}"


def _ok(_):
    return xcoll.gather(xcoll.rank())


def _expect_every_rank_raises(pool, fn, args, text=None):
    w = pool.world_size
    failures = pool.run(fn, args, return_exceptions=True)
    assert all(not isinstance(f, str) for f in failures), failures
    assert [f.type_name for f in failures] == [MISMATCH] * w, failures
    if text:
        for r, f in enumerate(failures):
            assert text in f.message, (r, f.message)
    assert pool.run(_ok, [None] * w) == [list(range(w))] * w
    return failures


def _cases(world, rows=2):
    # (large calls on XLA: only the classes whose programs are the same)
    names = SAME_PROGRAM if rows > 2 else EVERY
    # gloo's broadcast is a star from src: with W=2 a differing src leaves each
    # replica its own tree (docs/reliability.md); at W=4 the receivers raise
    return [
        (world, n, rows)
        for n in names
        if not (n == "src" and world.startswith("gloo"))
    ]


@pytest.mark.parametrize(
    "world,name,rows",
    [c for w in ["gloo-2", "gloo-4", "xla-cpu-2"] for c in _cases(w)] + _cases("xla-cpu-2", 512),
)
def test_a_later_mismatch_raises_on_every_replica(world, name, rows):
    # (a small call on XLA is one program on every replica, whatever the call)
    pool = shared_pool(world)
    # every replica's error names the call, the first difference and both ranks
    args = [(name, rows)] * pool.world_size
    failures = _expect_every_rank_raises(pool, _later, args, "first difference")
    fn = later_case(name, False, "cpu")[0]
    assert all(f.message.startswith(f"xcoll.{fn}: ") for f in failures), failures


def test_a_calls_summary_names_its_parameters_and_first_lines():
    """The line that messages and the watchdog give a call: its tag and
    parameters, its number of leaves, its description's first three lines."""
    from xcoll._guard import check as _check
    from xcoll._guard import header as _header
    from xcoll._guard import verdict as _verdict

    def summary(n: int, tag: str = "") -> str:
        lines = [f"tree[{i}]: float32 tensor of shape (2)" for i in range(n)]
        lines += ["structure: PyTreeSpec([*])"] if n else []
        signature = _header.Signature("xcoll.gather", "dim=0", _check.Description(tuple(lines)), tag)
        return _verdict.summary(signature)

    head = "tag: (none); parameters: dim=0; "
    assert summary(0) == head + "no leaves"  # (objects: no description)
    empty = _check.Description(("structure: PyTreeSpec({})",))  # an empty tree
    assert _verdict.summary(_header.Signature("xcoll.gather", "dim=0", empty)) == head + "no leaves"
    assert summary(1) == head + "1 leaf: tree[0]: float32 tensor of shape (2); structure: PyTreeSpec([*])"
    leaf = "float32 tensor of shape (2)"
    assert summary(2) == head + f"2 leaves: tree[0]: {leaf}; tree[1]: {leaf}; structure: PyTreeSpec([*])"
    assert summary(3) == head + f"3 leaves: tree[0]: {leaf}; tree[1]: {leaf}; tree[2]: {leaf}; ..."
    assert summary(5, "step 2, call 0") == (
        f"tag: step 2, call 0; parameters: dim=0; 5 leaves: tree[0]: {leaf}; tree[1]: {leaf}; "
        f"tree[2]: {leaf}; ..."
    )


def test_the_watchdogs_diagnosis_names_the_call_and_what_to_do():
    from xcoll._guard import check as _check
    from xcoll._guard import header as _header
    from xcoll._guard import verdict as _verdict

    lines = ("tree['x']: float32 tensor of shape (2)", "structure: PyTreeSpec({'x': *})")
    description = _check.Description(lines)
    signature = _header.Signature("xcoll.reduce", "op=sum", description, "step 3, call 0")
    assert _verdict.diagnosis("rank 1", signature, 5.2) == (
        "xcoll: xcoll.reduce on rank 1 has waited 5 s for the other replicas. This replica's "
        "call: tag: step 3, call 0; parameters: op=sum; 1 leaf: tree['x']: float32 tensor of "
        "shape (2); structure: PyTreeSpec({'x': *}); description "
        f"{description.digest.hex()[:16]}. Causes that fit this wait: (1) a replica has not "
        "reached this call (its code raised before it and went on, or it is still in an "
        "earlier call; tag the calls, tag= or xcoll.step, to name a skipped one); (2) a "
        "replica made a different call whose buffers differ in size (XCOLL_CHECK=always names "
        "it). The engine then times out, or XLA aborts the process."
    )


def test_a_diagnosis_names_only_the_causes_that_fit_the_engine():
    from xcoll._guard import verdict as _verdict

    eager, lazy = _verdict.causes(False), _verdict.causes(True)
    # on torch.distributed: no program
    assert "has not reached this call" in eager and "(2) a replica made a different" in eager
    assert "programs" not in eager, eager
    assert "(3) the replicas' programs differ: " in lazy and "(4)" not in lazy, lazy


def test_a_world_of_one_starts_no_watch_and_sends_no_header():
    # nothing to wait for: a slow call (a first compile) must not print that
    # it waits for the other replicas; no replica to disagree with: no guard
    from xcoll import _backends
    from xcoll._guard import check as _check
    from xcoll._guard import entry as _entry
    from xcoll._guard import watchdog as _watchdog

    before = next(_watchdog._ids)
    assert xcoll.reduce({"x": torch.ones(2)})["x"].tolist() == [1.0, 1.0]
    xcoll.barrier("b")
    assert next(_watchdog._ids) == before + 1
    t = _backends.current()
    assert t.world == 1
    with _entry.entered(t, "xcoll.gather", "", _check.NO_TREE) as signature:
        assert signature is None


# ---- a verdict on every bit of the header -----------------------------------

# The fingerprint bit this thread's calls flip (None: none), while
# _flipped_fingerprints is installed: an XLA pool's replicas are the threads
# of one process.
_FLIP = threading.local()
# replica functions inside _flipped_fingerprints; the originals (fingerprint, header)
_installed: list = [0, None]
_install_lock = threading.Lock()


class _flipped_fingerprints:
    """Makes a call's fingerprint differ from the other replicas' in one bit
    alone (bit ``_FLIP.bit`` of its 64), on the threads that set one: the one
    difference a header can show that no real pair of calls makes to order
    (two fingerprints are SHA-256 digests). Each header is made from its
    fingerprint on each call meanwhile: the headers xcoll keeps are keyed by
    signature and shared by an XLA process's replica threads, where a
    flipped fingerprint would not reach them."""

    def __enter__(self):
        from xcoll._guard import header as _header

        with _install_lock:
            if not _installed[0]:
                _installed[1] = (_header.Signature.fingerprint, _header.Signature.header)
                original = _installed[1][0]

                def fingerprint(signature):
                    digest = original(signature)
                    bit = getattr(_FLIP, "bit", None)
                    if bit is None:
                        return digest
                    flipped = bytearray(digest)
                    flipped[bit // 8] ^= 1 << (bit % 8)
                    return bytes(flipped)

                def made(signature, g, transport):
                    return _header._on(transport, _header._build(signature.fingerprint(), g))

                _header.Signature.fingerprint = fingerprint
                _header.Signature.header = made
            _installed[0] += 1

    def __exit__(self, *exc):
        from xcoll._guard import header as _header

        _FLIP.bit = None
        with _install_lock:
            _installed[0] -= 1
            if not _installed[0]:
                _header.Signature.fingerprint, _header.Signature.header = _installed[1]


def _one_bit_differs(cases):
    """Each case's call once per bit, with that bit of the fingerprint flipped
    on one replica (rank ``bit % W``): what each call did."""
    rank, w = xcoll.rank(), xcoll.world_size()
    dev = device()
    xcoll.gather({"warm": torch.ones(1).to(dev)})  # (a group's first call is checked in full)
    outcomes = []
    with _flipped_fingerprints():
        for name, kwargs, dtype, bits in cases:
            tree = {"x": (torch.arange(6) % 3).to(dtype).to(dev)}
            for bit in bits:
                _FLIP.bit = bit if rank == bit % w else None
                try:
                    # (tagged: a tag is in the fingerprint, and in the text
                    # each replica's error names)
                    getattr(xcoll, name)(tree, **kwargs, tag=f"bit {bit}")
                    outcomes.append((name, bit, "returned"))
                except xcoll.CollectiveMismatchError as e:
                    outcomes.append((name, bit, f"{type(e).__name__}: {e}"))
                finally:
                    _FLIP.bit = None
    return outcomes


_EVERY_BIT = list(range(64))
_SOME_BITS = [0, 1, 7, 8, 31, 32, 33, 55, 56, 62, 63]
# Each kind of verdict (docs/design.md, "The guard"): a gather's 64 bits as
# 0/1, read on the device's result or the host's; a reduce's bits and their
# complements, in the first bucket's dtype, under each op; a broadcast's, summed
# (XLA) or src's compared by the receivers (gloo).
VERDICTS = [
    ("gather", {}, torch.float32, _EVERY_BIT),
    ("gather", {"to_cpu": True}, torch.int8, _SOME_BITS),
    ("reduce", {"op": "sum"}, torch.float32, _EVERY_BIT),
    ("reduce", {"op": "sum"}, torch.bfloat16, _SOME_BITS),
    ("reduce", {"op": "sum"}, torch.int8, _SOME_BITS),
    ("reduce", {"op": "prod"}, torch.int64, _SOME_BITS),
    ("reduce", {"op": "max"}, torch.float16, _SOME_BITS),
    ("reduce", {"op": "max"}, torch.bool, _SOME_BITS),
    ("reduce", {"op": "min"}, torch.float64, _SOME_BITS),
    ("reduce", {"op": "min"}, torch.uint8, _SOME_BITS),
    ("broadcast", {"src": 0}, torch.int32, _EVERY_BIT),
]


@pytest.mark.parametrize("world", ["gloo-2", "gloo-4", "xla-cpu-2"])
def test_a_header_that_differs_in_any_one_bit_is_a_clean_error_on_every_replica(world):
    """Where two replicas' fingerprints differ in one bit alone, at any of the
    64, whichever replica holds it: every replica raises
    CollectiveMismatchError (its descriptions agree, so it names no leaf), and
    none returns or waits for the others (a small broadcast's header is summed
    on every engine: every replica reads it)."""
    pool = shared_pool(world)
    w = pool.world_size
    got = pool.run(_one_bit_differs, [VERDICTS] * w, timeout=180)
    expected = (
        "the replicas' descriptions agree: their XCOLL_CHECK modes differ, a call "
        "overlapped another on this process group, or a header changed in transit"
    )
    for r, outcomes in enumerate(got):
        assert len(outcomes) == sum(len(bits) for *_, bits in VERDICTS)
        for name, bit, outcome in outcomes:
            assert expected in outcome, (r, name, bit, outcome)
    assert pool.run(_ok, [None] * w) == [list(range(w))] * w


def _after_rng(_):
    rank = xcoll.rank()
    xcoll.sync_rng_state()  # the first call on the group is not a gather
    metric = {("acc" if rank == 0 else "loss"): torch.tensor([1.5]).to(device())}
    return f"returned {xcoll.gather(metric)}"


@pytest.mark.parametrize("world", ["gloo-2", "xla-cpu-2"])
def test_a_metric_dict_keyed_differently_after_sync_rng_state(world):
    pool = shared_pool(world)
    _expect_every_rank_raises(pool, _after_rng, [None] * pool.world_size, "tree['acc']")


def _objects_later(kind):
    rank = xcoll.rank()
    xcoll.gather_object(rank)
    if kind == "broadcast_object src":
        return f"returned {xcoll.broadcast_object('x', src=rank)}"
    raise AssertionError(kind)


def test_object_calls_are_guarded():
    # (a barrier against a gather_object sends a different size: an engine
    # failure; on gloo a broadcast is a star from src: docs/reliability.md)
    pool = shared_pool("xla-cpu-2")
    _expect_every_rank_raises(pool, _objects_later, ["broadcast_object src"] * 2)


def _two_threads(_):
    """Two threads of each process call on the world group at once."""
    rank = xcoll.rank()
    outcomes = []
    start = threading.Barrier(2)

    def one(k):
        start.wait()
        try:
            for _ in range(20):
                got = xcoll.gather({"k": torch.tensor([100 * k + rank])})["k"].tolist()
                if got != [100 * k + r for r in range(xcoll.world_size())]:
                    outcomes.append(("wrong", got))
                    return
            outcomes.append(("ok", None))
        except xcoll.CollectiveMismatchError as e:
            outcomes.append((type(e).__name__, str(e)[:80]))
        except RuntimeError as e:  # a partner call the other replica refused
            outcomes.append(("RuntimeError", str(e)[:80]))

    threads = [threading.Thread(target=one, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def test_concurrent_calls_on_one_group_are_detected():
    from xcoll.testing import GlooPool

    with GlooPool(2, timeout=120, collective_timeout=5) as pool:
        results = pool.run(_two_threads, [None, None])
    kinds = [k for outcomes in results for k, _ in outcomes]
    assert "wrong" not in kinds, results
    assert "ConcurrentCallError" in kinds, results


def _overlap(t, error: Exception | None) -> dict:
    """A second thread enters a call while the first thread's is open (a
    call within its own call first: allowed), then the first leaves (raising
    ``error``, if given), then a third call enters: what each raised. Entered
    as public calls are, in mode "never": no check, no collective."""
    from xcoll._guard import check as _check
    from xcoll._guard import entry as _entry

    def entry(name):
        return _entry.entered(t, name, "", _check.NO_TREE)

    inside, overlapped, raised = threading.Event(), threading.Event(), {}

    def first():
        try:
            with xcoll.consistency_checks("never"), entry("xcoll.reduce"):
                with entry("xcoll.gather"):
                    pass
                inside.set()
                assert overlapped.wait(60), "the second call never came"
                if error is not None:
                    raise error
        except Exception as e:
            raised["first"] = f"{type(e).__name__}: {e}"

    # (bounded waits and a daemon thread: a failure on either side fails the
    # test instead of leaving the pool's worker waiting forever)
    thread = threading.Thread(target=first, name="first", daemon=True)
    thread.start()
    try:
        assert inside.wait(60), raised
        for label in ("second", "third"):
            try:
                with xcoll.consistency_checks("never"), entry(f"xcoll.{label}"):
                    raised[label] = "entered"
            except _entry.ConcurrentCallError as e:
                raised[label] = str(e)
            overlapped.set()
            thread.join(60)
    finally:
        overlapped.set()
    assert not thread.is_alive(), raised
    return raised


def _exclusive_messages(_):
    """On fresh groups (the shared pool's world group stays usable): an
    engine failure in a call; two threads' calls that overlap, the first
    ending normally, then with an error of its own."""
    import torch.distributed as dist

    from xcoll._backends.dist import DistTransport
    from xcoll._guard import check as _check
    from xcoll._guard import entry as _entry

    groups = [dist.new_group(), dist.new_group()]
    t = DistTransport(None, groups[0], groups[0])
    raised = {}
    try:
        with xcoll.consistency_checks("never"):
            with _entry.entered(t, "xcoll.broadcast", "src=0", _check.NO_TREE):
                raise _entry.EngineError("Timed out")
    except RuntimeError as e:
        raised["engine"] = str(e)
    raised.update(_overlap(t, None))
    raised["with an error"] = _overlap(DistTransport(None, groups[1], groups[1]), ValueError("a bad batch"))
    for group in groups:
        dist.destroy_process_group(group)
    return raised


def test_calls_of_two_threads_name_each_other_and_leave_the_group_unusable():
    pool = shared_pool("gloo-2")
    for rank, raised in enumerate(pool.run(_exclusive_messages, [None, None])):
        me = f"rank {rank} of the group (global rank {rank})"
        assert raised == {
            "second": (
                f"xcoll.second: called on {me} from thread 'MainThread' while another thread "
                "has a call in flight on the same process group; calls on one group must come "
                "from one thread at a time, in the same order on every replica. The group is "
                "unusable from now on: make a new one (on XLA, restart the replicas)"
            ),
            "first": (
                "ConcurrentCallError: xcoll.reduce: another thread called xcoll on the same process group while this "
                f"call ({me}, thread 'first') was in flight; its result may be paired with that "
                "call's on other replicas. The group is unusable from now on"
            ),
            "third": (
                f"xcoll.third: {me} made no collective: this process group is unusable since "
                f"two threads' calls overlapped on {me}; the other replicas' calls may have been "
                "paired differently. Make a new process group (on XLA, restart the replicas), "
                "and call from one thread at a time"
            ),
            "engine": (
                f"xcoll.broadcast: a collective did not complete on {me}: Timed out (a replica "
                "that never arrived, or that the engine stopped. A replica whose code raised "
                "before this call, and that went on, is one call behind: tag the calls (tag=, "
                "xcoll.step) to name it. gloo kills a rank that receives a larger buffer than "
                "its own, as when replicas' calls differ: XCOLL_CHECK=always names such a "
                "difference)"
            ),
            "with an error": {  # (the first's own error, not the overlap's)
                "first": "ValueError: a bad batch",
                "second": raised["second"],  # (the same words on the second group)
                "third": raised["third"],
            },
        }, raised


PROGRAMS = [n for n in EVERY if n not in SAME_PROGRAM]


def _aborted(name: str) -> str:
    """What a fresh XLA:CPU W=2 pool reports when its replicas' later call
    differs as ``name`` says (the replicas compile different programs), or,
    for ``"factor"``, when the calls agree but the work pending before them
    differs (:func:`_per_replica_factor`)."""
    from xcoll.testing import PoolCrashed, XlaPool

    fn = _per_replica_factor if name == "factor" else _later
    with XlaPool(2, grace=2) as pool:
        try:
            pool.run(fn, [(name, 512)] * 2)  # (large calls: small ones meet)
        except PoolCrashed as e:
            return str(e)
    return "the replicas returned"


def _per_replica_factor(case):
    """One call on every replica, but work pending before it that holds a
    per-replica op (rank 0 adds and subtracts ``o``): the
    replicas' programs differ (the user's, not xcoll's) where the call is in
    the program (``(rows, 3)`` float32: 512 rows make a large call, 2 a small
    one, whose collective is a program of its own). Returns the call's result."""
    _, rows = case
    dev = device()
    o = torch.ones(rows, 3).to(dev)
    o = o + o - o if xcoll.rank() == 0 else o  # (the same values, another program)
    return xcoll.reduce({"loss": o if rows > 2 else o.sum()})["loss"].cpu().sum().item()


def test_a_small_call_after_per_replica_pending_work_returns():
    # the pending work runs as each replica's own program, then the call's
    # collective as one program, the same on every replica
    pool = shared_pool("xla-cpu-2")
    w = pool.world_size
    assert pool.run(_per_replica_factor, [("factor", 2)] * w) == [6.0 * w] * w


def test_different_programs_are_diagnosed_before_xla_aborts():
    # XLA:CPU W=2: the replicas compile different programs and XLA aborts the
    # process after 10 s; xcoll's watchdog has printed its diagnosis at 5 s,
    # naming the programs among the causes (and not the PJRT client: the
    # pools run the synchronous one). A pool per difference, all at once:
    # each mostly waits for XLA's abort.
    names = [*PROGRAMS, "factor"]
    with concurrent.futures.ThreadPoolExecutor(len(names)) as ex:
        reports = dict(zip(names, ex.map(_aborted, names), strict=True))
    for name, text in reports.items():
        fn = "reduce" if name == "factor" else later_case(name, False, "cpu")[0]
        assert f"xcoll: xcoll.{fn} on rank" in text, (name, text)
        assert "XCOLL_CHECK=always" in text, (name, text)
        assert "(3) the replicas' programs differ: " in text, (name, text)
        # (and pending tensors held by garbage, which each replica frees at its own time)
        assert "only a reference cycle keeps alive" in text, (name, text)
        assert "PJRT CPU client" not in text, (name, text)
        assert text.index("xcoll: xcoll.") < text.index("Termination timeout"), (name, text)


def _small_later_difference(case: str):
    """After a consistent first call, the last replica's later call differs
    in its buffers' size: a metrics dict without one key, one leaf in
    float64, a gather of 3 elements against 2, a broadcast's tree without a
    key; a gather of 1001 elements against 1000, whose buffers (with the
    header) are just inside the size class. Returns the error's text, or the
    result; then a consistent call's."""
    rank, world = xcoll.rank(), xcoll.world_size()
    odd = rank == world - 1
    dev = device()
    m = {"acc": torch.tensor(0.25), "loss": torch.tensor(0.5), "n": torch.tensor(8)}
    m = {k: v.to(dev) for k, v in m.items()}
    xcoll.reduce(m)  # (a group's first call is checked in full: this one is not)
    later = dict(m)
    if odd and case in ("missing key", "broadcast"):
        del later["acc"]
    if odd and case in ("float64", "first bucket float64"):
        later["loss"] = later["loss"].double()
    if case == "first bucket float64":  # (the only float leaf: bucket 0's dtype differs)
        del later["acc"]
    try:
        if case == "gather":
            out = xcoll.gather({"x": torch.ones(3 if odd else 2).to(dev)})
        elif case == "gather of 4000 bytes":
            out = xcoll.gather({"x": torch.ones(1001 if odd else 1000).to(dev)})
        elif case == "broadcast":
            out = xcoll.broadcast(later)
        else:
            out = xcoll.reduce(later)
        text = f"no error: { {k: v.cpu() for k, v in out.items()} }"
    except xcoll.CollectiveMismatchError as e:
        text = str(e)
    return text, xcoll.reduce({"x": torch.ones(1).to(dev)})["x"].item()


@pytest.mark.parametrize(
    "case",
    ["missing key", "float64", "first bucket float64", "gather", "gather of 4000 bytes", "broadcast"],
)
@pytest.mark.parametrize("world", ["gloo-2", "gloo-4", "xla-cpu-2", "xla-cpu-4"])
def test_a_small_later_call_whose_sizes_differ_raises_on_every_replica(world, case):
    # small calls travel in one size class (gloo: their first collective,
    # XLA: the whole call, in one program): the replicas meet, and the
    # guard's header names the difference instead of the engine's abort
    pool = shared_pool(world)
    w = pool.world_size
    results = pool.run(_small_later_difference, [case] * w)
    for rank, (text, after) in enumerate(results):
        assert after == float(w), (rank, text)  # the replicas go on
        assert text.startswith("xcoll."), (rank, text)
        if case == "missing key":
            assert "tree['acc']" in text, (rank, text)
        if "float64" in case:
            assert "tree['loss']: float64 tensor" in text, (rank, text)


_SIZE_MISMATCH = """
import datetime, torch, torch.distributed as dist, xcoll
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
rank, world = dist.get_rank(), dist.get_world_size()
xcoll.gather({"x": torch.ones(2)})  # a consistent first call
# the last rank's buffer is larger, and both are above the size class of
# small calls (xcoll._encode.pack.SMALL bytes), which would meet
n = 2049 if rank == world - 1 else 2048
try:
    xcoll.gather({"x": torch.ones(n)})
    print("returned normally", flush=True)
except Exception as e:
    print(f"raised {type(e).__name__}: {e}", flush=True)
"""


@pytest.mark.parametrize("world", [2, 4])
def test_a_size_mismatch_on_gloo_kills_one_replica_and_the_others_raise(tmp_path, world):
    """gloo aborts the rank that receives more bytes than it expects; every
    other rank raises an xcoll error naming the call (processes started as
    torchrun starts them)."""
    outs = processes(tmp_path, _SIZE_MISMATCH, world)
    # (the survivors' exit status is gloo's teardown after a broken connection,
    # not this test's subject)
    assert outs[0][2] != 0, outs[0]
    assert "Received data size doesn't match expected size" in outs[0][1]
    for r in range(1, world):
        out = outs[r][0]
        assert "returned normally" not in out, (r, out)
        assert "raised" in out and "xcoll.gather" in out, (r, out)
        # the guard fired where rank 0's header arrived before its death; else
        # the engine's error names the likely cause (which one is timing)
        assert (
            "CollectiveMismatchError" in out and "tree['x']" in out
        ) or "replicas' calls differ" in out, out


_JUST_OVER = """
import datetime, sys, torch, torch.distributed as dist, xcoll
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=6))
name, big = sys.argv[1], int(sys.argv[2])
xcoll.gather({"x": torch.ones(2)})  # a consistent first call
# 952 float32 elements: a small call (its buffer and header within the size
# class, xcoll._encode.pack.SMALL); 1104 (4416 bytes): just over it
n = 1104 if dist.get_rank() == big else 952
try:
    getattr(xcoll, name)({"x": torch.arange(float(n))})
    print("returned normally", flush=True)
except Exception as e:
    print(f"raised {type(e).__name__}: {e}", flush=True)
"""


@pytest.mark.parametrize("big", [0, 1])
@pytest.mark.parametrize("name", ["gather", "reduce", "broadcast", "reduce_scatter", "all_to_all"])
def test_a_call_just_over_the_size_class_on_one_replica_has_its_documented_outcome(tmp_path, name, big):
    """docs/reliability.md: one replica's call just over 4 KiB against
    another's small one. A gather's first collectives are all-gathers of
    different sizes: gloo kills the replica that receives more than it
    expects, and the other raises naming the call. The other ops' first
    collectives differ in kind: both wait for the group's timeout (6 s here),
    with the watchdog's diagnosis after 5 s, then raise naming the call.
    Never a result."""
    outs = processes(tmp_path, _JUST_OVER, 2, name, str(big))
    for r, (out, _, _) in enumerate(outs):
        assert "returned normally" not in out, (r, out)
    small = 1 - big
    if name == "gather":
        assert outs[small][2] != 0 and "Received data size doesn't match expected size" in outs[small][1]
        # the guard's error where the killed replica's header arrived before
        # its death, else the engine's naming the call (which one is timing)
        told = ("CollectiveMismatchError: xcoll.gather: ", "RuntimeError: xcoll.gather: a collective did not complete")
        assert any(f"\nraised {t}" in "\n" + outs[big][0] for t in told), outs[big]
        return
    for r, (out, err, _) in enumerate(outs):
        assert f"\nraised RuntimeError: xcoll.{name}: a collective did not complete on rank {r}" in "\n" + out, (r, out, err)
        assert f"xcoll: xcoll.{name} on rank {r} has waited 5 s for the other replicas" in err, (r, err)


def _gloo_src(n):
    rank = xcoll.rank()
    xcoll.gather({"warm": torch.ones(1)})
    out = xcoll.broadcast({"x": torch.full((n,), float(rank))}, src=rank)  # each names itself
    return f"returned {out}"


def test_a_different_src_on_gloo_times_out_with_the_diagnosis():
    # gloo's broadcast is a star from src: in a call over 4 KiB, a replica
    # that names itself src waits for receivers that never come, until the
    # group's timeout; the watchdog names the call first (docs/reliability.md)
    from xcoll.testing import GlooPool

    with GlooPool(2, timeout=120, collective_timeout=7) as pool:
        failures = pool.run(_gloo_src, [2048, 2048], return_exceptions=True)
        logs = pool.stderr_tail()
    assert all(not isinstance(f, str) for f in failures), failures
    for f in failures:
        assert f.type_name == "builtins.RuntimeError", f
        assert "xcoll.broadcast: a collective did not complete" in f.message, f
    assert "xcoll: xcoll.broadcast on rank" in logs, logs


def test_a_small_broadcast_whose_src_differs_raises_on_every_replica():
    # (a small call is one all-gather, whatever its kind: the replicas meet)
    pool = shared_pool("gloo-2")
    failures = pool.run(_gloo_src, [2, 2], return_exceptions=True)
    for r, f in enumerate(failures):
        assert f.type_name == MISMATCH, f
        assert f"this replica (rank {r}) has parameters: src={r} " in f.message, f
    assert pool.run(_ok, [None, None]) == [[0, 1]] * 2


def _broadcast_keys(n):
    rank = xcoll.rank()
    dev = device()
    xcoll.gather({"warm": torch.ones(1).to(dev)})
    tree = {("a" if rank == 0 else "b"): torch.ones(n).to(dev), "z": torch.arange(5).to(dev)}
    return f"returned {sorted(xcoll.broadcast(tree, src=0))}"  # two buckets


def test_a_broadcast_receiver_raises_and_src_is_not_left_waiting():
    # gloo's broadcast is a star from src: in a call over 4 KiB, src learns
    # nothing and returns its own tree; the receiver takes part in both
    # buckets, then raises
    pool = shared_pool("gloo-2")
    out = pool.run(_broadcast_keys, [1100, 1100], return_exceptions=True)
    assert out[0] == "returned ['a', 'z']", out
    assert out[1].type_name == MISMATCH and "src, rank 0" in out[1].message, out
    assert pool.run(_ok, [None, None]) == [[0, 1]] * 2
    # a small call's header is summed, as XLA's every call's: every replica raises
    _expect_every_rank_raises(pool, _broadcast_keys, [4, 4])
    _expect_every_rank_raises(shared_pool("xla-cpu-2"), _broadcast_keys, [4, 4])


def _large_calls(_):
    """A call of each kind over the small size class (64 KiB): on gloo its
    header is read as the first collective arrives, from each of a gather's
    W rows (a reduce's and a broadcast's: the one row)."""
    r, w = xcoll.rank(), xcoll.world_size()
    x = torch.arange(16384.0).to(device()) + r
    tree = {"x": x, "n": torch.tensor([r, 7]).to(device())}
    got = xcoll.gather(tree, to_cpu=True)
    assert torch.equal(got["x"], torch.cat([torch.arange(16384.0) + k for k in range(w)]))
    assert got["n"].tolist() == [v for k in range(w) for v in (k, 7)]
    summed = xcoll.reduce(tree, to_cpu=True)
    assert torch.equal(summed["x"], torch.arange(16384.0) * w + sum(range(w)))
    assert xcoll.broadcast(tree, src=w - 1, to_cpu=True)["n"].tolist() == [w - 1, 7]
    return True


@pytest.mark.parametrize("world", ["gloo-2", "gloo-4", "xla-cpu-2"])
def test_calls_over_the_small_size_class_whose_replicas_agree_pass_their_guard(world):
    # (the guard's false alarms: a verdict read from the wrong rows of what
    # arrived raises on calls that agree)
    pool = shared_pool(world)
    assert pool.run(_large_calls, [None] * pool.world_size, timeout=180) == [True] * pool.world_size
