"""Building one rank's share of a job: mesh, model stages, optimizer, LR schedule, pipeline schedule.

:func:`build` takes the job and the data loader and returns a :class:`TrainParts`: the model is
built whole on the meta device, this rank's pipeline stages are cut out
(``ray_titan.parallel.pipeline``), each is parallelized by its family's ``parallelize`` step
(``ray_titan.models.registry``), then materialised on the device and initialised from the seed.
The optimizer, the LR schedule and, under PP, the pipeline schedule are built over those stages.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from ray_titan.checkpoint import hf_model, load_hf_weights
from ray_titan.config.schema import JobConfig
from ray_titan.data.loader import IGNORE_INDEX, PackedLoader
from ray_titan.models.decoder import Decoder
from ray_titan.models.registry import build_model, get_spec
from ray_titan.parallel.dims import Meshes, ParallelDims, parallel_dims
from ray_titan.parallel.expert import MoEStepState
from ray_titan.parallel.fsdp import autocast_dtype, materialize, resolve_mixed_precision
from ray_titan.parallel.pipeline import ScheduleLoss, build_pipeline_schedule, build_stage_module, split_layers
from ray_titan.parallel.tied import TiedEmbeddings
from ray_titan.trainer.backup import UpdateBackup
from ray_titan.trainer.chunked_loss import ChunkedCrossEntropy
from ray_titan.trainer.fault_injection import FaultInjection
from ray_titan.trainer.mtp import MtpLoss, mtp_labels

__all__ = [
    "TrainParts", "build", "build_lr_lambda", "build_optimizer", "cross_entropy_loss", "infer_pipeline_shapes",
    "parallel_dims",
]


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Cross-entropy in nats, computed in fp32. ``logits (batch, seq, vocab)``, ``labels (batch,
    seq)`` int64. ``scale`` None: the mean over the tokens (every label counts). Otherwise the
    sum over the counted labels (not :data:`IGNORE_INDEX`) times ``scale``: with ``scale =
    microbatches × dp_degree / counted labels of the global batch``, the gradients the schedule
    averages over microbatches and FSDP over data-parallel ranks are those of the mean over every
    counted label of the global batch, however unevenly they fall on microbatches and ranks (a
    mean of per-microbatch means would weight a microbatch's tokens by its count's inverse)."""
    if scale is None:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
    total = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction="sum")
    return total * scale


def _loss(cfg: JobConfig, stages: dict[int, nn.Module], last: int) -> Callable[..., torch.Tensor]:
    """The microbatch loss: :func:`cross_entropy_loss` on the logits, or with
    ``training.loss_chunk_tokens`` on a rank that holds the last stage ``last``, the chunked
    loss on its hidden states (``ray_titan.trainer.chunked_loss``)."""
    chunk = cfg.training.loss_chunk_tokens
    if not chunk or last not in stages:
        return cross_entropy_loss
    head = cast(Decoder, stages[last])
    head.hidden_out = True
    return ChunkedCrossEntropy(head.logits, chunk)


