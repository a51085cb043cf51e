"""What every family's ``parallelize`` applies after its own tensor-parallel plan, in the fixed
order CP → EP → AC → compile → FSDP (torchtitan's order): context parallelism over ``cp`` when
``cp > 1`` (``ray_titan.parallel.context``: the attention hooks), expert parallelism over ``ep`` where the
stage has MoE layers and ``ep > 1`` (``ray_titan.parallel.expert``), activation checkpointing per
``[activation_checkpoint]`` (``ray_titan.parallel.ac``), then around it the saved-tensor hooks
of ``memory.activation_offload`` (``ray_titan.parallel.offload``), ``torch.compile`` of each block when
``training.compile``, and FSDP2 over the ``fsdp`` mesh (HSDP under ``dp_replicate``; the routed
experts over ``efsdp``) when there is more than one data-parallel rank, with
``parallelism.fsdp_reshard_after_forward``, ``memory.cpu_offload`` and
``training.mixed_precision`` (``ray_titan.parallel.fsdp``)."""

from __future__ import annotations

from torch import nn

from ray_titan.config.schema import JobConfig
from ray_titan.parallel.ac import apply_ac
from ray_titan.parallel.compile import apply_compile
from ray_titan.parallel.context import apply_context_parallel
from ray_titan.parallel.dims import Meshes, ParallelDims
from ray_titan.parallel.expert import apply_expert_parallel
from ray_titan.parallel.fsdp import apply_fsdp, resolve_mixed_precision, resolve_reshard_after_forward
from ray_titan.parallel.offload import apply_activation_offload

__all__ = ["apply_after_tp"]


def apply_after_tp(model: nn.Module, dims: ParallelDims, meshes: Meshes | None, cfg: JobConfig,
                   fullgraph: bool = True) -> None:
    """CP → EP → AC → compile → FSDP on one stage module (module docstring), in place, while it is on
    the meta device. ``meshes``: the job's meshes by name, None on a single rank; ``fullgraph``:
    compile each block as one graph (False where MoE routing's data-dependent shapes break it)."""
    par = cfg.parallelism
    if dims.cp > 1:
        assert meshes is not None
        apply_context_parallel(model, meshes["cp"].get_group(), cfg.training.seq_len)
    if dims.ep > 1:
        assert meshes is not None
        apply_expert_parallel(model, meshes["ep"], meshes.get("ep_tp"))
    ac = cfg.activation_checkpoint
    apply_ac(model, ac.mode, ac.selective_option, ac.layer_freq)
    apply_activation_offload(model, cfg.memory.activation_offload)  # around the checkpointed forward
    if cfg.training.compile:
        apply_compile(model, fullgraph=fullgraph)
    if dims.fsdp:
        assert meshes is not None
        reshard = resolve_reshard_after_forward(par.fsdp_reshard_after_forward, dims.pp > 1)
        apply_fsdp(model, meshes["fsdp"], reshard, meshes["efsdp"] if dims.ep > 1 else None,
                   cpu_offload=cfg.memory.cpu_offload,
                   mixed_precision=resolve_mixed_precision(cfg.training.mixed_precision, meshes["fsdp"].device_type))
