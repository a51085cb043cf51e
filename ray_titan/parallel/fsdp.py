"""FSDP2: shard every transformer block and the stage's root module over ``dp_shard`` (HSDP:
over the 2-D ``(dp_replicate, dp_shard)``, sharded within a replica, replicated across), with
the ``reshard_after_forward`` policy, optional CPU offload and ``training.mixed_precision``
(FSDP2's ``MixedPrecisionPolicy``); routed experts under expert parallelism over
``dp_shard_mod_ep`` (what ``ep`` leaves of ``dp_shard``). Parameters tensor parallel already made
``DTensor``s over ``tp`` become 2-D (FSDP × TP) ones."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

__all__ = ["apply_fsdp", "autocast_dtype", "fsdp_managed_names", "materialize", "mixed_precision_policy",
           "offload_policy", "resolve_mixed_precision", "resolve_reshard_after_forward"]


def resolve_mixed_precision(setting: str | None, device_type: str) -> str:
    """``training.mixed_precision`` as the run uses it: ``"bf16"`` or ``"fp32"``; unset: ``bf16``
    on CUDA (what torchtitan and Megatron train in), ``fp32`` elsewhere (CPU: bf16 matmuls are
    emulated there, and the CPU parity tests compare fp32 bit for bit)."""
    if setting is not None:
        return setting
    return "bf16" if device_type == "cuda" else "fp32"


def mixed_precision_policy(mixed_precision: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for a resolved ``training.mixed_precision``. ``bf16``: parameters cast to
    bf16 before the all-gather (half its bytes) and computed with in bf16, gradients
    reduce-scattered (and all-reduced across HSDP replicas) in fp32 into the fp32 sharded
    gradients, so master weights and optimizer state stay fp32 (torchtitan's
    ``mixed_precision_param = bfloat16``, ``mixed_precision_reduce = float32``). ``fp32``: the
    no-cast ``MixedPrecisionPolicy()``.

    ``cast_forward_inputs=False``: a block's inputs include the fp32 rotary ``cos``/``sin`` tables,
    which must stay fp32 (torchtitan passes them as complex64, which FSDP2 does not cast); the
    hidden states are bf16 already, from the bf16 embedding or the previous pipeline stage."""
    if mixed_precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                    cast_forward_inputs=False)
    return MixedPrecisionPolicy()


def autocast_dtype(mixed_precision: str, fsdp: bool) -> torch.dtype | None:
    """The ``torch.autocast`` dtype of the forward passes: bf16 for a ``bf16`` run without FSDP2
    (one data-parallel rank: no ``MixedPrecisionPolicy`` to cast the weights, torchtitan's
    ``maybe_enable_amp``), otherwise None (no autocast: FSDP2 casts, or the run is fp32)."""
    return torch.bfloat16 if mixed_precision == "bf16" and not fsdp else None


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
    mixed_precision: str = "fp32",
) -> None:
    """``fully_shard`` an untied embedding (where this stage has one), each block in
    ``model.layers`` and then ``model`` itself (the final norm and output head, where this stage
    has them, and a tied embedding are in the root's group).

    Parameters become ``DTensor``s sharded on dim 0 over ``dp_mesh``; gradients are
    reduce-scattered (averaged) over it. A 2-D ``dp_mesh`` ``(dp_replicate, dp_shard)`` gives
    HSDP: sharded over its second dim, replicated over its first (gradients all-reduced there).
    The root never reshards after forward: its backward starts at once. The untied embedding is
    a group of its own that reshards after forward as the blocks do, as torchtitan 0.3.0 groups it
    (``apply_fsdp_to_decoder``): in the root, it stayed gathered from the first block's forward to
    the last one's backward (Llama 3.1 8B: ``vocab × dim`` bf16, 0.98 GiB at the peak of a rank,
    ``python -m benchmarks.run memory_vs_torchtitan``). ``cpu_offload``: see
    :func:`offload_policy`. Apply activation checkpointing (``ray_titan.parallel.ac``) before this.

    ``expert_mesh``: given when expert parallelism has already sharded the routed experts over
    ``ep`` (``apply_expert_parallel``); it is the ``dp_shard_mod_ep`` mesh (2-D with
    ``dp_replicate`` under HSDP). Experts are then
    FSDP-sharded over it when it has more than one rank, and otherwise left out of FSDP (their
    ranks hold disjoint experts, so there is nothing to shard or average), except under ``bf16``,
    where a one-rank ``fully_shard`` is what casts them (torchtitan shards experts over
    ``dp_shard_mod_ep`` whatever its size).

    ``mixed_precision``: the resolved ``training.mixed_precision`` (:func:`resolve_mixed_precision`);
    every unit gets :func:`mixed_precision_policy` of it.
    """
    policy = offload_policy(cpu_offload, dp_mesh.device_type)
    mp = mixed_precision_policy(mixed_precision)
    ignored: set[nn.Parameter] = set()
    embedding = getattr(model, "tok_embeddings", None)
    if embedding is not None and not getattr(model, "tied", False):
        fully_shard(embedding, mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                    offload_policy=policy, mp_policy=mp)
    for block in cast(nn.ModuleDict, model.layers).values():
        moe = getattr(block, "moe", None)
        if moe is not None and expert_mesh is not None:
            if expert_mesh.size() > 1 or mixed_precision == "bf16":
                fully_shard(moe.experts, mesh=expert_mesh, reshard_after_forward=reshard_after_forward,
                            offload_policy=policy, mp_policy=mp)
            else:
                ignored |= set(moe.experts.parameters())
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                    offload_policy=policy, mp_policy=mp, ignored_params=ignored or None)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, offload_policy=policy, mp_policy=mp,
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
