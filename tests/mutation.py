"""The mutation pass (README, "Developing"): mutmut's mutants of the modules
below, each run against its own fast tests at CI's examples.

    pip install -e '.[test,mutation]'
    CI=1 python -m tests.mutation                 # every module (hours on 2 cores)
    CI=1 python -m tests.mutation xcoll/_encode/wire.py  # one module
    CI=1 python -m tests.mutation --survivors     # again, only what survived last time
    CI=1 python -m tests.mutation --resume        # only what was not run (an interrupted pass)
    CI=1 python -m tests.mutation xcoll/_backends/xla_kernels.py --sample 100 --seed 25
                                                  # a random sample of each module's mutants
    CI=1 python -m tests.mutation xcoll/_guard/watchdog.py -- tests/test_out_of_step.py -k diagnosed
                                                  # each mutant against the tests after "--" alone

mutmut (configured in pyproject.toml, ``[tool.mutmut]``) copies the tree into
``mutants/``, rewrites each function of the mutated modules so that the
environment variable ``MUTANT_UNDER_TEST`` picks one of its mutants, records
which tests call each function, then runs each mutant against those tests: a
mutant is killed when one of them fails. It sees the calls made in the test
process only. The XLA kernels and the guard's verdicts at W > 1 run on the
replica pools' workers, other processes: as a pytest plugin (``-p
tests.mutation``, in mutmut's pytest arguments), this module tells it that
each test of a file in :data:`OWNERS` calls every function named there. The
workers inherit the chosen mutant (the environment variable) and import the
mutated tree (mutmut puts ``mutants/`` first on ``sys.path``, which a spawned
worker inherits). It also orders a mutant's tests fastest first, so that a
killed mutant costs its cheapest failing test, not the replica pools' slow ones.

At the end, the kill rate of each module, and each survivor's diff (``mutmut
show NAME``); ``mutmut browse`` explores them. Survivors that no test can kill
(equivalent mutants) are listed in docs/mutation.md.
"""

from __future__ import annotations

import fnmatch
import json
import os
import random
import subprocess
import sys
from pathlib import Path

#: The mutated modules and, per module, the functions whose mutants run:
#: patterns of mutmut's mutant names (``module.x_function__mutmut_N``,
#: ``module.xǁClassǁmethod__mutmut_N``). Of the XLA backend, its kernels.
MODULES: dict[str, list[str]] = {
    "xcoll/_encode/wire.py": ["xcoll._encode.wire.*"],
    "xcoll/_encode/pack.py": ["xcoll._encode.pack.*"],
    "xcoll/_encode/codec.py": ["xcoll._encode.codec.*"],
    "xcoll/_guard/header.py": ["xcoll._guard.header.*"],
    "xcoll/_guard/verdict.py": ["xcoll._guard.verdict.*"],
    "xcoll/_guard/entry.py": ["xcoll._guard.entry.*"],
    "xcoll/_guard/check.py": ["xcoll._guard.check.*"],
    "xcoll/_backends/base.py": ["xcoll._backends.base.x?Kernels?*"],
    "xcoll/_backends/xla_kernels.py": [
        "xcoll._backends.xla_kernels.x?XlaKernels?*",
        *(
            f"xcoll._backends.xla_kernels.x?{c}?*"
            for c in (
                "Bitcast", "EncodeReduce", "Join", "Unjoin", "DecodeReduce", "Split", "Parts", "Keep"
            )
        ),
        *(
            f"xcoll._backends.xla_kernels.x_{f}__mutmut_*"
            for f in (
                "_join",
                "_encode",
                "_cast_back",
                "_quiet",
                "_decode",
                "_slot_major",
                "_bytes",
                "_typed",
                "_encode_reduce",
                "_decode_reduce",
                "_divisor",
            )
        ),
    ],
    "xcoll/_guard/steps.py": ["xcoll._guard.steps.*"],
    "xcoll/_core/ops/parts.py": ["xcoll._core.ops.parts.*"],
    "xcoll/_core/ops/all_to_all.py": ["xcoll._core.ops.all_to_all.*"],
    "xcoll/_core/grad.py": ["xcoll._core.grad.*"],
    "xcoll/_core/call.py": ["xcoll._core.call.*"],
    # (issue 40's second part: configured, not yet run in full; docs/mutation.md says which ran)
    "xcoll/_core/recipe.py": ["xcoll._core.recipe.*"],
    "xcoll/_core/execute.py": ["xcoll._core.execute.*"],
    "xcoll/_core/pending.py": ["xcoll._core.pending.*"],
    # (a package's own module: mutmut names its functions without "__init__")
    "xcoll/_core/uneven/__init__.py": ["xcoll._core.uneven.x_*", "xcoll._core.uneven.xǁ*"],
    "xcoll/_core/uneven/rows.py": ["xcoll._core.uneven.rows.*"],
    "xcoll/_core/uneven/exact.py": ["xcoll._core.uneven.exact.*"],
    "xcoll/_core/uneven/padded.py": ["xcoll._core.uneven.padded.*"],
    "xcoll/_objects.py": ["xcoll._objects.*"],
    "xcoll/_rng.py": ["xcoll._rng.*"],
    "xcoll/_backends/dist.py": ["xcoll._backends.dist.*"],
    "xcoll/_backends/__init__.py": ["xcoll._backends.x_*", "xcoll._backends.xǁ*"],
    "xcoll/_backends/_launch.py": ["xcoll._backends._launch.*"],
    # (issue 60: the modules no pass had run)
    "xcoll/_core/ops/base.py": ["xcoll._core.ops.base.*"],
    "xcoll/_core/ops/reduce.py": ["xcoll._core.ops.reduce.*"],
    "xcoll/_core/ops/gather.py": ["xcoll._core.ops.gather.*"],
    "xcoll/_core/ops/broadcast.py": ["xcoll._core.ops.broadcast.*"],
    "xcoll/_core/ops/reduce_scatter.py": ["xcoll._core.ops.reduce_scatter.*"],
    "xcoll/_guard/order.py": ["xcoll._guard.order.*"],
    "xcoll/_guard/exchange.py": ["xcoll._guard.exchange.*"],
    "xcoll/_guard/leaving.py": ["xcoll._guard.leaving.*"],
    "xcoll/_guard/watchdog.py": ["xcoll._guard.watchdog.*"],
    "xcoll/_backends/hosted.py": ["xcoll._backends.hosted.*"],
    "xcoll/_backends/xla.py": ["xcoll._backends.xla.*"],
    "xcoll/_backends/xla_step.py": ["xcoll._backends.xla_step.*"],
    "xcoll/_backends/_xlac.py": ["xcoll._backends._xlac.*"],
}

