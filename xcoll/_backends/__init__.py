"""Choosing the backend of a call from its leaves.

A backend is chosen from the leaves themselves (as einops picks a backend from
the tensor's type) and its framework is imported only when such leaves are
present: ``import xcoll`` works without torch_xla installed. The boundary
itself is in :mod:`xcoll._backends.base`; the engines behind it are
torch.distributed's (:mod:`~xcoll._backends.dist`) and torch_xla's
(:mod:`~xcoll._backends.xla`: its kernels in :mod:`~xcoll._backends.xla_kernels`,
how a replica steps in :mod:`~xcoll._backends.xla_step`, every private
torch_xla call in :mod:`~xcoll._backends._xlac`); a small call's collectives
run on the host around one all-gather (:mod:`~xcoll._backends.hosted`); what
the environment says of the launch, for errors, is in
:mod:`~xcoll._backends._launch`.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as torch_dist  # part of torch, imported with it

from .._base.tree import Flat
from ._launch import launch_hint, without_group
from .base import LocalTransport, Transport
from .dist import DistTransport

__all__ = ["Transport", "current", "resolve", "xla_runtime_running"]

_DIST_AVAILABLE = torch_dist.is_available()

if sys.modules.get("torch_xla") is not None:
    # torch_xla came first: from now on 0-d values of 0 and 1 are traced as
    # data (the leaves a user makes after ``import xcoll`` included).
    from . import _xlac

    _xlac.scalars_as_data()


def xla_runtime_running() -> bool:
    """Whether this process runs the XLA runtime. Only asks torch_xla if the
    user already imported it: never imports it."""
    if sys.modules.get("torch_xla") is None:
        return False
    from . import _xlac

    return _xlac.runtime_is_initialized()


def _process_group(group: Any) -> Any:
    """The process group a call on ``group`` uses (``group``, else the
    default group), or None where torch.distributed is not initialised."""
    if group is not None:
        return group
    return torch_dist.group.WORLD if _DIST_AVAILABLE else None


def check_group(group: Any) -> None:
    """Refuses a ``group=`` that is not a process group before anything uses
    it (a str there failed deep inside torch.distributed, as an AttributeError
    on ``.size``). ``NON_GROUP_MEMBER``, an int, passes: :class:`DistTransport`
    names it. A group given where torch.distributed is not initialised (never,
    or no longer: a group kept past ``destroy_process_group`` would answer
    with its old rank and size) is refused too."""
    if group is None:
        return
    member = getattr(torch_dist, "GroupMember", None)
    non_member = isinstance(group, int) and group == getattr(member, "NON_GROUP_MEMBER", None)
    if not (non_member or isinstance(group, getattr(torch_dist, "ProcessGroup", ()))):
        raise TypeError(
            "group must be a torch.distributed ProcessGroup (as dist.new_group returns) or None, "
            f"got {type(group).__qualname__} {group!r:.80}"
        )
    if not torch_dist.is_initialized():
        raise RuntimeError(
            "group= is given, but torch.distributed is not initialised in this process "
            "(dist.init_process_group was not called, or dist.destroy_process_group was): "
            "a process group is usable only while its process group is initialised"
        )


def _alone(device: torch.device | None = None) -> Transport:
    """A world of one: what a process is unless a launcher started it as one of
    several (torchrun, mpirun), whose world is then missing; raised rather than
    returning each process's values alone. A RuntimeError, as for the other
    launches that went wrong: nothing in the call's arguments is at fault."""
    why = without_group()
    if why:
        raise RuntimeError(why)
    return LocalTransport() if device is None else LocalTransport(device)


def current(group: Any = None) -> Transport:
    """The backend of this replica when the call has no tensor leaves to go by:
    ``group``'s if given, else XLA's if its runtime is running here, else the
    default process group's if initialised, else a world of one (where the
    environment does not say this process is one of several)."""
    if group is not None:  # (a call per warm call saved: most calls pass none)
        check_group(group)
    if group is None and xla_runtime_running():
        from . import xla

        return xla.transport()
    pg = _process_group(group)
    if pg is not None:
        return DistTransport(None, group, pg)
    return _alone()


def resolve(flat: Flat, group: Any = None) -> Transport:
    """The backend for the tensor leaves of ``flat`` (all on one device), with
    ``flat`` validated for it:

    XLA leaves -> XLA; other leaves -> torch.distributed if a process group is
    initialised (or ``group`` is given); otherwise a world of one (as in
    :func:`current`).
    """
    if group is not None:  # (a call per warm call saved: most calls pass none)
        check_group(group)
    if flat.devices[1:]:  # (more than one)
        tensors = [i for i, leaf in enumerate(flat.leaves) if isinstance(leaf, torch.Tensor)]
        first = tensors[0]
        i = next(i for i in tensors if flat.leaves[i].device != flat.leaves[first].device)
        raise TypeError(
            f"leaves are on different devices: {flat.path(first)} on "
            f"{flat.leaves[first].device}, {flat.path(i)} on {flat.leaves[i].device}; "
            "one call communicates the leaves of one device"
        )
    if not flat.devices:
        transport = current(group)
    elif flat.devices[0].type == "xla":
        if group is not None:
            raise ValueError(
                "group= selects a torch.distributed process group; these leaves are on XLA"
            )
        from . import xla

        transport = xla.transport(flat.devices[0])
    elif (pg := _process_group(group)) is not None:
        transport = DistTransport(flat.devices[0], group, pg)
    elif xla_runtime_running():
        # Treating them as a world of one would silently return W-times-smaller results.
        first = next(i for i, s in enumerate(flat.signature) if isinstance(s, tuple))
        where = f"{flat.path(first)} is on {flat.devices[0]}, but this process runs XLA replicas"
        hint = launch_hint(xla_leaves=False)
        # In a torchrun job the leaves' device is not the mistake (moved to XLA,
        # they would meet the same world of one): only the cause is named.
        raise TypeError(
            where + hint
            if hint
            else where + "; move the leaves to the replica's XLA device (torch_xla.device())"
        )
    else:
        transport = _alone(flat.devices[0])
    transport.validate(flat)
    return transport
