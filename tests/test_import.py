"""``import xcoll`` works without torch_xla, and using it on CPU never imports it."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_xcoll_works_without_torch_xla():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["torch_xla"] = None  # any import of torch_xla now fails
        import torch, xcoll
        out = xcoll.gather({"x": torch.arange(3), "n": 2})
        assert torch.equal(out["x"], torch.arange(3)) and out["n"] == [2]
        assert xcoll.reduce(torch.ones(2), "max").tolist() == [1.0, 1.0]
        assert xcoll.broadcast(1.5) == 1.5 and xcoll.world_size() == 1 and xcoll.rank() == 0
        import xcoll.testing
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_cpu_use_does_not_import_torch_xla():
    code = (
        "import sys, torch, xcoll; xcoll.gather(torch.ones(1)); print('torch_xla' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