def build_lr_lambda(cfg: JobConfig) -> Callable[[int], float]:
    """Multiplier of ``optimizer.lr`` at scheduler step ``i`` (0-based): linear warm-up over
    ``warmup_steps``, then cosine or linear decay to ``min_lr_ratio`` at ``training.steps``."""
    warmup, total = cfg.lr_scheduler.warmup_steps, cfg.training.steps
    decay, floor = cfg.lr_scheduler.decay, cfg.lr_scheduler.min_lr_ratio

    def lr_lambda(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        if decay == "none" or total <= warmup:
            return 1.0
        # The last step (index total - 1) runs at exactly the floor.
        progress = min(1.0, (i + 1 - warmup) / (total - warmup))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if decay == "cosine" else 1 - progress
        return floor + (1 - floor) * shape

    return lr_lambda


def build_optimizer(cfg: JobConfig, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The ``[optimizer]`` over ``params``: AdamW, Adam or SGD (``beta1`` is SGD's momentum), with
    the kernel ``optimizer.implementation`` names.

    Plain and ``DTensor`` parameters (tensor parallel without FSDP leaves the replicated ones
    plain) go in separate parameter groups with the same settings: the fused and foreach kernels
    take one group's tensors in one call, and DTensor refuses a call that mixes the two."""
    o = cfg.optimizer
    dtensors = [p for p in params if isinstance(p, DTensor)]
    if dtensors and len(dtensors) < len(params):
        plain = [p for p in params if not isinstance(p, DTensor)]
        params = [{"params": plain}, {"params": dtensors}]  # type: ignore[list-item]  # param groups
    impl = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[o.implementation]
    if o.name == "SGD":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.beta1, weight_decay=o.weight_decay, **impl)
    cls = torch.optim.AdamW if o.name == "AdamW" else torch.optim.Adam
    return cls(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, **impl)


@dataclass
class TrainParts:
    """One rank's share of the job, as :func:`build` made it.

    ``stages``: this rank's pipeline stage modules by stage index (one without PP);
    ``params``: their parameters; ``schedule``: the pipeline schedule, None without PP (then
    ``stages`` holds the whole model and microbatches are accumulated); ``loss_fn``: the
    per-microbatch loss (:func:`cross_entropy_loss`, poisoned by ``debug.nonfinite_loss_at_steps``);
    ``moe``: the MoE layers' per-step bookkeeping (inactive for a dense model); ``injection``:
    the ``[debug]`` faults (``ray_titan.trainer.fault_injection``); ``pp_group``: the ``pp``
    process group (None without PP);
    ``tied``: a tied embedding's copies across pipeline stages (``ray_titan.parallel.tied``);
    ``loss_parallel``: the output head's logits are vocabulary-sharded ``DTensor``s, so the loss
    and its backward run under ``torch.distributed.tensor.parallel.loss_parallel()``;
    ``autocast``: the dtype forward passes run under ``torch.autocast`` in (a ``bf16`` run without
    FSDP2, ``ray_titan.parallel.fsdp.autocast_dtype``), None: no autocast; ``schedule_loss``:
    ``loss_fn`` as the pipeline schedule calls it, with each step's loss arguments bound
    (``ScheduleLoss.bound``; None without PP); ``backup``: under ``training.on_nonfinite =
    "skip"``, the state before the latest update, so that it can be undone
    (``ray_titan.trainer.backup``; None under ``stop``); ``mtp``: under ``model.mtp_layers``,
    ``loss_fn`` itself, the multi-token-prediction loss, which keeps each depth's loss for the
    metrics (``ray_titan.trainer.mtp``; None without); ``infer_shapes``: under PP with
    MoE layers, the pipeline's shape inference for training run on a dummy batch with what the
    routers counted forgotten (:func:`infer_pipeline_shapes`; call it after a forward-only pass of
    the schedule, whose mode switch makes the next step infer again; None otherwise).
    """

    dims: ParallelDims
    rank: int
    coords: dict[str, int]
    meshes: Meshes | None
    stages: dict[int, nn.Module]
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    schedule: _PipelineSchedule | None
    loss_fn: Callable[..., torch.Tensor]
    moe: MoEStepState
    injection: FaultInjection
    pp_group: dist.ProcessGroup | None
    device: torch.device
    tied: TiedEmbeddings | None = None
    loss_parallel: bool = False
    autocast: torch.dtype | None = None
    schedule_loss: ScheduleLoss | None = None
    backup: UpdateBackup | None = None
    mtp: MtpLoss | None = None
    infer_shapes: Callable[[], None] | None = None

    def loss_context(self) -> contextlib.AbstractContextManager:
        """Where the loss and its backward run: ``loss_parallel()`` under TP with loss parallel."""
        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stages

    @property
    def is_last_stage(self) -> bool:
        return self.dims.is_last_stage_rank(self.rank)


def build_stages(cfg: JobConfig, dims: ParallelDims, meshes: Meshes | None, pp_rank: int,
                 vocab_size: int, device: torch.device) -> dict[int, nn.Module]:
    """This rank's pipeline stages, parallelized, materialised on ``device`` and initialised.

    The whole model is built on the meta device (nothing allocated), split into
    ``dims.num_stages`` stages by layers, and the stages of ``pp_rank`` are kept; each goes
    through its family's ``parallelize`` step before its weights exist, then ``to_empty``
    (:func:`~ray_titan.parallel.fsdp.materialize`: with ``memory.cpu_offload`` on an
    accelerator, FSDP2's parameters on the host, buffers on the device) and
    ``init_weights(training.seed)`` (each parameter seeded by its name, so the weights do not
    depend on the mesh), or, with ``checkpoint.initial_load_hf``, the Hugging Face checkpoint's
    weights, each rank reading its own shards only (``ray_titan.checkpoint.hf_import``; the model's sizes and
    vocabulary are then the checkpoint's)."""
    spec = get_spec(cfg.model.name)
    hf = cfg.checkpoint.initial_load_hf
    hf_args = hf_model(hf)[1] if hf else None
    with torch.device("meta"):
        whole = build_model(cfg.model.name, cfg.model.flavor, vocab_size=None if hf else vocab_size, args=hf_args,
                            rope_positions=cfg.training.seq_len, **spec.config_args(cfg.model))
    split = split_layers(whole.args.n_layers, dims.num_stages)
    stages: dict[int, nn.Module] = {}
    for s in dims.stages_on_pp_rank(pp_rank):
        mod = build_stage_module(whole, split[s], first=s == 0, last=s == dims.num_stages - 1)
        spec.parallelize(mod, dims, meshes, cfg)
        materialize(mod, device, cfg.memory.cpu_offload)
        if hf:
            mod.init_buffers()
            load_hf_weights(mod, hf, spec, whole.args)
        else:
            mod.init_weights(cfg.training.seed)
        mod.train()
        stages[s] = mod
    return stages


def build(cfg: JobConfig, rank: int, vocab_size: int, loader: PackedLoader, device: torch.device) -> TrainParts:
    """Build this rank's :class:`TrainParts` (module docstring). ``loader`` gives the shape of a
    batch for the MoE pipeline's shape inference. Collective: every rank calls it."""
    dims = parallel_dims(cfg)
    coords = dims.coords(rank)
    meshes = dims.build_mesh(device.type) if dims.world_size > 1 else None
    stages = build_stages(cfg, dims, meshes, coords["pp"], vocab_size, device)
    params = [p for m in stages.values() for p in m.parameters()]
    optimizer = build_optimizer(cfg, params)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, build_lr_lambda(cfg))
    n_mb = cfg.parallelism.microbatches
    pp_group = meshes["pp"].get_group() if meshes is not None and dims.pp > 1 else None
    # The routers' loads are summed over every rank holding other tokens of the stage: the
    # data-parallel ranks and, under context parallelism, their cp ranks.
    dp_group = (meshes["dp_cp" if dims.cp > 1 else "dp"].get_group()
                if meshes is not None and dims.dp * dims.cp > 1 else None)
    moe = MoEStepState(stages, dims.ep, dp_group, n_mb)
    injection = FaultInjection(cfg.debug, rank)
    loss_fn = injection.wrap_loss(_loss(cfg, stages, dims.num_stages - 1))
    mtp = MtpLoss(loss_fn, cfg.training.mtp_loss_weight, cfg.model.mtp_layers) if cfg.model.mtp_layers else None
    loss_fn = mtp or loss_fn
    tied = TiedEmbeddings(stages, dims, rank, bool(getattr(next(iter(stages.values())), "tied", False)),
                          mtp=mtp is not None)
    parts = TrainParts(dims, rank, coords, meshes, stages, params, optimizer, scheduler, None, loss_fn,
                       moe, injection, pp_group, device, tied,
                       loss_parallel=dims.tp > 1 and cfg.parallelism.loss_parallel,
                       autocast=autocast_dtype(resolve_mixed_precision(cfg.training.mixed_precision, device.type),
                                               dims.fsdp),
                       backup=UpdateBackup() if cfg.training.on_nonfinite == "skip" else None, mtp=mtp)
    if dims.pp > 1:
        parts.schedule_loss = ScheduleLoss(loss_fn)
        parts.schedule = build_pipeline_schedule(
            cfg.parallelism.pipeline_schedule, stages, dims.num_stages, n_mb, parts.schedule_loss, device, pp_group,
            dims.stage_to_rank_mapping(),
        )
        # Every stage must run the dummy step or none (it is a pipeline step: p2p and shape
        # messages): a stage without MoE layers (DeepSeek's first dense layers) asks the others.
        any_moe = torch.tensor([float(moe.active)], device=device)
        dist.all_reduce(any_moe, op=dist.ReduceOp.MAX, group=pp_group)
        if any_moe.item() > 0:
            parts.infer_shapes = functools.partial(infer_pipeline_shapes, parts, loader.local_batch,
                                                   cfg.training.seq_len // dims.cp, n_mb)
            parts.infer_shapes()
    return parts


def infer_pipeline_shapes(parts: TrainParts, local_batch: int, seq_len: int, microbatches: int) -> None:
    """Run the pipeline schedule's shape inference for training now, on a zero batch ``(local_batch,
    seq_len)`` in ``microbatches``, and forget what it left: gradients, MoE routing counts, MTP losses. Collective over
    the ``pp`` group.

    torch's schedules infer stage shapes at their first step, and again at the first step after a
    mode switch (``schedule.eval``, validation), by running every stage on uninitialised inputs past
    stage 0: MoE routers would count those phantom tokens in that step (its reported expert load,
    and aux-loss-free balancing's bias update). Inferring on a dummy step here keeps them out."""
    assert parts.schedule is not None
    dummy = torch.zeros(local_batch, seq_len, dtype=torch.int64, device=parts.device)
    last = parts.is_last_stage
    # Under multi-token prediction the last stage's outputs are a tuple, whose length the schedule
    # learns here: the inputs and the depths' labels as a step gives them.
    extra: dict[str, Any] = {}
    target = dummy
    if parts.mtp is not None:
        target, extra = mtp_labels(dummy, None, parts.mtp.depths), {"tokens": dummy}
    with parts.loss_context():
        parts.schedule.step(*((dummy,) if parts.has_first_stage else ()), target=target if last else None,
                            losses=[] if last else None, return_outputs=False, **extra)
    if parts.mtp is not None:
        parts.mtp.take(microbatches)  # the dummy's losses are not the next step's
    parts.optimizer.zero_grad(set_to_none=True)
    parts.moe.reset()
