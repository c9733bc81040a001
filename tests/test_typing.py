"""What type checkers read of the public calls: tests/typing/public_types.py
asserts the types of typical calls (mypy checks it, as pyproject.toml's
``files`` says), and a misspelt ``op`` fails the check."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT

_MISSPELT = """
import torch
import xcoll

xcoll.reduce(torch.ones(1), "avg")
xcoll.reduce({"loss": torch.ones(1)}, "mean")
"""


def _mypy(*args: str, cache) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache), "--no-error-summary", *args],
        cwd=ROOT,  # (where xcoll is found: this checkout)
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_typical_calls_have_the_types_the_typing_file_asserts(tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "mypy-cache"
    done = _mypy("tests/typing/public_types.py", cache=cache)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_misspelt_op_fails_the_type_check(tmp_path_factory, tmp_path):
    cache = tmp_path_factory.getbasetemp() / "mypy-cache"
    script = tmp_path / "misspelt.py"
    script.write_text(_MISSPELT)
    done = _mypy(str(script), cache=cache)
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and "misspelt.py:5:" in errors[0], done.stdout + done.stderr
    assert "\"Literal['avg']\"" in errors[0] and "'sum', 'mean', 'max', 'min', 'prod'" in errors[0]
