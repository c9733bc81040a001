"""What type checkers read of the public calls: tests/typing/public_types.py
asserts the types of typical calls (mypy checks it, as pyproject.toml's
``files`` says), a misspelt ``op`` fails the check, and a user's project
outside the checkout finds xcoll's types through the README's development
install."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT

_MISSPELT = """
import torch
import xcoll

xcoll.reduce(torch.ones(1), "avg")
xcoll.reduce({"loss": torch.ones(1)}, "mean")
"""


def _cache(tmp_path_factory) -> Path:
    """mypy's cache: the environment's, where ``.ci/run`` keeps its own (with
    the checkout's settings, its mypy then finds torch checked already), else
    this session's."""
    if sys.prefix != sys.base_prefix and os.access(sys.prefix, os.W_OK):
        return Path(sys.prefix) / ".mypy_cache"
    return tmp_path_factory.getbasetemp() / "mypy-cache"


def _mypy(*args: str, cache, cwd=ROOT, env=None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache), "--no-error-summary", *args],
        cwd=cwd,  # (by default where xcoll is found as this checkout)
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_typical_calls_have_the_types_the_typing_file_asserts(tmp_path_factory):
    cache = _cache(tmp_path_factory)
    done = _mypy("tests/typing/public_types.py", cache=cache)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_misspelt_op_fails_the_type_check(tmp_path_factory, tmp_path):
    cache = _cache(tmp_path_factory)
    script = tmp_path / "misspelt.py"
    script.write_text(_MISSPELT)
    done = _mypy(str(script), cache=cache)
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and "misspelt.py:5:" in errors[0], done.stdout + done.stderr
    # (reduce's overloads by tree: the error is that none takes a str op,
    # and its notes list each with the names an op may have)
    assert 'No overload variant of "reduce"' in errors[0], errors
    assert "op: Literal['sum', 'mean', 'max', 'min', 'prod']" in done.stdout, done.stdout


_USER = """
import torch
import xcoll

reveal_type(xcoll.reduce(torch.ones(2)))
"""


def test_a_project_outside_the_checkout_finds_the_development_installs_types(
    tmp_path_factory, tmp_path
):
    """The README's ``pip install -e`` (editable_mode=strict) installs a plain
    path that static checkers read: setuptools' default editable mode installs
    an import hook instead, which mypy and IDEs cannot follow (xcoll: "Cannot
    find implementation or library stub", every call Any)."""
    cache = _cache(tmp_path_factory)
    (tmp_path / "user.py").write_text(_USER)
    # (the checkout's mypy settings, copied: with the same options mypy reuses
    # the other tests' cache of torch, which it would otherwise check again)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}
    done = _mypy("user.py", cache=cache, cwd=tmp_path, env=env)
    assert done.returncode == 0 and 'Revealed type is "torch._tensor.Tensor"' in done.stdout, (
        "mypy, run outside the checkout, does not find xcoll's types: install it with the "
        "README's command (pip install -e '.[test]' --config-settings editable_mode=strict)\n"
        + done.stdout
        + done.stderr
    )


def test_every_editable_install_the_docs_give_is_the_strict_one():
    """The demo's, the tests', the mutation pass's and the benchmark's
    ``pip install -e``: any of them in setuptools' default mode would
    replace the strict install with an import hook, and the types with Any
    (the test above)."""
    import re

    commands = [
        line
        for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
        for line in doc.read_text().splitlines()
        if re.search(r"pip install -e\b", line)
    ]
    assert len(commands) >= 4, commands  # (the demo, the tests, mutation, bench)
    assert all("--config-settings editable_mode=strict" in c for c in commands), commands
