"""A contrastive (InfoNCE, CLIP-style) training step with a differentiable gather.

Every replica embeds its shard of a batch of (image, text) pairs with the same
two linear encoders. One ``xcoll.gather({"img": ..., "txt": ...}, grad=True)``
gives every replica every replica's embeddings, and each replica scores its
own rows against all of them, in both directions. Replica ``r``'s loss is the
mean cross-entropy of its own rows.

How the gradients come out right: the gradient that reaches a replica's
embeddings through the gather is the derivative of the *sum* of every
replica's loss (xcoll's semantics: docs/design.md, "Differentiable calls"). So
each replica's parameter gradient is its share of the derivative of ``sum_r
loss_r``, and their *mean* over replicas, which DDP computes (or one
``xcoll.reduce(grads, "mean")``), is the derivative of ``mean_r loss_r``: with
shards of equal size, exactly the loss of single-process training on the full
batch (the mean over all rows). No loss scaling is needed; with shards of
different sizes, weigh each replica's loss by its share of the rows.

``main`` checks against single-process training on the full batch: under
torchrun, the averaged parameter gradients of one step (DDP); on XLA
replicas, the parameters after a training loop of ``--steps`` steps (20)
written as users write one, each step one execution: the forward's gather
with ``sync=False``, backward, the gradients averaged with one ``sync=False``
reduce, the optimizer's update, one ``xcoll.sync()``; then a metrics reduce,
and the mean loss printed every 5 steps::

    torchrun --nproc-per-node 2 -m xcoll.examples.contrastive        # gloo, DDP
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python -m xcoll.examples.contrastive --xla

Each prints the largest difference and exits with status 1 if it is larger
than float32's tolerance (on XLA, a replica raises and ``torch_xla.launch``
fails).
"""

from __future__ import annotations

import argparse
import sys
import threading

import torch
import torch.nn.functional as F

import xcoll

IMAGE, TEXT, DIM, PER_REPLICA = 12, 8, 6, 4
TEMPERATURE = 0.1
TOLERANCE = 1e-5
STEPS, LR = 20, 0.5


class Encoders(torch.nn.Module):
    """Two linear encoders, initialised from a seed (the same on every replica)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.image = torch.nn.Parameter(torch.randn(IMAGE, DIM, generator=g) / IMAGE**0.5)
        self.text = torch.nn.Parameter(torch.randn(TEXT, DIM, generator=g) / TEXT**0.5)

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            "img": F.normalize(images @ self.image, dim=-1),
            "txt": F.normalize(texts @ self.text, dim=-1),
        }


def batch(world: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The full batch of ``world * PER_REPLICA`` (image, text) pairs."""
    g = torch.Generator().manual_seed(seed)
    n = world * PER_REPLICA
    return torch.randn(n, IMAGE, generator=g), torch.randn(n, TEXT, generator=g)


def info_nce(
    mine: dict[str, torch.Tensor], every: dict[str, torch.Tensor], labels: torch.Tensor
) -> torch.Tensor:
    """The symmetric InfoNCE loss of ``mine``'s rows against ``every`` row,
    the positives at ``labels``: the mean cross-entropy in both directions."""
    to_text = mine["img"] @ every["txt"].t() / TEMPERATURE
    to_image = mine["txt"] @ every["img"].t() / TEMPERATURE
    return (F.cross_entropy(to_text, labels) + F.cross_entropy(to_image, labels)) / 2


def local_loss(
    model: torch.nn.Module,
    images: torch.Tensor,
    texts: torch.Tensor,
    device: torch.device | str,
    sync: bool = True,
) -> torch.Tensor:
    """This replica's loss on its shard (rows ``rank * PER_REPLICA`` on of the
    full batch): its embeddings against every replica's, gathered with
    ``grad=True`` (``sync=False`` inside an XLA training step)."""
    rank = xcoll.rank()
    shard = slice(rank * PER_REPLICA, (rank + 1) * PER_REPLICA)
    mine = model(images[shard].to(device), texts[shard].to(device))
    every: dict[str, torch.Tensor] = xcoll.gather(mine, grad=True, sync=sync)
    # (uploaded, not made on the device from the rank: one program everywhere)
    labels = torch.arange(PER_REPLICA) + rank * PER_REPLICA
    return info_nce(mine, every, labels.to(device))


