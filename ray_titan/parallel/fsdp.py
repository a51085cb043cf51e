"""FSDP2: shard every transformer block and the stage's root module over ``dp_shard`` (HSDP:
over the 2-D ``(dp_replicate, dp_shard)``, sharded within a replica, replicated across), with
the ``reshard_after_forward`` policy and optional CPU offload; routed experts under expert
parallelism over ``dp_shard_mod_ep`` (what ``ep`` leaves of ``dp_shard``). Parameters tensor
parallel already made ``DTensor``s over ``tp`` become 2-D (FSDP × TP) ones."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

__all__ = ["apply_fsdp", "fsdp_managed_names", "materialize", "offload_policy", "resolve_reshard_after_forward"]


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


def fsdp_managed_names(model: nn.Module) -> set[str]:
    """Names (as ``model.named_parameters`` gives them) of the parameters FSDP2 shards in
    ``model``: those of every ``fully_shard``-ed submodule's parameter group, not the ones it was
    told to ignore (routed experts that expert parallelism alone holds, :func:`apply_fsdp`)."""
    from torch.distributed.fsdp import FSDPModule

    managed: set[int] = set()
    for m in model.modules():
        if isinstance(m, FSDPModule):
            # No public accessor lists a group's parameters; this private one is what FSDP2's own
            # tests use, and is checked by tests/unit/test_memory_levers.py.
            group = m._get_fsdp_state()._fsdp_param_group
            if group is not None:
                managed |= {id(fp.sharded_param) for fp in group.fsdp_params}
    return {name for name, p in model.named_parameters() if id(p) in managed}


def materialize(model: nn.Module, device: torch.device, cpu_offload: bool) -> None:
    """Allocate ``model``'s parameters and buffers (built on the meta device) with
    ``to_empty``, uninitialised: on ``device``; with ``cpu_offload`` on an accelerator, the
    parameters FSDP2 shards on the host (its ``CPUOffloadPolicy`` refuses others at the first
    forward: "FSDP parameters should be materialized on CPU when enabling CPU offloading", and
    copies them to the device itself) and buffers and the parameters FSDP2 leaves out on
    ``device``, where the forward computes with them: torchtitan's order (``init_device`` CPU,
    ``buffer_device`` the accelerator)."""
    if not cpu_offload or device.type == "cpu":
        model.to_empty(device=device)
        return
    managed = fsdp_managed_names(model)
    model.to_empty(device=torch.device("cpu"))
    for prefix, m in model.named_modules():
        for key, buf in m._buffers.items():
            if buf is not None:
                m._buffers[key] = torch.empty_like(buf, device=device)
        for key, param in m._parameters.items():
            if param is not None and f"{prefix}.{key}".lstrip(".") not in managed:
                m._parameters[key] = nn.Parameter(torch.empty_like(param, device=device),
                                                  requires_grad=param.requires_grad)
