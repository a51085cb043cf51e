"""FSDP2: shard every transformer block and the stage's root module over ``dp_shard`` (HSDP:
over the 2-D ``(dp_replicate, dp_shard)``, sharded within a replica, replicated across), with
the ``reshard_after_forward`` policy and optional CPU offload; routed experts under expert
parallelism over ``dp_shard_mod_ep`` (what ``ep`` leaves of ``dp_shard``). Parameters tensor
parallel already made ``DTensor``s over ``tp`` become 2-D (FSDP × TP) ones."""

from __future__ import annotations

from typing import cast

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

__all__ = ["apply_fsdp", "offload_policy", "resolve_reshard_after_forward"]


def resolve_reshard_after_forward(policy: str, pp_enabled: bool) -> bool:
    """``default``: reshard after forward unless pipelining, where every microbatch's forward
    would otherwise all-gather the parameters again; ``always`` / ``never`` force it."""
    if policy == "always":
        return True
    if policy == "never":
        return False
    return not pp_enabled


def offload_policy(cpu_offload: bool, device_type: str) -> OffloadPolicy:
    """FSDP2's ``CPUOffloadPolicy`` (sharded parameters, gradients and optimizer state in host
    memory; the optimizer steps on the CPU) when ``cpu_offload``, pinned where there is a CUDA
    device to copy to; otherwise the no-offload ``OffloadPolicy()``."""
    if not cpu_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device_type == "cuda")


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    reshard_after_forward: bool,
    expert_mesh: DeviceMesh | None = None,
    cpu_offload: bool = False,
) -> None:
    """``fully_shard`` each block in ``model.layers`` and then ``model`` itself (the embedding,
    final norm and output head, where this stage has them, are in the root's group).

    Parameters become ``DTensor``s sharded on dim 0 over ``dp_mesh``; gradients are
    reduce-scattered (averaged) over it. A 2-D ``dp_mesh`` ``(dp_replicate, dp_shard)`` gives
    HSDP: sharded over its second dim, replicated over its first (gradients all-reduced there).
    The root never reshards after forward: its backward starts at once. ``cpu_offload``: see
    :func:`offload_policy`. Apply activation checkpointing (``ray_titan.parallel.ac``) before this.

    ``expert_mesh``: given when expert parallelism has already sharded the routed experts over
    ``ep`` (``apply_expert_parallel``); it is the ``dp_shard_mod_ep`` mesh (2-D with
    ``dp_replicate`` under HSDP). Experts are then
    FSDP-sharded over it when it has more than one rank, and otherwise left out of FSDP (their
    ranks hold disjoint experts, so there is nothing to shard or average).
    """
    policy = offload_policy(cpu_offload, dp_mesh.device_type)
    ignored: set[nn.Parameter] = set()
    for block in cast(nn.ModuleDict, model.layers).values():
        moe = getattr(block, "moe", None)
        if moe is not None and expert_mesh is not None:
            if expert_mesh.size() > 1:
                fully_shard(moe.experts, mesh=expert_mesh, reshard_after_forward=reshard_after_forward,
                            offload_policy=policy)
            else:
                ignored |= set(moe.experts.parameters())
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                    offload_policy=policy, ignored_params=ignored or None)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, offload_policy=policy,
                ignored_params=ignored or None)