#: Test files whose tests exercise functions that mutmut cannot see them call,
#: and those functions (patterns of mutmut's ``module.x_function`` names):
#: functions that run on a pool's workers, and functions that run when their
#: module is imported (mutmut would credit whichever test imported it first).
GUARD = [
    "xcoll._guard.header.*",
    "xcoll._guard.verdict.*",
    "xcoll._guard.entry.*",
    "xcoll._guard.steps.*",
    "xcoll._guard.order.*",
    "xcoll._guard.exchange.*",
    "xcoll._guard.leaving.*",
    "xcoll._guard.watchdog.*",
]
#: What the collectives that address each replica its own part do at W > 1.
PARTS = ["xcoll._core.ops.parts.*", "xcoll._core.ops.all_to_all.*"]
#: What every call does on a replica: its backend, its recipe and execution.
CORE = [
    "xcoll._backends.x_*",
    "xcoll._backends.xǁ*",
    "xcoll._backends.dist.*",
    "xcoll._core.recipe.*",
    "xcoll._core.execute.*",
    "xcoll._core.ops.base.*",
    "xcoll._core.ops.reduce.*",
    "xcoll._core.ops.gather.*",
    "xcoll._core.ops.broadcast.*",
    "xcoll._core.ops.reduce_scatter.*",
    "xcoll._backends.hosted.*",
    "xcoll._backends.xla.*",
    "xcoll._backends.xla_step.*",
    "xcoll._backends._xlac.*",
]
UNEVEN = ["xcoll._core.uneven.x_*", "xcoll._core.uneven.xǁ*", "xcoll._core.uneven.*.*"]
OWNERS: dict[str, list[str]] = {
    "tests/test_kernels.py": ["xcoll._backends.xla_kernels.*"],
    "tests/test_guard.py": [*GUARD, "xcoll._guard.check.*", *CORE],
    # (header.own_size is cached: whichever test first asks for a size calls the rest)
    "tests/test_header.py": ["xcoll._guard.header.*"],
    "tests/test_mismatch.py": [*GUARD, "xcoll._guard.check.*", *PARTS, *CORE, "xcoll._core.call.*"],
    "tests/test_properties.py": [*PARTS, *CORE, *UNEVEN],
    "tests/test_grad.py": [
        *PARTS, *CORE, *UNEVEN, "xcoll._core.grad.*", "xcoll._core.call.*", "xcoll._guard.steps.*"
    ],
    "tests/test_in_flight.py": [
        *CORE, "xcoll._core.pending.*", "xcoll._core.grad.*", "xcoll._core.call.*", "xcoll._guard.steps.*"
    ],
    # (call.run and call.outcome: the calls that objects, RNG states and an
    # uneven gather make on the trees they build)
    "tests/test_objects.py": [*CORE, "xcoll._objects.*", "xcoll._core.call.*"],
    "tests/test_rng.py": [*CORE, "xcoll._rng.*", "xcoll._core.call.*"],
    "tests/test_dist.py": CORE,
    # (a reduce's Python ints, read back exactly beside float scalars)
    "tests/test_exact_ints.py": CORE,
    "tests/test_out_of_step.py": [*GUARD, "xcoll._guard.check.*", "xcoll._objects.*"],
    # (the refusals of leaves that cannot be cut, read whole on a gloo pair;
    # what the environment says of a launch, read by scripts of their own and
    # at xcoll's import)
    "tests/test_errors.py": [*PARTS, *CORE, "xcoll._core.call.*", "xcoll._backends._launch.*"],
    # (which calls are checked in full: "never" ones are not counted)
    "tests/test_check_state.py": ["xcoll._guard.check.x_due*"],
    # (an uneven leaf's growing dim, "*" in its description line)
    "tests/test_uneven.py": ["xcoll._guard.check.x_describe*", *CORE, *UNEVEN, "xcoll._core.call.*"],
    "tests/test_wire.py": ["xcoll._encode.wire.x__nan_bits"],  # (xcoll._encode.wire.WINNING_NAN)
}

