"""What the environment says about how this process was launched, for errors
that name the cause of a launch that went wrong (docs/launchers.md)."""

from __future__ import annotations

import os


def launch_hint(xla_leaves: bool) -> str:
    """Where torchrun's environment says this process is one of several but
    XLA's runtime runs it as a world of one: the likely cause, for an error.
    A process group initialised first serves CPU leaves only: XLA leaves still
    go to XLA's world of one (seen with accelerate's XLA path under torchrun)."""
    world = os.environ.get("WORLD_SIZE", "1")
    if not world.isdigit() or int(world) <= 1:
        return ""
    return (
        f". This process was started as rank {os.environ.get('RANK', '?')} of {world} "
        "(torchrun's environment), but XLA's runtime runs it as a world of one: something "
        "started the XLA runtime instead of torch.distributed (accelerate does when torch_xla "
        "is installed: set USE_TORCH_XLA=0)"
        + ("" if xla_leaves else ", or call torch.distributed.init_process_group first")
        + " (docs/launchers.md)"
    )
