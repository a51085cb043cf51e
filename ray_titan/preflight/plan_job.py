"""The job as the memory plan reads it (:class:`_Job`, :func:`_job`): the config resolved into its
mesh, the whole model on the meta device (nothing allocated), the element sizes (bytes), the
microbatch, the pipeline schedule's rule and each stage's layers; and the plan's ``job`` record
(:func:`_job_summary`). What :mod:`~ray_titan.preflight.plan_states` and
:mod:`~ray_titan.preflight.plan_activations` read."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ray_titan import storage
from ray_titan.config.schema import ConfigError, JobConfig

if TYPE_CHECKING:
    from ray_titan.models.registry import ModelSpec
    from ray_titan.parallel.dims import ParallelDims
    from ray_titan.parallel.schedules import Schedule


_F32, _I64 = 4, 8  # bytes of an fp32 element (weights, gradients, optimizer states), an int64 one (token ids)


def _optimizer_states(cfg: JobConfig) -> int:
    """fp32 states per parameter element of ``[optimizer]``."""
    o = cfg.optimizer
    if o.name in ("AdamW", "Adam"):
        return 2
    return 1 if o.beta1 > 0 else 0


def _vocab_size(cfg: JobConfig, args: Any) -> int:
    """The tokenizer's vocabulary (as the trainer builds the model), else the flavor's."""
    from ray_titan.data.tokenizer import build_tokenizer

    try:
        if cfg.data.tokenizer_path:  # a bucket that does not answer must not hang the plan
            storage.check_reachable(cfg.data.tokenizer_path, cfg.job.storage_timeout_s)
        return build_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path).vocab_size
    except Exception:  # a tokenizer.json that is not here: plan with the flavor's vocabulary
        return args.vocab_size


@functools.lru_cache(maxsize=8)
def _meta_model(name: str, args: Any, vocab: int, extra: tuple[tuple[str, Any], ...], seq_len: int) -> Any:
    """The whole model of family ``name`` with the arguments ``args`` (a flavor's, or a Hugging
    Face checkpoint's ``config.json``; frozen dataclasses, so a cache key) on the meta device
    (nothing allocated), its rotary tables for ``seq_len`` positions as the trainer fits them;
    cached, since levers re-plan."""
    import torch

    from ray_titan.models.registry import build_model

    with torch.device("meta"):  # "": the flavor is in args
        return build_model(name, "", vocab_size=vocab, args=args, rope_positions=seq_len, **dict(extra))


@dataclass(frozen=True)
class _Job:
    """What every rank's plan reads: the config, the mesh, the model on the meta device, the
    element sizes (bytes) and the microbatch (:func:`_job`)."""

    cfg: JobConfig
    device: str
    rho: float  # routing imbalance (MoE under expert parallel)
    dims: ParallelDims
    spec: ModelSpec
    args: Any  # the built model's arguments
    whole: Any  # the whole model on the meta device
    vocab: int
    bf16: bool
    e: int  # bytes of an activation element
    r: int  # bytes of a stage output element (the residual stream)
    mb: int  # sequences per microbatch
    tokens: int  # tokens per microbatch on this rank (its 1/cp of each sequence under context parallel)
    rule: Schedule | None  # the pipeline schedule's properties; None without one
    split: list[list[int]]  # each stage's layers
    reshard: bool  # FSDP's reshard_after_forward, resolved
    k_opt: int  # fp32 optimizer states per parameter element
    offload: bool  # CPU offload frees device memory

    @property
    def tp(self) -> int:
        return getattr(self.dims, "tp", 1)


def _job(cfg: JobConfig, device: str, rho: float, vocab_size: int | None) -> _Job:
    """The job as the plan reads it; builds the model on the meta device (cached). Raises
    :class:`ConfigError` for a pipeline schedule without an in-flight rule."""
    from ray_titan.checkpoint import job_model_args
    from ray_titan.models.registry import get_spec
    from ray_titan.parallel.dims import parallel_dims
    from ray_titan.parallel.fsdp import resolve_mixed_precision, resolve_reshard_after_forward
    from ray_titan.parallel.pipeline import split_layers
    from ray_titan.parallel.schedules import SCHEDULES

    dims = parallel_dims(cfg)
    par, tr = cfg.parallelism, cfg.training
    dp_total = dims.dp_shard * getattr(dims, "dp_replicate", 1)
    spec = get_spec(cfg.model.name)
    args = job_model_args(cfg)  # a Hugging Face checkpoint's config.json, else the flavor's
    # As the trainer builds it: a Hugging Face checkpoint's own vocabulary, else the tokenizer's.
    vocab = vocab_size or (args.vocab_size if cfg.checkpoint.initial_load_hf else _vocab_size(cfg, args))
    whole = _meta_model(cfg.model.name, args, vocab, tuple(sorted(spec.config_args(cfg.model).items())), tr.seq_len)
    # training.mixed_precision: bf16 activations; under FSDP2 the parameters are gathered in bf16
    # (pe = 2 bytes), without it autocast keeps a bf16 copy of the stage's weights (autocast_copy).
    bf16 = resolve_mixed_precision(tr.mixed_precision, device) == "bf16"
    mb = tr.global_batch_size // dp_total // par.microbatches
    rule = SCHEDULES.get(par.pipeline_schedule)
    if dims.pp > 1 and rule is None:
        raise ConfigError(f"parallelism.pipeline_schedule = {par.pipeline_schedule!r} has no in-flight rule; "
                          f"known: {sorted(SCHEDULES)}")
    return _Job(
        cfg=cfg, device=device, rho=rho, dims=dims, spec=spec, args=whole.args, whole=whole, vocab=vocab,
        bf16=bf16, e=2 if bf16 else _F32,
        r=2 if bf16 and dims.fsdp else _F32,  # a stage's output: fp32 under autocast
        mb=mb, tokens=mb * tr.seq_len // dims.cp, rule=rule, split=split_layers(whole.args.n_layers, dims.num_stages),
        reshard=resolve_reshard_after_forward(par.fsdp_reshard_after_forward, dims.pp > 1),
        k_opt=_optimizer_states(cfg), offload=cfg.memory.cpu_offload and device != "cpu",
    )


def _job_summary(j: _Job) -> dict[str, Any]:
    """The plan's ``job``: what was planned (model, mesh, schedule, batch, AC, dtype, device)."""
    cfg, dims, pp = j.cfg, j.dims, j.dims.pp
    ac = cfg.activation_checkpoint
    return {
        "model": cfg.model.name, "flavor": cfg.model.flavor, "vocab_size": j.vocab,
        "mesh": " × ".join(f"{a}={getattr(dims, a)}" for a in ("pp", "dp_shard", "cp", "tp", "ep")
                           if getattr(dims, a, 1) > 1 or a in ("pp", "dp_shard")),
        "world_size": dims.world_size, "schedule": cfg.parallelism.pipeline_schedule if pp > 1 else "none (pp = 1)",
        "stages_per_rank": dims.stages_per_rank, "microbatches": cfg.parallelism.microbatches,
        "microbatch_size": j.mb, "seq_len": cfg.training.seq_len,
        "ac": ac.mode + (f"/{ac.selective_option}" if ac.mode == "selective" else ""),
        "dtype": ("fp32" if not j.bf16 else "bf16 (FSDP2 mixed precision: bf16 params, fp32 reduce and master weights)"
                  if dims.fsdp else "bf16 (autocast, fp32 weights)"),
        "optimizer": cfg.optimizer.name,
        "device": j.device, "moe": hasattr(j.args, "n_routed_experts"), "routing_imbalance": j.rho,
        "reshard_after_forward": j.reshard, "cpu_offload": cfg.memory.cpu_offload,
    }
