"""The README's first screen and docs/metrics.md run as a user runs them: a
script whose ``main(index)`` holds the snippets, started by ``torch_xla.launch``
on 4 XLA:CPU replicas; every replica's results are checked on the host. The
reproducer in docs/design.md runs as the plain script it is. And every python
block of README.md and docs/ runs in some test."""

from __future__ import annotations

import re
import signal
import textwrap
from pathlib import Path

import torch
import torch.nn.functional as F

from tests.helpers import XLA_CPU, run

ROOT = Path(__file__).resolve().parents[1]
README, METRICS, DESIGN = ROOT / "README.md", ROOT / "docs" / "metrics.md", ROOT / "docs" / "design.md"
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
    # one print per replica (print writes its newline separately: another
    # replica's line may come between the two, so lines are not relied on)
    ranks = re.findall(r"(\d) of 4: torch\.Size\(\[32, 5\]\) \{'loss': tensor\(", result.stdout)
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


# What docs/metrics.md says its snippets are given, built alike on every replica.
_METRICS_CONTEXT = """
import torch, torch_xla, xcoll
import torch.nn.functional as F

dev, W, r = torch_xla.device(), xcoll.world_size(), xcoll.rank()
with LOCK:
    torch.tensor([0]).to(dev).item()
g = torch.Generator().manual_seed(0)  # (torch's global one is shared by the replica threads)
dataset = torch.utils.data.TensorDataset(
    torch.randn(10, 5, generator=g), torch.randint(0, 5, (10,), generator=g), torch.arange(10)
)
pred, label = dataset.tensors[0][r::W].argmax(-1).to(dev), dataset.tensors[1][r::W].to(dev)
sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=W, rank=r, shuffle=False)
batches = []
for p, (logits, y, idx) in enumerate(torch.utils.data.DataLoader(dataset, 2, sampler=sampler)):
    keep = r + W * (2 * p + torch.arange(len(idx))) < len(dataset)  # the sampler's repeats
    batches.append((logits.to(dev), y.to(dev), idx.to(dev), keep.to(dev)))
"""


def test_metrics_md_runs_under_torch_xla_launch(tmp_path):
    from torchmetrics import MeanMetric
    from torchmetrics.classification import MulticlassAccuracy

    uneven, ordered, sums, torchmetrics, hooked = blocks(METRICS)
    script = tmp_path / "metrics.py"
    script.write_text(
        launched(
            _METRICS_CONTEXT,
            uneven,
            "uneven = out  # (the next snippet reuses the name)\n",
            ordered,
            sums,
            torchmetrics,
            "computed = values  # (the next snippet reuses the name)\n",
            hooked,
            save(tmp_path, "batches", "uneven", "ordered", "totals", "computed", "values", "acc"),
        )
    )
    _, outs = launch(script)

    g = torch.Generator().manual_seed(0)  # the context's dataset
    logits, y = torch.randn(10, 5, generator=g), torch.randint(0, 5, (10,), generator=g)
    # one process over every replica's batches, repeats included, as the replicas saw them
    acc, loss = MulticlassAccuracy(5), MeanMetric()
    for o in outs:
        for b_logits, b_y, _, _ in o["batches"]:
            acc.update(b_logits, b_y)
            loss.update(F.cross_entropy(b_logits, b_y, reduction="none"))
    seen = torch.cat([idx[keep] for o in outs for _, _, idx, keep in o["batches"]])
    assert torch.equal(seen.sort().values, torch.arange(10))  # keep marks the repeats
    for r, o in enumerate(outs):
        assert torch.equal(o["uneven"]["pred"], torch.cat([logits[q::W].argmax(-1) for q in range(W)]))
        assert torch.equal(o["uneven"]["label"], torch.cat([y[q::W] for q in range(W)]))
        assert torch.equal(o["ordered"]["pred"], logits.argmax(-1)), r
        assert torch.allclose(o["totals"]["loss_sum"], F.cross_entropy(logits, y, reduction="sum"))
        assert o["totals"]["correct"] == (logits.argmax(-1) == y).sum(), r
        assert o["totals"]["count"] == 10, r
        for values in (o["computed"], o["values"]):  # (compute, then sync_with_xcoll's)
            assert torch.equal(values["acc"], acc.compute()), r
            assert torch.allclose(values["loss"], loss.compute()), r
        assert torch.equal(o["acc"], acc.compute()), r
    for key in ("uneven", "totals", "computed", "values"):
        same_on_every_replica(outs, key)


def test_design_md_reproducer_runs(tmp_path):
    # It reproduces a crash (torch_xla's race on the first .item(), 2 runs in
    # 200): one run prints "ok" or dies of the SIGSEGV it is there to show;
    # anything else (an API it uses gone, an error) fails.
    (code,) = blocks(DESIGN)
    script = tmp_path / "race.py"
    script.write_text(code)
    result = run(script, {})
    assert (result.returncode, result.stdout) == (0, "ok\n") or (
        result.returncode == -signal.SIGSEGV
    ), result.stderr[-3000:]


def test_every_python_block_of_the_readme_and_docs_runs_in_a_test():
    from tests import (
        test_demo_and_docs,
        test_grad,
        test_launchers,
        test_migration,
        test_out_of_step,
    )

    ran = {
        *readme_first_screen(),
        test_demo_and_docs.readme_pool_example(),
        *blocks(METRICS),
        *blocks(DESIGN),
        test_launchers.snippet("xla"),
        test_launchers.snippet("torchrun"),
        test_launchers.snippet("exit"),
        test_launchers.snippet("results"),
        test_out_of_step.snippet(),
        test_grad.snippet(),
        *(code for s in test_migration.SECTIONS.values() for _, code in s.values()),
    }
    docs = [README, *sorted((ROOT / "docs").glob("*.md"))]
    found = [(path.name, code) for path in docs for code in blocks(path)]
    assert len(found) >= 34  # (the fence pattern finds them: 3 + 4 + 1 + 2 + 24 today)
    for name, code in found:
        assert code in ran, f"{name}: this python block runs in no test:\n{code}"
