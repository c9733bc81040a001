"""An evaluation loop on 4 XLA:CPU replicas, aggregated with xcoll.

Every replica evaluates its shard of a synthetic dataset with the same model.
Per batch, one ``xcoll.gather(..., to_cpu=True)`` brings every replica's
predictions and labels to the host in one graph execution (the forward pass runs
in that same execution); loss and accuracy counters stay on the device and are
reduced once at the end. The result is checked against the same model evaluated
in one process over the whole dataset.

Run it with ``python -m xcoll.demo``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import xcoll
from xcoll.testing import XlaPool, xla_counters

FEATURES, CLASSES = 16, 5


def make_model() -> torch.nn.Module:
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, CLASSES)
    )
    # The same weights on every replica, from a generator of our own: replica
    # threads share torch's global generator, so seeding it would race.
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def make_dataset(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, FEATURES, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def evaluate_replica(args: tuple[int, int]) -> dict:
    """One replica's eval loop over its shard (samples rank, rank + W, ...)."""
    import torch_xla

    n, batch = args
    dev = torch_xla.device()
    rank, world = xcoll.rank(), xcoll.world_size()
    model = make_model().to(dev).eval()
    x, y = make_dataset(n)
    x, y = x[rank::world], y[rank::world]

    loss_sum = torch.zeros((), device=dev)
    correct = torch.zeros((), dtype=torch.int64, device=dev)
    preds, labels = [], []
    with torch.no_grad():
        for i in range(0, len(x), batch):
            xb, yb = x[i : i + batch].to(dev), y[i : i + batch].to(dev)
            logits = model(xb)
            pred = logits.argmax(-1)
            loss_sum = loss_sum + F.cross_entropy(logits, yb, reduction="sum")
            correct = correct + (pred == yb).sum()
            # one execution: this batch's forward pass, counters and the gather
            out = xcoll.gather({"pred": pred, "label": yb}, to_cpu=True)
            preds.append(out["pred"])
            labels.append(out["label"])
    totals = xcoll.reduce({"loss_sum": loss_sum, "correct": correct, "count": len(x)}, "sum")
    return {
        "preds": torch.cat(preds),
        "labels": torch.cat(labels),
        "loss": totals["loss_sum"].item() / totals["count"],
        "accuracy": totals["correct"].item() / totals["count"],
        "count": totals["count"],
        "batches": -(-len(x) // batch),
    }


def reference(n: int) -> dict:
    """The same evaluation in one process over the whole dataset."""
    model = make_model().eval()
    x, y = make_dataset(n)
    with torch.no_grad():
        logits = model(x)
    return {
        "loss": F.cross_entropy(logits, y, reduction="sum").item() / n,
        "accuracy": (logits.argmax(-1) == y).float().mean().item(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)
    if args.samples % (args.replicas * args.batch):
        parser.error(
            "--samples must be a multiple of --replicas * --batch (uneven shards: see docs)"
        )

    with XlaPool(args.replicas) as pool:
        before = pool.run(xla_counters)[0]
        results = pool.run(evaluate_replica, [(args.samples, args.batch)] * args.replicas)
        after = pool.run(xla_counters)[0]
    r0, ref = results[0], reference(args.samples)
    executions = (after["executions"] - before["executions"]) / args.replicas
    same = all(torch.equal(r["preds"], r0["preds"]) and r["loss"] == r0["loss"] for r in results)

    print(
        f"xcoll demo: eval loop on {args.replicas} XLA:CPU replicas, {args.samples} samples, batch {args.batch}"
    )
    print(f"  gathered predictions: {len(r0['preds'])} (every replica holds all of them: {same})")
    print(f"  accuracy: {r0['accuracy']:.4f}   single-process reference: {ref['accuracy']:.4f}")
    print(f"  mean loss: {r0['loss']:.6f}   single-process reference: {ref['loss']:.6f}")
    print(
        f"  graph executions per replica: {executions:g} "
        f"({r0['batches']} batches, one per batch, plus one for the final reduce); "
        f"compilations: {after['compiles'] - before['compiles']}"
    )
    ok = (
        same
        and len(r0["preds"]) == args.samples
        and abs(r0["accuracy"] - ref["accuracy"]) < 1e-9
        and abs(r0["loss"] - ref["loss"]) < 1e-4
        and executions == r0["batches"] + 1
    )
    print("  OK" if ok else "  MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