# ---- the pytest plugin -----------------------------------------------------------


def pytest_runtest_call(item) -> None:
    """In mutmut's stats run, records the calls that :data:`OWNERS` says ``item`` makes."""
    if os.environ.get("MUTANT_UNDER_TEST") != "stats":
        return
    patterns = OWNERS.get(item.nodeid.split("::")[0].removeprefix("mutants/"))
    if not patterns:
        return
    from mutmut.state import state

    state()._stats.update(f for f in _functions() if any(fnmatch.fnmatch(f, p) for p in patterns))


def pytest_collection_modifyitems(items) -> None:
    """For a mutant, runs its tests fastest first, by the stats run's
    durations: mutmut passes them in no order, and a killed mutant then dies
    at its cheapest failing test instead of after the replica pools' slow ones."""
    if os.environ.get("MUTANT_UNDER_TEST") in (None, "", "stats"):
        return
    stats = Path("mutmut-stats.json")  # (in ``mutants/``, the run's working directory)
    if not stats.exists():
        return
    durations = json.loads(stats.read_text())["duration_by_test"]
    items.sort(key=lambda item: durations.get(item.nodeid, float("inf")))


def private_trampolines() -> None:
    """Counts mutmut's trampolines (the wrapper through which each call of a
    mutated function goes) as xcoll's own frames: a call's place
    (:func:`xcoll._guard.steps.place`) is the first frame outside xcoll's
    modules, known by their globals' ``__name__``, and would otherwise be the
    trampoline's line, the same for every call. Run in every process of the
    pass that imports ``tests`` (its pytest processes, and the pools' workers,
    which import the test functions they run)."""
    import mutmut.mutation.trampoline as trampoline

    trampoline.__dict__["__name__"] = "xcoll._mutmut_trampoline"


def _functions() -> set[str]:
    """Every mutated function, by mutmut's name (read from its ``.meta`` files,
    in ``mutants/``: the stats run's working directory)."""
    names = set()
    for meta in Path("xcoll").rglob("*.py.meta"):
        for key in json.loads(meta.read_text())["exit_code_by_key"]:
            names.add(key.rpartition("__mutmut_")[0])
    return names


# ---- the pass ----------------------------------------------------------------------

# mutmut's exit codes (mutmut.stats.status_by_exit_code), as this summary counts them
_KILLED = {1, 3, 36, -24, 24, 152, 255, -11, -9}  # a test failed, timed out or crashed
_SURVIVED = {0}
_NO_TESTS = {5, 33}


def _results() -> dict[str, dict[str, int | None]]:
    out = {}
    for module in MODULES:
        meta = Path("mutants") / (module + ".meta")
        out[module] = json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}
    return out


def _selected(module: str, names) -> list[str]:
    return [n for n in names if any(fnmatch.fnmatch(n, p) for p in MODULES[module])]


def _option(argv: list[str], name: str, default: int | None) -> int | None:
    """The int after ``name`` in ``argv`` (removed from it with its value)."""
    if name not in argv:
        return default
    k = argv.index(name)
    value = int(argv[k + 1])
    del argv[k : k + 2]
    return value