def reference(world: int) -> dict[str, torch.Tensor]:
    """The parameter gradients of single-process training on the full batch."""
    model = Encoders()
    images, texts = batch(world)
    out = model(images, texts)
    info_nce(out, out, torch.arange(len(images))).backward()
    return gradients(model)


def gradients(model: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """The parameters' gradients by name (``prefix`` removed), zeros where none."""
    return {
        name.removeprefix(prefix): torch.zeros_like(p) if p.grad is None else p.grad
        for name, p in model.named_parameters()
    }


def largest_difference(grads: dict[str, torch.Tensor], world: int) -> float:
    expected = reference(world)
    return max(float((grads[k].cpu() - expected[k]).abs().max()) for k in expected)


def _report(difference: float) -> None:
    print(f"contrastive step: largest difference from single-process training {difference:.2e}")
    if difference > TOLERANCE:
        sys.exit(1)


def gloo_step() -> float:
    """One step in a torchrun job (gloo, DDP); returns the largest difference."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        model = torch.nn.parallel.DistributedDataParallel(Encoders())
        images, texts = batch(dist.get_world_size())
        local_loss(model, images, texts, "cpu").backward()  # DDP averages the gradients
        grads = gradients(model, "module.")
        return largest_difference(grads, dist.get_world_size())
    finally:
        dist.destroy_process_group()


# The first .item() of a thread-per-device process, made once (README: "On XLA").
_FIRST_ITEM = threading.Lock()


def trained(world: int, steps: int) -> dict[str, torch.Tensor]:
    """The parameters after ``steps`` SGD steps of single-process training on
    the full batch."""
    model = Encoders()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    images, texts = batch(world)
    for _ in range(steps):
        out = model(images, texts)
        info_nce(out, out, torch.arange(len(images))).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach() for name, p in model.named_parameters()}


def xla_train(index: int = 0, steps: int = STEPS) -> float:
    """A training loop on an XLA replica (``torch_xla.launch``); returns the
    largest difference of its parameters from :func:`trained`'s."""
    import torch_xla

    device = torch_xla.device()
    with _FIRST_ITEM:
        torch.tensor([0]).to(device).item()
    model = Encoders().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    images, texts = batch(xcoll.world_size())
    for step in range(steps):
        loss = local_loss(model, images, texts, device, sync=False)
        loss.backward()
        grads = xcoll.reduce(gradients(model), "mean", sync=False)  # (what DDP does)
        for name, p in model.named_parameters():
            p.grad = grads[name]
        optimizer.step()
        optimizer.zero_grad()
        xcoll.sync()  # the step: one execution per replica
        metrics = xcoll.reduce({"loss": loss.detach()}, "mean")
        if step % 5 == 0 and xcoll.rank() == 0:
            print(f"step {step}: loss {float(metrics['loss']):.4f}", flush=True)
    expected = trained(xcoll.world_size(), steps)
    got = xcoll.gather({k: p.detach() for k, p in model.named_parameters()}, to_cpu=True, stack=True)
    difference = max(float((got[k] - expected[k]).abs().max()) for k in expected)
    if xcoll.rank() == 0:
        print(f"contrastive training: largest difference from single-process training {difference:.2e}")
    if difference > TOLERANCE * steps:  # (raised in a replica, torch_xla.launch fails)
        raise RuntimeError(f"replica {xcoll.rank()}: parameters differ by {difference:.2e}")
    return difference


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--xla", action="store_true", help="run on XLA replicas (torch_xla.launch)")
    parser.add_argument("--steps", type=int, default=STEPS, help="training steps on XLA")
    args = parser.parse_args(argv)
    if args.xla:
        import torch_xla

        torch_xla.launch(xla_train, args=(args.steps,))
        return
    _report(gloo_step())


if __name__ == "__main__":
    main()
