"""xcoll as users install it: the wheel holds the package, its typing marker
and the demo's example, declares what xcoll needs, and runs outside the
checkout, in a world of one and under torchrun with gloo.

Here the processes import the wheel built from this checkout; in .ci/run's
newest-torch environment, where the wheel is installed with its declared
dependencies alone (and the test runner), they import that install."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile

import xcoll
from tests.helpers import ROOT, run
from tests.test_launchers import TORCHRUN_2, snippet


def test_the_wheel_holds_the_package_its_typing_marker_and_the_example(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    package = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "xcoll").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert package <= names, package - names
    assert {"xcoll/py.typed", "xcoll/examples/eval_loop.py"} <= names
    requires = sorted(
        line.removeprefix("Requires-Dist:").strip()
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    )
    # numpy: torch's Tensor.numpy(), which xcoll's guard and object calls use,
    # needs it, and torch does not require it
    assert requires == ["numpy", "optree>=0.13", "torch>=2.9"], requires


def test_the_wheel_carries_the_licence_and_the_version_the_changelog_names(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        licences = [n for n in names if ".dist-info/" in n and "LICENSE" in n.rsplit("/", 1)[-1]]
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        texts = [z.read(n).decode() for n in licences]
    assert (ROOT / "LICENSE").read_text() in texts, licences
    assert "Apache License" in texts[0] and "License: Apache-2.0" in metadata
    version = next(
        line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Version:")
    )
    assert version == xcoll.__version__
    # the changelog's newest released version is the package's
    changelog = (ROOT / "CHANGELOG.md").read_text()
    released = re.findall(r"^## (\d+\.\d+\.\d+) \(\d{4}-\d\d-\d\d\)$", changelog, re.M)
    assert released and released[0] == xcoll.__version__, released[:2]


# Every docstring example (they run in a world of one), then the calls of the
# README's first screen on CPU tensors, in a plain process.
_WORLD_OF_ONE = """
import doctest, importlib, os, sys
import torch, xcoll
checkout = {checkout!r}
assert not xcoll.__file__.startswith(checkout + os.sep), xcoll.__file__
for name in ["xcoll", "xcoll._collectives", "xcoll._objects", "xcoll._encode.codec", "xcoll._rng",
             "xcoll._samples", "xcoll._step", "xcoll._guard.check", "xcoll.testing._pools"]:
    failed, tried = doctest.testmod(importlib.import_module(name))
    assert tried and not failed, name
batch = {{"logits": torch.randn(8, 5), "labels": torch.randint(0, 5, (8,))}}
every = xcoll.gather(batch, to_cpu=True)
stats = xcoll.reduce({{"loss": torch.tensor(0.5), "seen": 8}}, {{"loss": "mean", "seen": "sum"}})
seed = xcoll.broadcast({{"seed": 1234}}, src=0)
assert torch.equal(every["logits"], batch["logits"]) and stats["seen"] == 8
assert seed == {{"seed": 1234}} and xcoll.gather_object([1, "a"]) == [[1, "a"]]
print("ok", torch.__version__, "torch_xla" in sys.modules)
"""


def test_a_world_of_one_runs_from_the_wheel(from_wheel, tmp_path):
    script = tmp_path / "alone.py"
    script.write_text(_WORLD_OF_ONE.format(checkout=str(ROOT)))
    result = run(script, from_wheel, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok ") and result.stdout.endswith(" False\n"), result.stdout


# Every kind of call, with every warning recorded: none may come from a torch
# API that this torch deprecates (torch 2.14 deprecates all_gather_into_tensor
# for all_gather_single, which xcoll then uses).
_EVERY_CALL = """
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    r = dist.get_rank()
    xcoll.gather({"x": torch.ones(2) * r, "n": r, "h": torch.ones(3, dtype=torch.float16)})
    xcoll.gather({"x": torch.ones(r + 1)}, uneven=True)
    xcoll.gather({"x": torch.ones(r + 1)}, max_size=4)
    xcoll.reduce({"x": torch.ones(2), "h": torch.ones(2, dtype=torch.bfloat16)}, "sum")
    xcoll.broadcast({"x": torch.ones(2)}, src=1)
    xcoll.gather_object({"r": r}), xcoll.broadcast_object([r], src=1), xcoll.barrier("b")
    xcoll.sync_rng_state(src=1)
    xcoll.gather(torch.ones(1), group=dist.new_group([0, 1]))
    with xcoll.consistency_checks("always"), xcoll.step(0):
        xcoll.reduce(torch.ones(1))
sys.stdout.write(f"warnings {sorted({str(w.message) for w in caught})}\\n")
"""


def test_torchrun_with_gloo_runs_the_docs_snippet_from_the_wheel_without_a_warning(
    from_wheel, tmp_path
):
    script = tmp_path / "script.py"
    code = snippet("torchrun").replace(
        "dist.destroy_process_group()", _EVERY_CALL + "dist.destroy_process_group()"
    )
    assert code.endswith(_EVERY_CALL + "dist.destroy_process_group()\n")
    script.write_text(
        "import os, sys, xcoll\n"
        f"assert not xcoll.__file__.startswith({str(ROOT)!r} + os.sep), xcoll.__file__\n"
        + code
    )
    result = run(script, from_wheel, *TORCHRUN_2, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "preds [0.0, 1.0, 2.0, 10.0, 11.0, 12.0]" in result.stdout, result.stdout
    assert "count [6] of 2 replicas" in result.stdout, result.stdout
    assert result.stdout.count("warnings []\n") == 2, result.stdout


def test_python_m_xcoll_demo_names_what_it_needs_without_torch_xla(from_wheel, tmp_path):
    # where torch_xla is missing (a plain install), the demo says how to get it
    code = (
        "import runpy, sys; sys.modules['torch_xla'] = None; "
        "runpy.run_module('xcoll.demo', run_name='__main__')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, **from_wheel},
    )
    assert result.returncode != 0
    assert "pip install 'xcoll[xla]'" in result.stderr, result.stderr[-3000:]
