"""Gradient-norm clipping over the whole model when it is split by PP, sharded by FSDP or HSDP,
split by tensor or expert parallel: one all-reduce over every rank, which also carries the
step's other flags."""

from __future__ import annotations

import math
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
    flags: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Clip gradients in place to a total L2 norm of ``max_norm`` (no clipping if 0); return the
    total norm before clipping (0-dim) and ``flags`` summed over every rank (None if not given).

    The norm is that of the whole model, the same on every rank: each rank adds the squares of its
    local gradient shards (``DTensor.to_local()``: FSDP over ``dp_shard``, HSDP over
    ``(dp_replicate, dp_shard)``, each possibly × ``tp``; routed experts over ``ep``,
    ``(dp_shard_mod_ep, ep)``, × ``tp``), each divided by the number of ranks holding that same
    shard (:func:`_copies`), and one all-reduce over every rank sums them, the pipeline stages
    included. ``flags`` (``(k,)`` float32, e.g. whether this rank's loss is finite) ride in the
    same all-reduce: one collective a step where the norm's reductions over each mesh, over
    ``pp_group`` and the flags' own took one each. Gradients in a placement other than ``Shard``
    and ``Replicate`` (a pending ``Partial``) are reduced by DTensor first, as torch's
    ``get_total_norm`` does. ``pp_group``: the pipeline's group (its size is the number of
    stages), None without PP. ``norm_exclude``: parameters clipped but left out of the norm,
    because another rank counts the same gradient (a tied embedding's copy,
    ``ray_titan.parallel.tied``).

    Why not DTensor's norm for every group, as before: it reduces each group over its own mesh
    (one blocking all-reduce per group, then one over ``pp_group``), and its per-tensor dispatch
    cost ~1.2 ms a step of CPU on the debug Llama's 39 shards
    (benchmarks/results/2026-11-28-no-ac-step-time.md).
    """
    skip = {id(p) for p in norm_exclude}
    parameters = list(parameters)
    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            g = p.grad
            key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
            groups.setdefault(key, []).append(p)
    world = dist.get_world_size() if dist.is_initialized() else 1
    stages = dist.get_world_size(pp_group) if pp_group is not None else 1
    where = flags.device if flags is not None else _device(parameters)
    sq = torch.zeros((), device=where, dtype=torch.float32)
    for params in groups.values():
        counted = [p.grad for p in params if p.grad is not None and id(p) not in skip]
        if counted:
            sq = sq + _local_squares(counted, world // stages).to(where)
    if world > 1:
        packed = torch.cat([sq.reshape(1), flags.to(where, torch.float32).reshape(-1)]) if flags is not None \
            else sq.reshape(1)
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)
        sq, flags = packed[0], (packed[1:] if flags is not None else None)
    norm = sq.sqrt()
    if max_norm > 0:
        for params in groups.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm, flags


def _device(parameters: list[torch.Tensor]) -> torch.device | None:
    """Where the parameters' shards are (an NCCL group takes no host tensor); None without any."""
    if not parameters:
        return None
    p = parameters[0]
    return p.to_local().device if isinstance(p, DTensor) else p.device


def _local_squares(grads: list[torch.Tensor], stage_ranks: int) -> torch.Tensor:
    """This rank's share (0-dim float32 or wider) of the squared L2 norm of ``grads``, gradients
    of one mesh and placements: the squares of its shard, divided by the ranks of its pipeline
    stage (``stage_ranks``) holding the same shard, so that the sum over every rank counts each
    element once."""
    g = grads[0]
    if isinstance(g, DTensor) and not all(p.is_shard() or p.is_replicate() for p in g.placements):
        # Reduced by DTensor to one value on every rank of the stage (a Partial's sum first).
        full = _group_norm(grads).float()
        return full.square() / stage_ranks
    local = [x.to_local() if isinstance(x, DTensor) else x for x in grads]
    dtype = torch.promote_types(local[0].dtype, torch.float32)
    norms = torch._foreach_norm(local, 2.0, dtype=dtype)
    return torch.stack(norms).square().sum() / _copies(g, stage_ranks)


def _copies(g: torch.Tensor, stage_ranks: int) -> int:
    """The ranks of a pipeline stage (``stage_ranks`` of them) holding the same shard as this
    rank of ``g``: all of them for a plain tensor (replicated wherever it is not a DTensor, as
    over tp), else those that differ only along the mesh dimensions ``g`` is not sharded on and
    off its mesh."""
    if not isinstance(g, DTensor):
        return stage_ranks
    shards = math.prod(g.device_mesh.size(i) for i, p in enumerate(g.placements) if p.is_shard())
    return stage_ranks // shards


def _group_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm (0-dim, replicated) of ``grads``, tensors of one mesh and placements, by
    DTensor (torch's ``get_total_norm``, then ``full_tensor()``).

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
