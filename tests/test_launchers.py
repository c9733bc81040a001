"""docs/launchers.md's snippets, run under the launchers they are written for:
``torch_xla.launch`` with 4 XLA:CPU replicas, and ``torchrun`` with 2 gloo
processes; and what a user sees when a launch is set up wrong."""

from __future__ import annotations

import pathlib

import pytest

from tests.helpers import XLA_CPU, run

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "launchers.md"


def snippet(name: str) -> str:
    text = DOC.read_text().split(f"<!-- launcher: {name} -->", 1)[1]
    return text.split("```python\n", 1)[1].split("```", 1)[0]




def test_torch_xla_launch_on_cpu_runs_the_docs_snippet(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(snippet("xla"))
    result = run(script, {**XLA_CPU, "XLA_THREAD_POOL_SIZE": "16"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "preds [0.0, 1.0, 2.0, 10.0, 11.0, 12.0, 20.0, 21.0, 22.0, 30.0, 31.0, 32.0]" in (
        result.stdout
    ), result.stdout
    assert "count [12] of 4 replicas" in result.stdout, result.stdout


def test_a_thread_pool_smaller_than_the_replicas_is_named_not_aborted(tmp_path):
    # what a 2-core machine has by default; XLA alone would abort after 10 s
    script = tmp_path / "script.py"
    script.write_text(snippet("xla"))
    result = run(script, {**XLA_CPU, "XLA_THREAD_POOL_SIZE": "2"})
    assert result.returncode != 0
    assert "thread pool has 2" in result.stderr and "XLA_THREAD_POOL_SIZE=16" in result.stderr, (
        result.stderr[-3000:]
    )
    assert "Termination timeout" not in result.stderr


def test_several_devices_without_a_launcher_are_named(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(snippet("xla").replace("torch_xla.launch(main)", "main(0)"))
    result = run(script, {**XLA_CPU, "XLA_THREAD_POOL_SIZE": "16"})
    assert result.returncode != 0
    assert "runs as a world of one: start the function with torch_xla.launch" in result.stderr, (
        result.stderr[-3000:]
    )


def test_torchrun_with_gloo_runs_the_docs_snippet(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(snippet("torchrun"))
    result = run(
        script, {}, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "preds [0.0, 1.0, 2.0, 10.0, 11.0, 12.0]" in result.stdout, result.stdout
    assert "count [6] of 2 replicas" in result.stdout, result.stdout


_XLA_IN_A_TORCHRUN_JOB = """
import torch, torch_xla, xcoll
torch_xla.device()  # XLA's runtime starts, as accelerate's XLA path starts it
try:
    xcoll.gather({"x": torch.ones(2)})
except TypeError as e:
    print("raised", e)
"""


@pytest.mark.parametrize("launcher", ["torchrun"])
def test_xla_runtime_in_a_torchrun_job_names_the_likely_cause(tmp_path, launcher):
    script = tmp_path / "script.py"
    script.write_text(_XLA_IN_A_TORCHRUN_JOB)
    result = run(
        script,
        {"PJRT_DEVICE": "CPU"},
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("raised")]
    assert len(lines) == 2, result.stdout
    for line in lines:
        assert "of 2 (torchrun's environment)" in line and "USE_TORCH_XLA=0" in line, line


_CAUGHT = """
import torch, torch.distributed as dist, xcoll
dist.init_process_group("gloo")
r = dist.get_rank()
xcoll.gather({"w": torch.ones(1)})
try:
    xcoll.gather({("a" if r == 0 else "b"): torch.ones(2)})
except xcoll.CollectiveMismatchError:
    print("caught", flush=True)
dist.destroy_process_group()
"""


def test_gloo_processes_exit_cleanly_after_a_caught_mismatch(tmp_path):
    # xcoll once kept the process group alive past destroy_process_group, and
    # its destructor at interpreter exit aborted 5 runs in 12
    script = tmp_path / "script.py"
    script.write_text(_CAUGHT)
    for _ in range(3):
        result = run(
            script, {}, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.count("caught") == 2, result.stdout
