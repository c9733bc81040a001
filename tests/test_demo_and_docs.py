"""The README's demo runs and checks itself; docstring examples are true."""

from __future__ import annotations

import doctest
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import xcoll
import xcoll._collectives


def test_demo_runs_and_matches_the_single_process_reference():
    result = subprocess.run(
        [sys.executable, "-m", "xcoll.demo"], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "OK" in result.stdout
    assert "graph executions per replica: 10 (8 batches" in result.stdout


@pytest.mark.parametrize("module", [xcoll, xcoll._collectives])
def test_docstring_examples(module):
    failures, tried = doctest.testmod(module, verbose=False)
    assert tried > 0 and failures == 0


def test_bench_core_runs_and_reports_counts():
    result = subprocess.run(
        [sys.executable, "-m", "bench.core", "--replicas", "2", "--leaves", "3", "--repeats", "2"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [
        line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("| 3 |")
    ]
    assert [r[1].strip() for r in rows] == bench_methods()
    for r in rows:
        assert float(r[2]) > 0
    executions = {r[1].strip(): float(r[3]) for r in rows}
    assert executions["xcoll.gather"] == executions["xcoll.gather(to_cpu)"] == 1
    assert executions["per-leaf all_gather + sync"] == 3


def bench_methods():
    from bench.core import METHODS

    return METHODS


README = Path(__file__).parent.parent / "README.md"


def _readme_example(_):
    code = README.read_text().split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "README.md", "exec"), {})  # our own README's example, on each replica
    return True


def test_readme_example_runs_on_replicas(xla4):
    # (XLA replicas only: run inline it would start the XLA runtime in the test process)
    assert xla4.run(_readme_example, [None] * xla4.world_size) == [True] * xla4.world_size


def _evaluate(args):
    from xcoll.demo import load_example  # (the pool's worker may predate the path)

    return load_example().evaluate(args)


def test_eval_loop_example_on_every_world(pool):
    from xcoll.demo import load_example

    n, batch = 61, 4  # a multiple of neither W nor the batch
    ref = load_example().reference(n)
    for out in pool.run(_evaluate, [(n, batch)] * pool.world_size):
        assert torch.equal(out["preds"], ref["preds"])
        assert out["count"] == n
        assert out["accuracy"] == ref["accuracy"]
        assert abs(out["loss"] - ref["loss"]) < 1e-5


def test_bench_check_runs_and_reports_the_extra_execution():
    result = subprocess.run(
        [sys.executable, "-m", "bench.check", "--replicas", "2", "--repeats", "2"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {
        line.split("|")[1].strip(): line.split("|")[2:-1]
        for line in result.stdout.splitlines()
        if line.startswith("| XLA") or line.startswith("| gloo")
    }
    assert set(rows) == {"XLA:CPU", "gloo"}
    assert all(float(c) > 0 for c in rows["XLA:CPU"][:2] + rows["gloo"][:2])
    assert float(rows["XLA:CPU"][3]) == 2  # the check's exchange, then the gather


def test_readme_pool_example_runs_as_a_script(tmp_path):
    text = README.read_text().split("## Testing your own distributed code")[1]
    script = tmp_path / "pool_example.py"
    script.write_text(text.split("```python\n", 1)[1].split("```", 1)[0])
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
