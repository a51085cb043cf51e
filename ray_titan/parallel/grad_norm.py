"""Gradient-norm clipping over the whole model when it is split by PP, sharded by FSDP or HSDP,
split by tensor or expert parallel."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    pp_group: dist.ProcessGroup | None = None,
    norm_exclude: Iterable[torch.Tensor] = (),
) -> torch.Tensor:
    """Clip gradients in place to a total L2 norm of ``max_norm`` (no clipping if 0) and return
    the total norm before clipping, a 0-dim tensor.

    The norm is that of the whole model: sharded gradients (``DTensor``) are grouped by their
    mesh and placements (FSDP over ``dp_shard``, HSDP over ``(dp_replicate, dp_shard)``, each
    possibly × ``tp``; routed experts over ``ep``, ``(dp_shard_mod_ep, ep)``, × ``tp``), each
    group's norm is reduced over its mesh by ``full_tensor()`` (DTensor sums the squares of
    ``Shard`` dimensions and takes ``Replicate`` ones once), and the squared norms of the groups,
    then of the stages on different pp ranks (summed over ``pp_group``), are added. Plain tensors
    are the same on every rank that holds them (replicated over tp), so their local norm is
    theirs. Every rank gets the same value. ``norm_exclude``: parameters
    clipped but left out of the norm, because another rank counts the same gradient (a tied
    embedding's copy, ``ray_titan.parallel.tied``).
    """
    skip = {id(p) for p in norm_exclude}
    parameters = list(parameters)
    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            g = p.grad
            key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
            groups.setdefault(key, []).append(p)
    sq = None
    for params in groups.values():
        counted = [p.grad for p in params if p.grad is not None and id(p) not in skip]
        if not counted:
            continue
        norm = _group_norm(counted)
        sq = norm**2 if sq is None else sq + norm**2
    if sq is None:  # no gradient here: a zero on the parameters' device (an NCCL group takes no host tensor)
        sq = torch.zeros((), device=parameters[0].device if parameters else None)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=pp_group)
    norm = sq.sqrt()
    if max_norm > 0:
        for params in groups.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def _group_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm (0-dim, replicated) of ``grads``, tensors of one mesh and placements.

    DTensor merges the all-reduces over several mesh axes into one over a flattened view of them
    when it finds one; torch 2.13's lookup raises ``KeyError`` ("Mesh dim indices should be in
    ascending order") for a mesh whose axes are not in the root mesh's order, as the routed
    experts' ``(dp_shard_mod_ep_cp, ep)`` under context parallel (``cp`` lies inside ``ep`` in
    the root). It raises while planning, before any collective, so the norm is then computed
    again with the merging off: one all-reduce per axis."""
    def total() -> torch.Tensor:
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    try:
        return total()
    except KeyError:
        from torch.distributed.tensor._redistribute import disable_redistribute_transform_optimization

        with disable_redistribute_transform_optimization():
            return total()
