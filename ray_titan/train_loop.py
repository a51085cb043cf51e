"""The per-worker train loop.

:func:`train_loop` is a plain function of (config, reporter): Ray Train runs it on every worker
(see ``driver.py``), and it also runs without Ray, in one process or under ``torchrun``
(``python -m ray_titan.train_loop --config ...``), which is how the CUDA paths are exercised on a
machine without Ray.

Per step: data → forward/backward (pipeline schedule when pp > 1, else gradient accumulation over
microbatches) → clip gradients over the whole model → optimizer → LR step → the loss becomes a
host float on last-stage ranks → synchronized GC → memory sample → one StepReport, sent without
waiting. Nothing from a step outlives it on the device (DESIGN.md, lesson 1).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ray_titan.allocator import active_allocator
from ray_titan.callbacks import CallbackContext, CallbackList, load_callback
from ray_titan.checkpoint import Checkpointer, LocalCheckpointStorage
from ray_titan.config import JobConfig, load_config
from ray_titan.data.corpus import load_texts
from ray_titan.data.loader import PackedLoader
from ray_titan.data.tokenizer import build_tokenizer
from ray_titan.fault import FaultHandler
from ray_titan.gc import GarbageCollection
from ray_titan.metrics.memory import MemorySampler, MemorySnapshots, host_memory
from ray_titan.metrics.report import Reporter, StepReport
from ray_titan.metrics.timing import StepClock
from ray_titan.models.registry import build_model, is_moe
from ray_titan.parallel.ac import apply_ac
from ray_titan.parallel.dims import ParallelDims
from ray_titan.parallel.expert import MoEStepState, apply_expert_parallel
from ray_titan.parallel.fsdp import apply_fsdp, resolve_reshard_after_forward
from ray_titan.parallel.grad_norm import clip_grad_norm_
from ray_titan.parallel.pipeline import build_pipeline_schedule, build_stage_module, split_layers

__all__ = ["train_loop", "cross_entropy_loss", "build_lr_lambda", "parallel_dims"]


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy in nats per token. ``logits (batch, seq, vocab)``, ``labels (batch, seq)``
    int64. Computed in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def build_lr_lambda(cfg: JobConfig):
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


def parallel_dims(cfg: JobConfig) -> ParallelDims:
    """The job's :class:`ParallelDims` (mesh sizes and stages per rank)."""
    par = cfg.parallelism
    return ParallelDims(pp=par.pp, dp_shard=par.dp_shard, stages_per_rank=par.stages_per_rank, ep=par.ep)


