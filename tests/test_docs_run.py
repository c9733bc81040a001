"""The README's first screen runs as a user runs it: a script whose
``main(index)`` holds the snippets, started by ``torch_xla.launch`` on 4 XLA:CPU
replicas; every replica's results are checked on the host."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import torch
import torch.nn.functional as F

from tests.helpers import XLA_CPU, run

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^[ \t]*```(?:python|py)[ \t]*\n(.*?)^[ \t]*```", re.M | re.S)
W = 4


def blocks(path: Path) -> list[str]:
    return [textwrap.dedent(code) for code in FENCE.findall(path.read_text())]


def readme_first_screen() -> list[str]:
    # the first example, and its continuation under "On XLA: one program on every replica"
    return blocks(README)[:2]


def launched(*parts: str) -> str:
    """A script that runs ``parts``, in order, as the body of ``main(index)``
    on every replica that ``torch_xla.launch`` starts."""
    body = "".join(textwrap.indent(p, "    ") for p in parts)
    return (
        "import threading\n\nimport torch_xla\n\n"
        "LOCK = threading.Lock()  # the README's lock for a replica's first .item()\n\n\n"
        f"def main(index):\n{body}\n\nif __name__ == '__main__':\n    torch_xla.launch(main)\n"
    )


def save(out: Path, *names: str) -> str:
    """The test's own last lines in ``main``: each replica writes the named
    values, moved to the host, to ``out/<rank>.pt``."""
    values = ", ".join(f"{n}={n}" for n in names)
    return (
        "import optree\n"
        "torch.save(optree.tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, "
        f"dict({values})), {str(out)!r} + f'/{{xcoll.rank()}}.pt')\n"
    )


def launch(script: Path):
    # faulthandler: a segfault inside XLA names itself, and pytest reruns the test once
    result = run(script, {**XLA_CPU, "XLA_THREAD_POOL_SIZE": "16"}, "-X", "faulthandler")
    assert result.returncode == 0, result.stderr[-3000:]
    outs = [torch.load(script.parent / f"{r}.pt") for r in range(W)]
    return result, outs


def same_on_every_replica(outs, key):
    for r, o in enumerate(outs[1:], 1):
        for name in o[key]:
            a, b = o[key][name], outs[0][key][name]
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), (key, name, r)


def test_readme_first_screen_runs_under_torch_xla_launch(tmp_path):
    script = tmp_path / "readme.py"
    script.write_text(
        launched(*readme_first_screen(), save(tmp_path, "batch", "every", "stats", "seed", "sums"))
    )
    result, outs = launch(script)
    # rank order, one line per replica (the README prints one string per replica)
    ranks = re.findall(r"^(\d) of 4: torch\.Size\(\[32, 5\]\) \{'loss': tensor\(", result.stdout, re.M)
    assert sorted(ranks) == ["0", "1", "2", "3"], result.stdout

    logits = torch.cat([o["batch"]["logits"] for o in outs])
    labels = torch.cat([o["batch"]["labels"] for o in outs])
    assert not torch.equal(outs[0]["batch"]["logits"], outs[1]["batch"]["logits"])  # per replica
    mean_loss = torch.stack(
        [F.cross_entropy(o["batch"]["logits"], o["batch"]["labels"]) for o in outs]
    ).mean()
    keep = (labels > 0).float()
    kept_loss = (F.cross_entropy(logits, labels, reduction="none") * keep).sum()
    for r, o in enumerate(outs):
        assert torch.equal(o["every"]["logits"], logits) and torch.equal(o["every"]["labels"], labels), r
        assert torch.allclose(o["stats"]["loss"], mean_loss) and o["stats"]["seen"] == 8 * W, r
        assert o["seed"] == {"seed": 1234}, r
        assert torch.allclose(o["sums"]["loss"], kept_loss) and torch.equal(o["sums"]["seen"], keep.sum()), r
    same_on_every_replica(outs, "stats")
    same_on_every_replica(outs, "sums")
