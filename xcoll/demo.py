"""xcoll's demo: the evaluation loop of :mod:`xcoll.examples.eval_loop`
(``xcoll/examples/eval_loop.py``) on 4 XLA:CPU replicas, checked against the
same model evaluated in one process.

Run it with ``python -m xcoll.demo`` wherever xcoll and torch_xla are installed
(``pip install 'xcoll[xla]'``): the example ships in the package.
"""

from __future__ import annotations

import argparse
import importlib.util

import torch

from xcoll.examples import eval_loop as example
from xcoll.testing import XlaPool, xla_counters


def compiled_graphs(samples: int, replicas: int, batch: int) -> list[str]:
    """The programs the demo compiles, once each (the replicas' threads share
    one compile cache), as seen with PT_XLA_DEBUG_LEVEL=2. The loop's gathers
    are made with ``sync=False``, so each sync in the loop runs one batch's
    gather with the next batch's forward pass and accumulation (the first:
    the first two batches' forward passes and the first's gather), and syncs
    of one shape share a program; the sync after the loop runs the last
    batch's gather alone; the final reduce is a small call, whose collective
    is one program that every small call shares, and so does the first
    call's consistency check (a small exchange)."""
    per_replica = -(-samples // replicas)  # DistributedSampler pads to a multiple
    batches, short = -(-per_replica // batch), per_replica % batch != 0
    graphs = ["the small calls' all-gather (the first call's consistency check's too)"]
    if batches == 1:
        return graphs + ["the only batch and its gather"]
    graphs.append("the first two batches")
    if batches > 3 or (batches == 3 and not short):
        graphs.append("a batch's gather with the next full batch")
    if batches >= 3 and short:
        graphs.append("a batch's gather with the last, shorter batch")
    return graphs + ["the last batch's gather"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--replicas",
        type=int,
        default=4,
        help="XLA:CPU replicas, one thread each in one worker process (default: 4)",
    )
    parser.add_argument(
        "--samples",
        type=int,
        default=1001,
        help="dataset size; the default is a multiple of neither the replicas nor the batch, "
        "so the sampler pads and the last batch is shorter (default: 1001)",
    )
    parser.add_argument(
        "--batch", type=int, default=32, help="batch size per replica (default: 32)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        found = importlib.util.find_spec("torch_xla") is not None
    except (ImportError, ValueError):  # (a module that stands in for it)
        found = False
    if not found:
        raise SystemExit(
            "the demo runs its eval loop on XLA:CPU replicas and needs torch_xla: "
            "pip install 'xcoll[xla]' (xcoll.examples.eval_loop also runs under torchrun "
            "without it: python -m xcoll.examples.eval_loop --help)"
        )

    print(
        f"xcoll demo: eval loop on {args.replicas} XLA:CPU replicas, "
        f"{args.samples} samples, batch {args.batch}"
    )
    _progress(f"starting {args.replicas} replicas")
    with XlaPool(args.replicas) as pool:
        before = pool.run(xla_counters)[0]
        _progress("replicas started; running the eval loop on each (compiles its programs first)")
        results = pool.run(example.evaluate, [(args.samples, args.batch, "xla")] * args.replicas)
        after = pool.run(xla_counters)[0]
    _progress("eval loop done; evaluating the same model in one process")
    r0, ref = results[0], example.reference(args.samples)
    executions = (after["executions"] - before["executions"]) / args.replicas
    same = all(torch.equal(r["preds"], r0["preds"]) and r["loss"] == r0["loss"] for r in results)

    print(f"  the loop: {example.__file__}")
    print(
        f"  predictions: {len(r0['preds'])} in dataset order, each sample once "
        f"(equal to the single-process ones: {torch.equal(r0['preds'], ref['preds'])}; "
        f"the same on every replica: {same})"
    )
    print(f"  accuracy: {r0['accuracy']:.4f}   single-process reference: {ref['accuracy']:.4f}")
    print(f"  mean loss: {r0['loss']:.6f}   single-process reference: {ref['loss']:.6f}")
    graphs = compiled_graphs(args.samples, args.replicas, args.batch)
    compiles = after["compiles"] - before["compiles"]
    print(
        f"  graph executions per replica: {executions:g} "
        f"({r0['batches']} batches, one per batch: its gather with the next batch's work; "
        "one for the final reduce, one for the consistency check of each replica's first "
        "call); "
        f"compilations: {compiles} ({', '.join(graphs)})"
    )
    ok = (
        same
        and torch.equal(r0["preds"], ref["preds"])
        and r0["count"] == args.samples
        and abs(r0["accuracy"] - ref["accuracy"]) < 1e-9
        and abs(r0["loss"] - ref["loss"]) < 1e-4
        and executions == r0["batches"] + 2
        and compiles == len(graphs)
    )
    print("  OK" if ok else "  MISMATCH")
    return 0 if ok else 1


def _progress(text: str) -> None:
    """A progress line, printed at once (a pipe would hold it until the end)."""
    print(f"  ... {text}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
