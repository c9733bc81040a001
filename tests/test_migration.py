"""Every snippet of docs/migration.md runs: each "after" on XLA:CPU and gloo
replicas, each runnable "before" on its pool, compared with its "after"."""

from __future__ import annotations

import os
import re
from pathlib import Path

import optree
import pytest
import torch

import xcoll
from tests.helpers import assert_trees, same_values
from tests.replicas import device, shared_pool, to_cpu

DOC = Path(__file__).parent.parent / "docs" / "migration.md"
BLOCK = re.compile(r"<!-- (before: [^>]*|after|after: per replica) -->\n```python\n(.*?)```", re.S)


def sections() -> dict[str, dict[str, tuple[str, str]]]:
    out = {}
    for chunk in DOC.read_text().split("\n## ")[1:]:
        title = chunk.splitlines()[0].strip()
        blocks = {}
        for marker, code in BLOCK.findall(chunk):
            kind = "before" if marker.startswith("before") else "after"
            blocks[kind] = (marker, code)
        out[title] = blocks
    return out


SECTIONS = sections()


def _snippet(code):
    dev, rank = device(), xcoll.rank()
    g = torch.Generator().manual_seed(rank)
    tree = {
        "logits": torch.randn(4, 3, generator=g).to(dev),
        "labels": (torch.arange(4) + 10 * rank).to(dev),
    }
    obj = {"rank": rank, "name": f"r{rank}", "values": [1.5, None]}
    if "accelerate" in code:
        os.environ["USE_TORCH_XLA"] = "0"  # accelerate would otherwise import torch_xla
        from accelerate import Accelerator

        Accelerator(cpu=True)  # joins the process group the pool initialised
    if dev.type != "xla":
        torch.manual_seed(rank)  # (the replica threads of XLA:CPU share this generator)
    namespace = {"torch": torch, "xcoll": xcoll, "tree": tree, "obj": obj, "rank": rank, "dev": dev}
    exec(compile(code, str(DOC), "exec"), namespace)  # our own documentation's code
    return to_cpu(namespace["result"]) if namespace["result"] is not None else None


def test_every_section_has_an_after_and_says_what_happens_to_its_before():
    assert len(SECTIONS) == 14
    for title, blocks in SECTIONS.items():
        assert "after" in blocks and "before" in blocks, title
        marker = blocks["before"][0]
        assert marker in (
            "before: xla",
            "before: xla-1",
            "before: gloo",
            "before: gloo, not compared",
            "before: gloo, compared sorted",
        ), title


@pytest.mark.parametrize("title", list(SECTIONS))
@pytest.mark.parametrize("world", ["xla-cpu-2", "gloo-2"])
def test_after_runs_and_agrees_on_every_replica(title, world):
    pool = shared_pool(world)
    marker, after = SECTIONS[title]["after"]
    results = pool.run(_snippet, [after] * pool.world_size)
    if marker == "after: per replica":  # (a reduce-scatter's, an all-to-all's: compared with its before)
        return
    for r in results[1:]:
        assert optree.tree_structure(r) == optree.tree_structure(results[0])
        assert_trees(r, results[0], same_values, title)


@pytest.mark.parametrize("title", list(SECTIONS))
def test_before_runs_and_gives_what_after_gives(title):
    marker, before = SECTIONS[title]["before"]
    pool = shared_pool(
        {"before: xla": "xla-cpu-2", "before: xla-1": "xla-cpu-1"}.get(marker, "gloo-2")
    )
    theirs = pool.run(_snippet, [before] * pool.world_size)
    ours = pool.run(_snippet, [SECTIONS[title]["after"][1]] * pool.world_size)
    if "not compared" in marker:
        return
    if "sorted" in marker:
        theirs = [t.sort().values for t in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert_trees(a, b, same_values, title)