def _direct(names: list[str], pytest_args: list[str]) -> None:
    """Runs each mutant of ``names`` against ``pytest_args`` alone, each in a
    pytest process of its own in ``mutants/`` (two at a time), instead of
    against the tests mutmut's stats run credits it with: for a module whose
    tests the pass's selection leaves out (the watchdog's and a leaving
    replica's, which wait seconds), or to run chosen tests first. Each exit
    status is recorded where mutmut records its own (the module's ``.meta``),
    so the summary, ``--survivors`` and ``mutmut show`` read it; a run past
    15 minutes counts as a timeout (killed: re-examine it). The tests must
    pass first without a mutant."""
    from concurrent.futures import ThreadPoolExecutor

    here = Path("mutants").resolve()
    env = {**os.environ, "PYTHONPATH": str(here)}

    def one(name: str) -> int:
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *pytest_args]
        try:
            done = subprocess.run(
                cmd, cwd=here, env={**env, "MUTANT_UNDER_TEST": name}, capture_output=True, timeout=900
            )
        except subprocess.TimeoutExpired:
            return 36
        return done.returncode

    # (as mutmut's clean run: tests that fail, or are not found, without a
    # mutant would count every mutant killed)
    clean = one("")
    if clean != 0:
        raise SystemExit(f"the tests after '--' exit {clean} without a mutant: no mutant run")
    with ThreadPoolExecutor(2) as pool:
        for name, code in zip(names, pool.map(one, names), strict=True):
            module = next(m for m in MODULES if _selected(m, [name]))
            meta = here / (module + ".meta")
            data = json.loads(meta.read_text())
            data["exit_code_by_key"][name] = code
            meta.write_text(json.dumps(data))
            print(f"{name}: {'survived' if code in _SURVIVED else code}", flush=True)


def main(argv: list[str]) -> int:
    argv = list(argv)
    # (after "--": the tests each mutant runs against, by :func:`_direct`)
    direct = argv[argv.index("--") + 1 :] if "--" in argv else None
    argv = argv[: argv.index("--")] if "--" in argv else argv
    sample, seed = _option(argv, "--sample", None), _option(argv, "--seed", 0)
    survivors, resume = "--survivors" in argv, "--resume" in argv
    modules = [a for a in argv if not a.startswith("--")] or list(MODULES)
    unknown = [m for m in modules if m not in MODULES]
    if unknown:
        print(f"unknown module(s) {unknown}; the mutated modules are {list(MODULES)}")
        return 2
    if not os.environ.get("CI"):
        print("(CI is not set: the property tests draw new examples each run)")
    if survivors or resume:
        before = _results()
        again = _SURVIVED if survivors else {None}
        names = [n for m in modules for n in _selected(m, before[m]) if before[m][n] in again]
        if not names:
            print("nothing to run")
            return 0
    elif sample is not None:
        if not all(_results()[m] for m in modules):
            # mutmut generates the mutants (and records which tests call what)
            # on its first run: one whose pattern matches no mutant runs none
            subprocess.run([sys.executable, "-m", "mutmut", "run", "xcoll.__none__"], check=False)
        before, rng = _results(), random.Random(seed)
        names = []
        for m in modules:
            mine = sorted(_selected(m, before[m]))
            names += rng.sample(mine, min(sample, len(mine)))
    else:
        names = [p for m in modules for p in MODULES[m]]
    if direct is not None:
        every = [n for m in modules for n in _selected(m, _results()[m])]
        _direct([n for n in every if any(fnmatch.fnmatch(n, p) for p in names)], direct)
    else:  # (mutmut's own exit status says nothing of the kill rate)
        subprocess.run([sys.executable, "-m", "mutmut", "run", *names], check=False)
    results = _results()
    print("\nmodule                    mutants  killed  survived  no tests  kill rate")
    total = killed = 0
    survived: list[str] = []
    for module in modules:
        codes = [results[module][n] for n in _selected(module, results[module])]
        k = sum(c in _KILLED for c in codes)
        s = [n for n in _selected(module, results[module]) if results[module][n] in _SURVIVED]
        none = sum(c in _NO_TESTS for c in codes)
        checked = k + len(s) + none
        rate = f"{100 * k / checked:.1f}%" if checked else "-"
        print(f"{module:26s}{checked:8d}{k:8d}{len(s):10d}{none:10d}{rate:>11s}")
        total, killed = total + checked, killed + k
        survived += s
    if total:
        print(
            f"{'all':26s}{total:8d}{killed:8d}{len(survived):10d}{'':10s}{100 * killed / total:10.1f}%"
        )
    for name in survived:
        print(f"\n--- survived: {name}")
        subprocess.run([sys.executable, "-m", "mutmut", "show", name], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
