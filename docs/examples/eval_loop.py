"""A complete evaluation loop with xcoll (what ``python -m xcoll.demo`` runs).

Every replica evaluates its share of a synthetic dataset with the same model.
The dataset's length is a multiple neither of the number of replicas nor of the
batch size, so ``DistributedSampler`` pads it with repeated samples and the last
batch is short. Still, every sample is counted exactly once:

* predictions: each batch's predictions and dataset indices are gathered to the
  host in one call (one graph execution, which also runs the forward pass);
  ``xcoll.by_index`` then puts them in dataset order, each sample once;
* metrics: loss and accuracy accumulate on the device, with the sampler's padding
  masked out, with no sync inside the loop beyond the per-batch gather; one
  ``xcoll.reduce`` at the end gives the global values;
* each batch's call is tagged with ``xcoll.step``: a replica whose own code
  raised in a batch and went on would otherwise pair its later gathers with
  the others' earlier batches.

``evaluate`` runs on each replica: with ``xcoll.testing.XlaPool(4).run(evaluate,
...)`` on XLA:CPU, or in any process of a torch.distributed job.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

import xcoll

FEATURES, CLASSES = 16, 5


def make_model() -> torch.nn.Module:
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, CLASSES)
    )
    # The same weights on every replica, from a generator of its own: replica
    # threads (XLA:CPU) share torch's global generator, so seeding it would race.
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def make_dataset(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, FEATURES, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def replica_device() -> torch.device:
    import sys

    torch_xla = sys.modules.get("torch_xla")
    if torch_xla is not None and torch_xla._XLAC._xla_runtime_is_initialized():
        return torch_xla.device()
    return torch.device("cpu")


def evaluate(args: tuple[int, int]) -> dict:
    """One replica's loop over its shard of ``n`` samples in batches of ``batch``."""
    n, batch = args
    dev = replica_device()
    rank, world = xcoll.rank(), xcoll.world_size()
    model = make_model().to(dev)
    x, y = make_dataset(n)

    mine = torch.tensor(list(DistributedSampler(range(n), world, rank, shuffle=True, seed=0)))
    # The sampler pads to a multiple of W by repeating samples: position p of this
    # replica is sample p * W + rank of the padded order, a repeat if >= n.
    real = rank + world * torch.arange(len(mine)) < n

    loss_sum = torch.zeros((), device=dev)
    correct = torch.zeros((), dtype=torch.int64, device=dev)
    count = torch.zeros((), dtype=torch.int64, device=dev)
    preds, index = [], []
    with torch.no_grad():
        for start in range(0, len(mine), batch):  # the same batches on every replica
            idx = mine[start : start + batch]
            xb, yb, keep = x[idx].to(dev), y[idx].to(dev), real[start : start + batch].to(dev)
            logits = model(xb)
            pred = logits.argmax(-1)
            loss_sum = loss_sum + (F.cross_entropy(logits, yb, reduction="none") * keep).sum()
            correct = correct + ((pred == yb) & keep).sum()
            count = count + keep.sum()
            with xcoll.step(start):  # names the batch's call (docs/reliability.md)
                out = xcoll.gather({"pred": pred, "index": idx.to(dev)}, to_cpu=True)
            preds.append(out["pred"])
            index.append(out["index"])

    totals = xcoll.reduce(
        {"loss_sum": loss_sum, "correct": correct, "count": count}, "sum", tag="totals"
    )
    ordered = xcoll.by_index({"pred": torch.cat(preds)}, torch.cat(index), length=n)
    return {
        "preds": ordered["pred"],  # every sample once, in dataset order
        "loss": totals["loss_sum"].item() / totals["count"].item(),
        "accuracy": totals["correct"].item() / totals["count"].item(),
        "count": totals["count"].item(),
        "batches": -(-len(mine) // batch),
    }


def reference(n: int) -> dict:
    """The same evaluation in one process over the whole dataset."""
    model = make_model()
    x, y = make_dataset(n)
    with torch.no_grad():
        logits = model(x)
    return {
        "preds": logits.argmax(-1),
        "loss": F.cross_entropy(logits, y, reduction="sum").item() / n,
        "accuracy": (logits.argmax(-1) == y).double().mean().item(),
    }
