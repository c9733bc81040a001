"""What the tests share in the test process: comparisons of trees and values,
and the Hypothesis settings of the property tests.

(What runs inside a replica is in tests/replicas.py.)
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import struct
import subprocess
import sys

import optree
import pytest
import torch
from hypothesis import HealthCheck, settings

# ---- Hypothesis ----------------------------------------------------------------

#: Examples per property test; CI and local runs can raise it.
EXAMPLES = int(os.environ.get("XCOLL_EXAMPLES", "20"))
#: The settings of every property test that runs on a replica pool.
PROPERTY = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# ---- comparisons ---------------------------------------------------------------

# The integer dtype of each float dtype's width, to compare floats bit for bit.
_INT = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def leaves(tree):
    """The leaves of ``tree``; ``None`` is an empty subtree, as in xcoll."""
    return optree.tree_leaves(tree, none_is_leaf=False)


def same_bits(a, b) -> bool:
    """Bitwise equality: tensors (dtype, shape, every bit), Python floats (every
    bit of the float64, so -0.0 and NaN payloads count), lists, tuples and dicts
    (same type, same keys in the same order, items compared the same way), other
    values (same type and ``==``)."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        a, b = a.contiguous(), b.contiguous()
        if a.dtype in _INT:
            a, b = a.view(_INT[a.dtype]), b.view(_INT[b.dtype])
        return bool(torch.equal(a, b))
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack(">d", a) == struct.pack(">d", b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same_bits, a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_bits(a[k], b[k]) for k in a)
    return a == b


def same_values(a, b) -> bool:
    """Equal as numbers (-0.0 == 0.0), NaN where NaN; dtype, shape and type equal."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        eq = a == b
        if a.dtype.is_floating_point:
            eq |= torch.isnan(a) & torch.isnan(b)
        return bool(eq.all())
    if isinstance(a, float):
        return type(b) is float and (a == b or (a != a and b != b))
    return type(a) is type(b) and a == b


def assert_trees(actual, expected, equal, what=""):
    """``actual`` has ``expected``'s structure and ``equal(a, e)`` holds leaf by leaf;
    a failure names the leaf's path."""
    assert optree.tree_structure(actual, none_is_leaf=False) == optree.tree_structure(
        expected, none_is_leaf=False
    ), what
    paths = optree.tree_paths(expected, none_is_leaf=False)
    for path, a, e in zip(paths, leaves(actual), leaves(expected), strict=True):
        assert equal(a, e), (what, path, a, e)


# ---- launched scripts ----------------------------------------------------------

#: 4 XLA:CPU replicas under ``torch_xla.launch``, as docs/launchers.md says to start them.
XLA_CPU = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}

#: Tests that start XLA themselves, in a script or a launched job (skipped
#: where torch_xla is not installed: .ci/run's newest-torch environment).
needs_xla = pytest.mark.skipif(
    importlib.util.find_spec("torch_xla") is None, reason="xla: torch_xla is not installed"
)


def clean_env() -> dict[str, str]:
    """This process's environment without what a launched script must not
    inherit from the test process: XLA's and launchers' settings."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "PJRT_", "CPU_"))}
    # USE_TORCH_XLA too: tests that start accelerate in-process set it to 0
    launch = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CI")
    for k in (*launch, "USE_TORCH_XLA"):
        clean.pop(k, None)
    return clean


def run(
    script: pathlib.Path,
    env: dict[str, str],
    *launcher: str,
    cwd: pathlib.Path | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    clean = clean_env()
    return subprocess.run(
        [sys.executable, *launcher, str(script)],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


# ---- the wheel -----------------------------------------------------------------

ROOT = pathlib.Path(__file__).resolve().parents[1]


def build_wheel(dest: pathlib.Path) -> pathlib.Path:
    """xcoll's wheel, built from this checkout's package files (copied first:
    setuptools leaves build/ and egg-info next to what it builds) into
    ``dest``, as ``pip wheel`` builds it for an install."""
    import shutil

    src = dest / "src"
    src.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "xcoll", src / "xcoll", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dest), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = dest.glob("xcoll-*.whl")
    return wheel


def installed_from_wheel() -> bool:
    """Whether a process started outside this checkout imports xcoll from
    elsewhere: this environment's xcoll is a regular install, as from its
    wheel (.ci/run's newest-torch environment), not an editable one."""
    code = "import importlib.util; print(importlib.util.find_spec('xcoll').origin)"
    found = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=60
    )
    # (the README's editable install, editable_mode=strict, is a tree of links
    # to this checkout's files: resolved, they are this checkout's)
    origin = os.path.realpath(found.stdout.strip())
    return found.returncode == 0 and not origin.startswith(os.path.realpath(ROOT / "xcoll"))
