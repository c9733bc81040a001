"""A complete evaluation loop with xcoll (what ``python -m xcoll.demo`` runs).

Every replica evaluates its share of a synthetic dataset with the same model.
The dataset's length is a multiple neither of the number of replicas nor of the
batch size, so ``DistributedSampler`` pads it with repeated samples and the last
batch is short. Still, every sample is counted exactly once:

* predictions: each batch's predictions and dataset indices are gathered in
  one call with ``sync=False``, which the next batch's ``xcoll.sync()``
  completes: on torch.distributed the gather is in flight while the next
  batch's forward pass computes (the call returns at once); on XLA that sync
  is one execution of the gather and the next forward pass. ``xcoll.by_index``
  then puts them in dataset order, each sample once;
* metrics: loss and accuracy accumulate on the device, with the sampler's padding
  masked out, with no sync inside the loop beyond the per-batch gather; one
  ``xcoll.reduce`` at the end gives the global values;
* each batch's gather is tagged with its batch (``tag=start``): a replica
  whose own code raised in a batch and went on would otherwise pair its later
  gathers with the others' earlier batches. (A tag, not an ``xcoll.step``
  block: a block's end is its group's next call, which would complete the
  gather in flight before the next batch's forward pass.)

``evaluate`` runs on each replica: with ``xcoll.testing.XlaPool(4).run(evaluate,
...)`` on XLA:CPU (what ``python -m xcoll.demo`` does), or in every process of
a torch.distributed job, which this module is when run by torchrun::

    torchrun --nproc-per-node 2 -m xcoll.examples.eval_loop

(on several hosts: docs/launchers.md, "Across hosts").
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler, TensorDataset

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


def replica_device(kind: str) -> torch.device:
    """The replica's device of ``kind``: ``"xla"``, this replica's XLA device
    (``torch_xla.device()``), or ``"cpu"`` (a torch.distributed process with
    gloo, or a world of one)."""
    if kind == "xla":
        import torch_xla

        dev: torch.device = torch_xla.device()
        return dev
    return torch.device(kind)


def _completed(out: dict[str, torch.Tensor], preds: list[torch.Tensor], index: list[torch.Tensor]) -> None:
    """Completes the calls in flight (on torch.distributed: waits for their
    collectives, which ran during this batch's forward; on XLA: one execution
    of everything pending) and keeps a gather's results on the host."""
    xcoll.sync()
    preds.append(out["pred"].cpu())
    index.append(out["index"].cpu())


def evaluate(args: tuple[int, int, str]) -> dict[str, Any]:
    """One replica's loop over its shard of ``n`` samples in batches of
    ``batch``, with its tensors on a device of ``kind`` (``args``: ``(n, batch,
    kind)``, as :meth:`xcoll.testing.ReplicaPool.run` passes one argument)."""
    n, batch, kind = args
    dev = replica_device(kind)
    rank, world = xcoll.rank(), xcoll.world_size()
    model = make_model().to(dev)
    x, y = make_dataset(n)

    sampler: DistributedSampler[Any] = DistributedSampler(
        TensorDataset(x, y), world, rank, shuffle=True, seed=0
    )
    mine = torch.tensor(list(sampler))
    # The sampler pads to a multiple of W by repeating samples: position p of this
    # replica is sample p * W + rank of the padded order, a repeat if >= n.
    real = rank + world * torch.arange(len(mine)) < n

    loss_sum = torch.zeros((), device=dev)
    correct = torch.zeros((), dtype=torch.int64, device=dev)
    count = torch.zeros((), dtype=torch.int64, device=dev)
    preds: list[torch.Tensor] = []
    index: list[torch.Tensor] = []
    in_flight = None  # the previous batch's gather, not yet completed
    with torch.no_grad():
        for start in range(0, len(mine), batch):  # the same batches on every replica
            idx = mine[start : start + batch]
            xb, yb, keep = x[idx].to(dev), y[idx].to(dev), real[start : start + batch].to(dev)
            logits = model(xb)
            pred = logits.argmax(-1)
            loss_sum = loss_sum + (F.cross_entropy(logits, yb, reduction="none") * keep).sum()
            correct = correct + ((pred == yb) & keep).sum()
            count = count + keep.sum()
            if in_flight is not None:
                _completed(in_flight, preds, index)
            # (tagged with its batch: docs/reliability.md)
            in_flight = xcoll.gather({"pred": pred, "index": idx.to(dev)}, sync=False, tag=start)
    if in_flight is not None:
        _completed(in_flight, preds, index)

    # (read on the host: to_cpu fetches them with the call's one transfer)
    totals = xcoll.reduce(
        {"loss_sum": loss_sum, "correct": correct, "count": count}, "sum", to_cpu=True, tag="totals"
    )
    ordered = xcoll.by_index({"pred": torch.cat(preds)}, torch.cat(index), length=n)
    return {
        "preds": ordered["pred"],  # every sample once, in dataset order
        "loss": totals["loss_sum"].item() / totals["count"].item(),
        "accuracy": totals["correct"].item() / totals["count"].item(),
        "count": totals["count"].item(),
        "batches": -(-len(mine) // batch),
    }


def reference(n: int) -> dict[str, Any]:
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


def main(argv: list[str] | None = None) -> int:
    """Every process of a torch.distributed job (gloo, CPU tensors) evaluates
    its shard and checks the gathered result against :func:`reference`; each
    prints one line, and the exit status is 0 where its result matched."""
    import torch.distributed as dist

    parser = argparse.ArgumentParser(
        description="xcoll's eval loop in every process of a torchrun job (gloo), e.g. "
        "torchrun --nproc-per-node 2 -m xcoll.examples.eval_loop"
    )
    parser.add_argument("--samples", type=int, default=1001)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    try:
        out = evaluate((args.samples, args.batch, "cpu"))
        ref = reference(args.samples)
        ok = (
            torch.equal(out["preds"], ref["preds"])
            and out["count"] == args.samples
            and out["accuracy"] == ref["accuracy"]
            and abs(out["loss"] - ref["loss"]) < 1e-5
        )
        node, local = os.environ.get("GROUP_RANK", "?"), os.environ.get("LOCAL_RANK", "?")
        where = f"node {node}, local rank {local}"
        # one write per line: the processes share the launcher's stdout
        sys.stdout.write(
            f"rank {xcoll.rank()} of {xcoll.world_size()} ({where}): {out['count']} samples, "
            f"accuracy {out['accuracy']:.4f}, mean loss {out['loss']:.6f}: "
            f"{'OK' if ok else 'MISMATCH'} against one process\n"
        )
        sys.stdout.flush()
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
