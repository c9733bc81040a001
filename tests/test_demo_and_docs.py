"""The README's demo runs and checks itself (from the wheel, as installed);
docstring examples are true. (The README's first screen runs under
torch_xla.launch: tests/test_docs_run.py.)"""

from __future__ import annotations

import doctest
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import xcoll
import xcoll._collectives


def test_demo_runs_from_the_wheel_and_matches_the_single_process_reference(
    from_wheel, tmp_path
):
    # outside the checkout, xcoll as its wheel installs it: the example ships in it
    pytest.importorskip("torch_xla")
    result = subprocess.run(
        [sys.executable, "-m", "xcoll.demo"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, **from_wheel},
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "OK" in result.stdout
    # its progress, as it goes, before the results
    progress = [line for line in result.stdout.splitlines() if line.startswith("  ... ")]
    assert len(progress) == 3 and progress[0] == "  ... starting 4 replicas", progress
    (source,) = re.findall(r"^  the loop: (.*)$", result.stdout, re.M)
    assert source.endswith(os.path.join("xcoll", "examples", "eval_loop.py")), source
    assert not source.startswith(str(Path(__file__).parents[1] / "xcoll")), source
    assert "graph executions per replica: 10 (8 batches" in result.stdout
    # 1001 samples on 4 replicas: 251 each, in 7 batches of 32 and one of 27
    assert (
        "compilations: 5 (the small calls' all-gather (the first call's consistency check's too), "
        "the first two batches, a batch's gather with the next full batch, a batch's gather "
        "with the last, shorter batch, the last batch's gather)"
    ) in result.stdout, result.stdout


def test_the_demos_options_say_what_they_set():
    text = subprocess.run(
        [sys.executable, "-m", "xcoll.demo", "--help"], capture_output=True, text=True, timeout=120
    ).stdout
    options = text.split("options:", 1)[1]
    helps = re.split(r"\n  (?=--)", options)[1:]  # (one chunk per option after -h)
    assert [h.split()[0] for h in helps] == ["--replicas", "--samples", "--batch"], text
    assert all("(default: " in " ".join(h.split()) for h in helps), text


@pytest.mark.parametrize("module", [xcoll, xcoll._collectives])
def test_docstring_examples(module):
    failures, tried = doctest.testmod(module, verbose=False)
    assert tried > 0 and failures == 0


def test_bench_quick_runs_and_reports_well_formed_numbers(tmp_path):
    # Runs the benchmark as documented; checks what it writes and its counts,
    # never how fast anything is.
    result = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).parent.parent,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    cells = {(c["backend"], c["op"], c["method"], c["leaves"]): c for c in results["cells"]}

    from bench import gloo, memory, xla
    from bench.trees import SMALL

    expected = {
        (backend, op, method, n)
        for backend, methods in (
            ("XLA:CPU W=4", xla.METHODS),
            ("XLA:CPU W=1", xla.ALONE),
            ("gloo W=4", gloo.METHODS),
        )
        for op in methods
        for method in methods[op]
        for n in ([SMALL[op]] if op in SMALL else (1, 8))
    }
    assert set(cells) == expected
    for c in cells.values():
        assert math.isfinite(c["median_ms"]) and c["median_ms"] > 0
        assert math.isfinite(c["first_ms"]) and c["first_ms"] > 0
        # A world of one: xcoll communicates nothing and runs no program of its
        # own (its leaves are data already); xm.all_reduce there is a clone.
        alone = c["backend"] == "XLA:CPU W=1" and c["method"].startswith("xcoll")
        if alone:
            assert c["collectives"] == 0 and c["executions"] == 0 and c["transfers"] == 1
        else:
            assert c["collectives"] > 0 or (c["backend"], c["op"][-6:]) == ("XLA:CPU W=1", "reduce")
        if c["backend"].startswith("XLA"):
            assert c["executions"] >= (0 if alone else 1)
            assert c["compiles"] == 0  # warm: nothing recompiles

    def count(backend, op, method, n, key="collectives"):
        return cells[(backend, op, method, n)][key]

    # bench.trees mixes 3 dtypes; 8 of its leaves hold under 4 KiB, a small
    # call: on XLA packed on the host around the one all-gather program of
    # small calls (one collective and one execution, whatever the dtypes; two
    # transfers: the leaves, then the rows). A larger call is one program:
    # one collective per move, two for a sum (float16 travels with float32, in
    # which it accumulates anyway; int64), one execution. The per-leaf peers
    # make one collective per leaf.
    x, g = "XLA:CPU W=4", "gloo W=4"
    for op, method in [
        ("gather", "xcoll.gather(to_cpu=True)"),
        ("gather", "xcoll.gather (device outputs)"),
        ("reduce", "xcoll.reduce"),
        ("broadcast", "xcoll.broadcast"),
    ]:
        assert count(x, op, method, 8) == 1
        for n in (1, 8):
            assert count(x, op, method, n, "executions") == 1
        assert count(x, op, method, 8, "transfers") == 2
    assert count(x, "gather", next(m for m in xla.METHODS["gather"] if m.startswith("(a)")), 8) == 8
    assert count(x, "reduce", next(m for m in xla.METHODS["reduce"] if m.startswith("(b)")), 8, "executions") == 16
    # small calls: one collective on gloo and on XLA (one all-gather of 4 KiB,
    # whatever the dtypes: the metrics' float32 and int64), against one per
    # leaf; one execution either way
    for op, ours, plain in [("small gather", 1, 1), ("small reduce", 1, 1), ("metrics reduce", 1, 3)]:
        for backend in (x, "XLA:CPU W=1"):
            mine, theirs = (m for m in xla.METHODS[op])
            one = backend.endswith("W=1")
            assert count(backend, op, mine, SMALL[op]) == (0 if one else 1), (backend, op)
            clone = one and op.endswith("reduce")
            assert count(backend, op, theirs, SMALL[op]) == (0 if clone else plain), (backend, op)
            assert count(backend, op, mine, SMALL[op], "executions") == (0 if one else 1)
        mine, theirs = (m for m in gloo.METHODS[op])
        assert count(g, op, mine, SMALL[op]) == ours and count(g, op, theirs, SMALL[op]) == plain
    assert count(g, "gather", "xcoll.gather", 8) == 1
    assert count(g, "gather", "accelerate.utils.gather", 8) == 8
    assert count(g, "uneven gather", "xcoll.gather(uneven=True)", 8) == 2  # shapes, then data
    # the memory section (--quick: a gather's), both methods, a finite rise
    assert [m["op"] for m in results["memory"]] == ["gather"]
    for m in results["memory"]:
        assert m["mib"] == 64 and m["xcoll"] > 0 and m[memory.DIRECT] > 0

    report = (tmp_path / "results.md").read_text()
    for backend, op in {(b, o) for b, o, _, _ in expected}:
        assert f"## {backend}: {op}" in report
    assert "peak memory for one float32 leaf of 64 MiB" in report
    # the small-call targets: each backend's three, with a ratio each
    small = report.split("## Targets for small calls", 1)[1].split("\n## ", 1)[0]
    assert len([line for line in small.splitlines() if line.startswith("| ") and "x (" in line]) == 9
    # the evaluation loop in flight (--quick: W=2): each compute's three loops and target
    flight = report.split("## gloo: an evaluation loop whose gathers are in flight", 1)[1]
    assert len(re.findall(r"^\| a (matmul|sleep as long): .* \| [0-9.]+ \([0-9.]+x\) \|$", flight, re.M)) == 6
    assert len(re.findall(r"^\| gloo W=2, a .*: the loop in flight at most 0.8x the blocking one \| [0-9.]+x \|", flight, re.M)) == 2
    # metric.compute()'s sync (--quick: W=2): xcoll's is one call, two
    # collectives (sizes, then the data), for a metric and a collection
    synced = results["metrics_sync"]["worlds"]["2"]
    for metric in ("10 states", "collection"):
        assert synced[f"{metric}: sync_with_xcoll"]["collectives"] == 2, synced
        assert synced[f"{metric}: torchmetrics' own sync"]["collectives"] > 2, synced
    assert synced["10 states: per-tensor dist_sync_fn"]["collectives"] == 10, synced
    assert "## gloo: metric.compute()'s sync, torchmetrics' own against xcoll's" in report
    png = (tmp_path / "results.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000

    # python -m bench.report redraws both from results.json
    (tmp_path / "results.md").unlink()
    (tmp_path / "results.png").unlink()
    subprocess.run(
        [sys.executable, "-m", "bench.report", str(tmp_path)],
        check=True,
        timeout=120,
        cwd=Path(__file__).parent.parent,
    )
    assert (tmp_path / "results.md").read_text() == report
    assert (tmp_path / "results.png").read_bytes().startswith(b"\x89PNG")


README = Path(__file__).parent.parent / "README.md"


def test_eval_loop_example_on_every_world(pool):
    from xcoll.examples import eval_loop

    n, batch = 61, 4  # a multiple of neither W nor the batch
    ref = eval_loop.reference(n)
    args = [(n, batch, pool.device_type)] * pool.world_size
    for out in pool.run(eval_loop.evaluate, args):
        assert torch.equal(out["preds"], ref["preds"])
        assert out["count"] == n
        assert out["accuracy"] == ref["accuracy"]
        assert abs(out["loss"] - ref["loss"]) < 1e-5


def test_bench_check_runs_and_reports_the_guard_costs_no_execution():
    result = subprocess.run(
        [sys.executable, "-m", "bench.check", "--replicas", "2", "--repeats", "2", "--leaves", "8", "32"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [
        [c.strip() for c in line.split("|")[1:-1]]
        for line in result.stdout.splitlines()
        if line.startswith("| XLA") or line.startswith("| gloo")
    ]
    # engine, W, call, leaves: every cell measured once
    assert sorted(tuple(r[:4]) for r in rows) == sorted(
        (e, "2", c, n)
        for e in ("XLA:CPU", "gloo")
        for c in ("gather", "reduce", "broadcast")
        for n in ("8", "32")
    )
    for r in rows:
        assert all(float(x) > 0 for x in r[4:7]) and r[7].endswith("x") and r[8].endswith("x")
        if r[0] == "XLA:CPU":  # the guard: no extra execution, no extra collective op
            assert (float(r[9]), float(r[10])) == (1, 1), r
    assert re.search(r'op="sum" [0-9.]+ ms, a dict of 64 ops [0-9.]+ ms', result.stdout)


def _bench(module: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m module *args`` from the repository's root, which exits 0."""
    result = subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).parent.parent,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_bench_outputs_reports_a_compile_per_output_count():
    pytest.importorskip("torch_xla")
    result = _bench("bench.outputs", "--outputs", "1", "8", "--calls", "2")
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if re.match(r"\| \d", line)]
    assert [int(r[0]) for r in rows] == [1, 8]
    for r in rows:  # a first call, a compile (each N is a new program), a time per call
        assert all(float(x) > 0 for x in r[1:]), r


def test_bench_first_calls_checks_its_results():
    # (the script asserts each result against the trees' expected values; a
    # fresh pool per case: one case here)
    pytest.importorskip("torch_xla")
    args = ["--leaves", "5", "--ops", "broadcast", "--outputs", "device"]
    result = _bench("bench.first_calls", *args)
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if re.match(r"\| [a-z]", line)]
    assert [(r[0].strip(), r[1].strip(), int(r[2])) for r in rows[1:]] == [("broadcast", "device", 5)]
    assert rows[1][6].strip().startswith("0,"), result.stdout  # (a later call compiles nothing)


def test_bench_grad_counts_the_backwards_collectives():
    result = _bench("bench.grad", "--leaves", "1", "8", "--rounds", "2")
    rows = {
        line.split("|")[1].strip(): re.findall(r"\((\d+)\)", line)
        for line in result.stdout.splitlines()
        if line.startswith("| ") and "method" not in line
    }
    # per leaf count (1, 8): the backward's collectives (all-to-all per leaf on gloo)
    assert rows == {
        "xcoll.gather(grad=True)": ["1", "1"],
        "torch.distributed.nn.functional.all_gather per leaf": ["2", "16"],
        "Lightning's _AllGather per leaf (reproduced)": ["1", "8"],
    }, result.stdout


def test_bench_scatter_counts_one_collective_per_call_against_one_per_leaf():
    pytest.importorskip("torch_xla")
    result = _bench("bench.scatter", "--leaves", "1", "8", "--rounds", "2")
    tables = result.stdout.split("XLA:CPU, W=2")
    assert len(tables) == 2, result.stdout
    for engine, text in zip(("gloo", "xla"), tables, strict=True):
        rows = {
            line.split("|")[1].strip(): re.findall(r"\((\d+)\)", line)
            for line in text.splitlines()
            if line.startswith("| ") and "method" not in line
        }
        peers = ("xm.reduce_scatter", "xm.all_to_all") if engine == "xla" else (
            "dist.reduce_scatter_tensor", "dist.all_to_all_single"
        )
        # per leaf count (1, 8): one collective per call, against one per leaf
        assert rows == {
            "xcoll.reduce_scatter": ["1", "1"],
            f"{peers[0]} per leaf": ["1", "8"],
            "xcoll.all_to_all": ["1", "1"],
            f"{peers[1]} per leaf": ["1", "8"],
        }, result.stdout


def readme_pool_example() -> str:
    text = README.read_text().split("## Testing your own distributed code")[1]
    return text.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_pool_example_runs_as_a_script(tmp_path):
    script = tmp_path / "pool_example.py"
    script.write_text(readme_pool_example())
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