def local_cuda_device() -> torch.device:
    """``cuda:LOCAL_RANK`` (as torchrun sets it), made the current device; CPU without CUDA."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(dev)
    return dev


def _build_optimizer(cfg: JobConfig, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    o = cfg.optimizer
    impl = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[o.implementation]
    if o.name == "SGD":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.beta1, weight_decay=o.weight_decay, **impl)
    cls = torch.optim.AdamW if o.name == "AdamW" else torch.optim.Adam
    return cls(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, **impl)


def train_loop(
    cfg: JobConfig, reporter: Reporter, device: torch.device | None = None,
    run_dir: str | Path | None = None, callbacks: list | None = None, checkpoint_storage=None,
) -> dict[str, Any]:
    """Train ``cfg`` on this rank, sending one :class:`StepReport` per step to ``reporter``.

    ``device`` is where this rank computes (default CPU); the caller picks it, since only the
    launcher knows which GPU, if any, is this rank's. Needs ``torch.distributed`` initialised
    with ``world_size == cfg.world_size`` unless the mesh is a single rank. ``run_dir``: where
    memory snapshots go (``<run_dir>/memory/``; none without it). ``callbacks``: worker-side
    callbacks (``ray_titan.callbacks``), run after those of ``cfg.callbacks``.
    ``checkpoint_storage`` is where checkpoints go (``ray_titan.checkpoint``; None saves none),
    and a restart or ``checkpoint.load_path`` resumes from one. Returns a small summary of this
    rank (``rank``, ``steps``, ``last_loss``, ``snapshots``, and the timings of
    :class:`~ray_titan.metrics.timing.StepClock`: ``marks``, ``steady_steps``, ``steady_time_s``,
    ``tokens_per_step``, ``host_rss_bytes``, ``host_peak_rss_bytes``, and ``allocator``, the malloc
    this process runs: :func:`~ray_titan.allocator.active_allocator`). With
    ``metrics.enabled = false`` nothing is sampled or sent to ``reporter``. Raises ``RuntimeError`` when the
    process group does not match the mesh, ``RankOutOfMemoryError`` (after writing a snapshot)
    when the rank runs out of memory, ``CheckpointError`` for a bad checkpoint and
    ``NonFiniteError`` under ``training.on_nonfinite = "stop"``.
    """
    clock = StepClock(cfg.training.steps)
    clock.mark("loop_start")
    dims = parallel_dims(cfg)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != dims.world_size:
        raise RuntimeError(f"{world} processes, but the mesh needs {dims.world_size} ({dims})")
    coords = dims.coords(rank)
    device = device or torch.device("cpu")
    threads = cfg.training.threads_per_worker
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(cfg.training.seed)

    # Data: every rank builds the same stream and keeps its DP slice.
    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)
    loader = PackedLoader(
        load_texts(cfg.data), tokenizer, cfg.training.seq_len, cfg.training.global_batch_size,
        dp_rank=coords["dp_shard"], dp_degree=dims.dp_shard, seed=cfg.training.seed,
    )
    clock.mark("data_ready")

    # Model: whole model on meta, this rank's stages cut out, parallelized, then materialised.
    mesh = dims.build_mesh(device.type) if world > 1 else None
    moe_args = {}
    if is_moe(cfg.model.name):
        m = cfg.model
        moe_args = dict(load_balance=m.load_balance, aux_loss_coeff=m.aux_loss_coeff, bias_update_rate=m.bias_update_rate)
    with torch.device("meta"):
        whole = build_model(cfg.model.name, cfg.model.flavor, vocab_size=tokenizer.vocab_size, **moe_args)
    split = split_layers(whole.args.n_layers, dims.num_stages)
    stage_ids = dims.stages_on_pp_rank(coords["pp"])
    pp_on = dims.pp > 1
    reshard = resolve_reshard_after_forward(cfg.parallelism.fsdp_reshard_after_forward, pp_on)
    stages: dict[int, torch.nn.Module] = {}
    for s in stage_ids:
        mod = build_stage_module(whole, split[s], first=s == 0, last=s == dims.num_stages - 1)
        if dims.ep > 1:
            apply_expert_parallel(mod, mesh["ep"])
        ac = cfg.activation_checkpoint
        apply_ac(mod, ac.mode, ac.selective_option, ac.layer_freq)
        if dims.dp_shard > 1:
            apply_fsdp(mod, mesh["dp_shard"], reshard, mesh["dp_shard_mod_ep"] if dims.ep > 1 else None,
                       cpu_offload=cfg.memory.cpu_offload)
        mod.to_empty(device=device)
        mod.init_weights(cfg.training.seed)
        mod.train()
        stages[s] = mod
    del whole
    params = [p for m in stages.values() for p in m.parameters()]
    optimizer = _build_optimizer(cfg, params)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, build_lr_lambda(cfg))
    n_mb = cfg.parallelism.microbatches
    has_first = 0 in stages
    is_last = dims.is_last_stage_rank(rank)
    pp_group = mesh["pp"].get_group() if pp_on else None
    model = stages[stage_ids[0]]
    moe = MoEStepState(stages, dims.ep, mesh["dp_shard"].get_group() if dims.dp_shard > 1 else None, n_mb)
    faults = FaultHandler(cfg, rank, stage_ids, dims.num_stages - 1, device)
    loss_fn = faults.wrap_loss(cross_entropy_loss)
    schedule = None
    if pp_on:
        schedule = build_pipeline_schedule(
            cfg.parallelism.pipeline_schedule, stages, dims.num_stages, n_mb,
            loss_fn, device, pp_group,
        )
        if moe.active:
            # The schedule infers stage shapes at its first step by running every stage once,
            # on uninitialised inputs past stage 0: MoE routers would count those phantom tokens
            # in step 1. So infer now, on a dummy batch, and forget what it counted.
            dummy = torch.zeros(loader.local_batch, cfg.training.seq_len, dtype=torch.int64, device=device)
            schedule.step(*((dummy,) if has_first else ()), target=dummy if is_last else None,
                          losses=[] if is_last else None)
            optimizer.zero_grad(set_to_none=True)
            moe.reset()
    # -- checkpoints (ray_titan.checkpoint) --
    ckpt = Checkpointer(cfg, rank, stages.values(), optimizer, scheduler, loader, reporter,
                        checkpoint_storage, tokenizer.vocab_size, device)
    start_step = ckpt.restore()

    clock.mark("model_built")

    metrics_on = cfg.metrics.enabled

    def autocast():
        if cfg.training.autocast == "none":
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=torch.bfloat16)

    mem = cfg.memory
    allocator = active_allocator()
    if mem.allocator == "jemalloc" and allocator != "jemalloc" and rank == 0:
        print(f"ray_titan: warning: memory.allocator = 'jemalloc' but this worker runs {allocator} malloc: "
              "only workers started by ray_titan's driver get it; preload it yourself elsewhere "
              "(ray_titan.allocator)", file=sys.stderr, flush=True)
    gc_policy = GarbageCollection(cfg.training.gc_freq, mem.gc_full_every, mem.gc_debug, rank, mem.malloc_trim)
    snapshots = MemorySnapshots(run_dir, rank, coords, device, mem.snapshot_steps, mem.snapshot_on_oom,
                                mem.history_max_entries)
    hooks = _callbacks(cfg, callbacks, CallbackContext(
        rank, coords, world, device, Path(run_dir) if run_dir is not None else None, cfg))
    sampler = MemorySampler(device, cfg.metrics.heap_stats_interval_s)
    last_loss, step, error, tokens_per_step = None, 0, None, 0
    metrics_time: float | None = None  # the previous step's sampling + reporting, seconds
    try:
        snapshots.start()
        hooks.on_train_start()
        for step in range(start_step + 1, cfg.training.steps + 1):
            faults.begin_step(step)
            hooks.on_step_begin(step)
            snapshots.before_step(step)
            t0 = time.perf_counter()
            inputs, labels = next(loader)
            inputs, labels = inputs.to(device), labels.to(device)
            t1 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            if schedule is not None:
                losses: list[torch.Tensor] | None = [] if is_last else None
                args = (inputs,) if has_first else ()
                with autocast():
                    schedule.step(*args, target=labels if is_last else None, losses=losses)
                # Host float right away; the list (and its graph-free tensors) dies here.
                loss = torch.stack(losses).mean().item() if is_last else None
                del losses
            else:
                total = torch.zeros((), device=device)
                for i, (x, y) in enumerate(zip(inputs.chunk(n_mb), labels.chunk(n_mb))):
                    if dims.dp_shard > 1:
                        model.set_requires_gradient_sync(i == n_mb - 1)
                    with autocast():
                        mb_loss = loss_fn(model(x), y)
                    mb_loss.backward()
                    total += mb_loss.detach()
                # Accumulated, then scaled once, as the pipeline schedules do (scale_grads): the
                # MoE balance loss injects its gradient unscaled in every microbatch.
                if n_mb > 1:
                    with torch.no_grad():
                        for p in params:
                            if p.grad is not None:
                                p.grad.div_(n_mb)
                loss = (total / n_mb).item()
                del total, mb_loss
            moe.scale_expert_grads()
            t2 = time.perf_counter()
            grad_norm = clip_grad_norm_(params, cfg.training.max_norm, pp_group).item()
            lr = scheduler.get_last_lr()[0]
            skipped = faults.check(step, loss, grad_norm, params)  # training.on_nonfinite
            if not skipped:
                optimizer.step()
            scheduler.step()
            aux_loss, moe_layers, expert_load = moe.end_step()
            t3 = time.perf_counter()
            gc_result = gc_policy.run(step)
            report = None
            if metrics_on:
                t_sample = time.perf_counter()
                memory = sampler.sample()
                t4 = time.perf_counter()
                report = StepReport(
                    step=step, rank=rank, coords=coords, is_last_stage=is_last, loss=loss,
                    tokens=labels.numel(), step_time_s=t4 - t0, data_time_s=t1 - t0,
                    fwd_bwd_time_s=t2 - t1, optim_time_s=t3 - t2, grad_norm=grad_norm, lr=lr,
                    memory=memory, gc_pause_s=gc_result.pause_s, time=time.time(),
                    gc_generation=gc_result.generation,
                    aux_loss=aux_loss, moe_layers=moe_layers, expert_load=expert_load,
                    skipped_update=skipped, attempt_start_time=faults.attempt_start_time,
                    metrics_time_s=metrics_time,
                )
                t_hooks = time.perf_counter()
                hooks.on_step_end(step, report)  # the user's callbacks: not the metrics path's cost
                t_report = time.perf_counter()
                reporter.report(report)
                metrics_time = (t_hooks - t_sample) + (time.perf_counter() - t_report)
            clock.step_end(step)
            faults.end_step(step, ckpt.restarted)  # on_nonfinite = "stop"; debug.kill_at_step
            if ckpt.due(step):
                gc_policy.at_checkpoint()
                ckpt.save(step)
                gc_policy.at_checkpoint()
            last_loss = loss
            tokens_per_step = labels.numel()
            del inputs, labels
            snapshots.after_step(step)
    except (torch.OutOfMemoryError, MemoryError) as e:
        error = snapshots.oom(step, e)
        raise error from e
    except BaseException as e:
        error = e
        raise
    finally:
        snapshots.close()
        sampler.close()
        gc_policy.close()
        try:
            hooks.on_train_end(error)
        finally:
            reporter.close()
    rss, peak_rss = host_memory()
    return {
        "rank": rank, "steps": cfg.training.steps, "last_loss": last_loss, **clock.summary(),
        "tokens_per_step": tokens_per_step, "host_rss_bytes": rss, "host_peak_rss_bytes": peak_rss,
        "allocator": allocator,
        "snapshots": [str(p) for p in snapshots.paths],
    }


def _callbacks(cfg: JobConfig, extra: list | None, ctx: CallbackContext) -> CallbackList:
    built = [load_callback(c.target, c.kwargs) for c in cfg.callbacks]
    return CallbackList(built + list(extra or []), ctx)


def _main(argv: list[str] | None = None) -> None:
    """``python -m ray_titan.train_loop --config X.toml [--section.key=value ...]`` without Ray.

    One process, or every rank of a ``torchrun --nproc-per-node=N`` launch (N = the mesh size).
    One process reports to an in-process collector and prints its lines as it goes; under
    torchrun each rank writes its reports to ``metrics/ranks/rank{r}.jsonl`` and rank 0 assembles
    them into the same ``metrics/steps.parquet`` at the end.
    """
    from ray_titan.config import validate_job
    from ray_titan.driver import make_run_dir, resolve_paths
    from ray_titan.metrics.collector import MetricsCollector
    from ray_titan.metrics.leak import leak_settings
    from ray_titan.metrics.report import JsonlReporter, LocalReporter, Reporter, rank_reports_path, read_rank_reports
    from ray_titan.metrics.timing import write_timings

    ap = argparse.ArgumentParser(prog="python -m ray_titan.train_loop", description=_main.__doc__)
    ap.add_argument("--config", default=None, help="TOML job config (default: the built-in defaults)")
    args, overrides = ap.parse_known_args(argv)
    cfg = resolve_paths(load_config(args.config, overrides))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if cfg.world_size != world:
        raise SystemExit(
            f"the mesh needs {cfg.world_size} processes (pp × dp_shard = {cfg.parallelism.pp} × "
            f"{cfg.parallelism.dp_shard}) but this launch has {world}: use torchrun --nproc-per-node={cfg.world_size}"
        )
    validate_job(cfg)  # on every rank, so a bad config stops them all before the process group
    device = local_cuda_device()
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if world > 1 else 0
    holder = [str(make_run_dir(cfg))] if rank == 0 else [None]
    if world > 1:
        dist.broadcast_object_list(holder, src=0, device=device)
    run_dir = Path(holder[0])
    dims = parallel_dims(cfg)

    def new_collector() -> MetricsCollector:
        return MetricsCollector(
            str(run_dir), world, dims.last_stage_ranks(), cfg.training.steps, cfg.metrics.log_freq,
            cfg.metrics.flush_every_steps, cfg.metrics.enable_tensorboard,
            leak_settings(cfg.memory), cfg.memory.on_leak,
        )

    storage = LocalCheckpointStorage(run_dir / "checkpoints", cfg.checkpoint.keep_latest_k)
    if not cfg.metrics.enabled:  # overhead measurements only: no collector, no reports
        summary = train_loop(cfg, Reporter(), device, run_dir, checkpoint_storage=storage)
        write_timings(run_dir, f"rank{rank}", summary)
        if world > 1:
            dist.destroy_process_group()
        if rank == 0:
            print(f"run dir: {run_dir}  (metrics.enabled = false: timings only)", flush=True)
        return
    if world == 1:
        collector = new_collector()

        class _Printing(LocalReporter):
            def report(self, rep):
                try:
                    super().report(rep)
                finally:
                    for line in self.collector.drain_lines():
                        print(line, flush=True)

        write_timings(run_dir, "rank0", train_loop(cfg, _Printing(collector), device, run_dir,
                                                   checkpoint_storage=storage))
    else:
        summary = train_loop(cfg, JsonlReporter(rank_reports_path(run_dir, rank)), device, run_dir,
                             checkpoint_storage=storage)
        write_timings(run_dir, f"rank{rank}", summary)
        dist.barrier()
        if rank == 0:
            collector = new_collector()
            for r in range(world):
                collector.report(read_rank_reports(run_dir, r))
        dist.destroy_process_group()
    if rank == 0:
        summary = collector.finish()
        for line in summary["lines"] if world > 1 else []:
            print(line, flush=True)
        for err in summary["errors"]:
            print(f"metrics error: {err}", flush=True)
        print(f"run dir: {run_dir}  final loss: {summary['final_loss']}", flush=True)


if __name__ == "__main__":
    _main()
