"""The per-worker train loop, top to bottom.

:func:`train_loop` is a plain function of (config, reporter): Ray Train runs it on every worker
(``ray_titan.driver``), and it also runs without Ray, in one process or under ``torchrun``
(``ray_titan.launch``), which is how the CUDA paths are exercised on a machine without Ray.

Per step: data → :func:`~ray_titan.trainer.step.train_step` (forward/backward, clip, optimizer,
LR; the loss becomes a host float on last-stage ranks) → the non-finite policy's decision on the
step's facts, acted on here (:mod:`~ray_titan.trainer.nonfinite`) → synchronized GC → the
validation loss when due (:mod:`~ray_titan.trainer.evaluate`, outside the step time) → memory
sample → one StepReport, sent without waiting → the policy's stop, if it decided one → checkpoint
when due. Nothing from a step outlives it on the device (docs/design.md, lesson 1).
"""

from __future__ import annotations

import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ray_titan.allocator import active_allocator
from ray_titan.callbacks import CallbackContext, CallbackList, load_callback
from ray_titan.checkpoint import Checkpointer
from ray_titan.config.schema import JobConfig
from ray_titan.data.build import build_loader
from ray_titan.data.documents import document_positions
from ray_titan.data.tokenizer import Tokenizer, build_tokenizer
from ray_titan.metrics.worker.memory import MemorySampler, MemorySnapshots, find_oom, host_memory, oom_site
from ray_titan.metrics.worker.profiling import StepProfiler
from ray_titan.metrics.worker.report import Reporter, StepReport
from ray_titan.metrics.worker.timing import StepClock
from ray_titan.trainer.build import TrainParts, build, parallel_dims
from ray_titan.trainer.evaluate import Validator
from ray_titan.trainer.gc_schedule import GarbageCollection
from ray_titan.trainer.nonfinite import Action, NonFiniteError, NonFinitePolicy
from ray_titan.trainer.step import train_step

__all__ = ["train_loop"]


def train_loop(
    cfg: JobConfig, reporter: Reporter, device: torch.device | None = None,
    run_dir: str | Path | None = None, callbacks: list | None = None, checkpoint_storage: Any = None,
    node: str | None = None,
) -> dict[str, Any]:
    """Train ``cfg`` on this rank, sending one :class:`StepReport` per step to ``reporter``.

    ``device`` is where this rank computes (default CPU); the caller picks it, since only the
    launcher knows which GPU, if any, is this rank's. Needs ``torch.distributed`` initialised
    with ``world_size == cfg.world_size`` unless the mesh is a single rank. ``run_dir``: where
    memory snapshots go (``<run_dir>/memory/``; none without it). ``callbacks``: worker-side
    callbacks (``ray_titan.callbacks``), run after those of ``cfg.callbacks``.
    ``checkpoint_storage`` is where checkpoints go (``ray_titan.checkpoint``; None saves none),
    and a restart or ``checkpoint.load_path`` resumes from one. ``node``: the node this rank runs
    on, as reports name it (default: the host name). Returns a small summary of this
    rank (``rank``, ``steps``, ``last_loss``, ``snapshots``, and the timings of
    :class:`~ray_titan.metrics.worker.timing.StepClock`: ``marks``, ``steady_steps``, ``steady_time_s``,
    ``tokens_per_step``, ``host_rss_bytes``, ``host_peak_rss_bytes``, and ``allocator``, the malloc
    this process runs: :func:`~ray_titan.allocator.active_allocator`). With
    ``metrics.enabled = false`` nothing is sampled or sent to ``reporter``. Raises ``RuntimeError`` when the
    process group does not match the mesh, ``RankOutOfMemoryError`` (after writing a snapshot)
    when the rank runs out of memory, ``CheckpointError`` for a bad checkpoint and
    ``NonFiniteError`` under ``training.on_nonfinite = "stop"``.
    """
    run = _set_up(cfg, reporter, device, run_dir, callbacks, checkpoint_storage, node)
    error: BaseException | None = None
    last_loss, step, tokens_per_step = None, 0, 0
    metrics_time: float | None = None  # the previous step's sampling + reporting, seconds
    try:
        run.snapshots.start()
        run.hooks.on_train_start()
        for step in range(run.start_step + 1, cfg.training.steps + 1):
            last_loss, tokens_per_step, metrics_time = _train_one_step(cfg, run, reporter, step, metrics_time)
    except BaseException as e:
        # An OOM of a pipeline stage's forward or backward arrives wrapped in the schedule's
        # RuntimeError: look through the chain, not at the type.
        oom = find_oom(e) if isinstance(e, Exception) else None  # Ctrl-C during an OOM stays Ctrl-C
        if oom is None:
            error = e
            raise
        parts = run.parts
        error = run.snapshots.oom(step, oom, oom_site(e, parts.stages) if parts.schedule is not None else None)
        raise error from e
    finally:
        _close(run, reporter, error)
    return _summary(cfg, run, last_loss, tokens_per_step)


@dataclass
class _Rank:
    """What :func:`_set_up` builds for one rank and the steps use: where it sits in the mesh,
    its data, model and checkpointer, the step to resume after, when its worker group started
    (:func:`_attempt_start_time`), the non-finite policy, and its memory, GC, profiling and
    callback tools."""

    clock: StepClock
    rank: int
    world: int
    coords: dict[str, int]
    node: str
    device: torch.device
    tokenizer: Tokenizer
    loader: Any  # the data loader build_loader gives
    validator: Validator | None
    parts: TrainParts
    ckpt: Checkpointer
    start_step: int
    attempt_start_time: float
    policy: NonFinitePolicy
    allocator: str
    gc_policy: GarbageCollection
    snapshots: MemorySnapshots
    profiler: StepProfiler
    hooks: CallbackList
    sampler: MemorySampler


def _set_up(
    cfg: JobConfig, reporter: Reporter, device: torch.device | None, run_dir: str | Path | None,
    callbacks: list | None, checkpoint_storage: Any, node: str | None,
) -> _Rank:
    """Check the process group against the mesh, seed, build the data, the model and the
    checkpointer (resuming from a checkpoint if there is one), then this rank's GC, memory,
    profiling and callback tools. Raises ``RuntimeError`` when the process group does not match
    the mesh and ``CheckpointError`` for a bad checkpoint."""
    clock = StepClock(cfg.training.steps)
    clock.mark("loop_start")
    dims = parallel_dims(cfg)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != dims.world_size:
        raise RuntimeError(f"{world} processes, but the mesh needs {dims.world_size} ({dims})")
    coords = dims.coords(rank)
    node = node or socket.gethostname()
    device = device or torch.device("cpu")
    if cfg.training.threads_per_worker:
        torch.set_num_threads(cfg.training.threads_per_worker)
    torch.manual_seed(cfg.training.seed)

    # Data: every rank builds the same stream and keeps its DP slice (the tp ranks of a group,
    # and the pp ranks of a pipeline, read the same one).
    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)
    dp_rank, dp_degree = dims.dp_rank(rank), dims.dp
    loader = build_loader(cfg, tokenizer, dp_rank, dp_degree)
    validator = Validator(cfg, tokenizer, dp_rank, dp_degree) if cfg.validation.enable else None
    clock.mark("data_ready")
    parts = build(cfg, rank, tokenizer.vocab_size, loader, device)
    ckpt = Checkpointer(cfg, rank, parts.stages.values(), parts.optimizer, parts.scheduler, loader, reporter,
                        checkpoint_storage, tokenizer.vocab_size, device)
    start_step = ckpt.restore()
    attempt_start_time = _attempt_start_time(device)
    policy = NonFinitePolicy(cfg.training.on_nonfinite, dims.num_stages - 1, cfg.optimizer.lr)
    clock.mark("model_built")

    mem = cfg.memory
    allocator = active_allocator()
    if mem.allocator == "jemalloc" and allocator != "jemalloc" and rank == 0:
        print(f"ray_titan: warning: memory.allocator = 'jemalloc' but this worker runs {allocator} malloc: "
              "only workers started by ray_titan's driver get it; preload it yourself elsewhere "
              "(ray_titan.allocator)", file=sys.stderr, flush=True)
    gc_policy = GarbageCollection(cfg.training.gc_freq, mem.gc_full_every, mem.gc_debug, rank, mem.malloc_trim)
    snapshots = MemorySnapshots(run_dir, rank, coords, device, mem.snapshot_steps, mem.snapshot_on_oom,
                                mem.history_max_entries)
    profiler = StepProfiler(run_dir, rank, coords, device, cfg.profiling.trace_steps,
                            mem.breakdown_step if cfg.metrics.enabled else None,
                            mem.snapshot_steps if device.type == "cpu" else ())
    hooks = _callbacks(cfg, callbacks, CallbackContext(
        rank, coords, world, device, Path(run_dir) if run_dir is not None else None, cfg))
    sampler = MemorySampler(device, cfg.metrics.heap_stats_interval_s)
    return _Rank(clock, rank, world, coords, node, device, tokenizer, loader, validator, parts, ckpt, start_step,
                 attempt_start_time, policy, allocator, gc_policy, snapshots, profiler, hooks, sampler)


def _attempt_start_time(device: torch.device) -> float:
    """When this worker group started: rank 0's clock (Unix seconds), the same on every rank.
    Stamped on every report, so the collector can tell a restarted group's replayed steps from
    the lost ones and keep the newest. Collective (one broadcast)."""
    t = torch.tensor([time.time()], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(t, src=0)
    return float(t.item())


def _train_one_step(
    cfg: JobConfig, run: _Rank, reporter: Reporter, step: int, metrics_time: float | None,
) -> tuple[float | None, int, float | None]:
    """One step: data → :func:`train_step` → the non-finite decision, an undo acted on at once
    → GC → validation when due → memory sample and :class:`StepReport` (``metrics_time``: the
    previous step's sampling + reporting, seconds) → a stop decided raised, ``debug.kill_at_step``
    → checkpoint when due. Returns the step's loss (None off the last stage), its tokens and this
    step's sampling + reporting seconds (None with ``metrics.enabled = false``: the value passed
    in)."""
    loader, device, injection = run.loader, run.device, run.parts.injection
    injection.begin_step(step)
    run.hooks.on_step_begin(step)
    run.snapshots.before_step(step)
    run.profiler.start(step)
    t0 = time.perf_counter()
    inputs, labels = next(loader)
    positions = document_positions(inputs, run.tokenizer.bos_id).to(device) if cfg.training.document_mask else None
    inputs, labels = inputs.to(device), labels.to(device)
    t1 = time.perf_counter()
    out = train_step(run.parts, inputs, labels, step, cfg.parallelism.microbatches, cfg.training.max_norm,
                     loader.counted_tokens, positions)
    decision = run.policy.decide(out.health)  # training.on_nonfinite
    if decision.action is Action.UNDO:  # before anything reads the weights again
        assert run.parts.backup is not None  # saved under "skip", the only policy that undoes
        run.parts.backup.restore(run.parts.params, run.parts.optimizer)
    if decision.action in (Action.SKIP, Action.UNDO) and run.rank == 0:
        print(f"ray_titan: {decision.message}", flush=True)
    t_export = time.perf_counter()
    breakdown = run.profiler.stop(step)
    export_s = time.perf_counter() - t_export  # writing traces and the memory timeline's analysis
    gc_result = run.gc_policy.run(step)
    t_val = time.perf_counter()
    val = run.validator.run(run.parts) if run.validator is not None and run.validator.due(step) else None
    t_val = time.perf_counter() - t_val  # kept out of the step time
    if cfg.metrics.enabled:
        t_sample = time.perf_counter()
        memory = run.sampler.sample()
        t4 = time.perf_counter() - t_val
        report = StepReport(
            step=step, rank=run.rank, coords=run.coords, is_last_stage=run.parts.is_last_stage, loss=out.loss,
            tokens=labels.numel(), step_time_s=t4 - t0 - export_s, data_time_s=t1 - t0,
            fwd_bwd_time_s=out.fwd_bwd_time_s, optim_time_s=out.optim_time_s,
            grad_norm=out.grad_norm, lr=out.lr, memory=memory, gc_pause_s=gc_result.pause_s,
            time=time.time(), gc_generation=gc_result.generation, aux_loss=out.aux_loss,
            moe_layers=out.moe_layers, expert_load=out.expert_load, skipped_update=decision.skipped_update,
            attempt_start_time=run.attempt_start_time, metrics_time_s=metrics_time,
            memory_breakdown=breakdown, loss_tokens=out.loss_tokens, source_tokens=loader.source_tokens,
            mtp_losses=out.mtp_losses,
            val_loss=val.loss if val else None, val_tokens=val.tokens if val else None,
            val_time_s=val.time_s if val else None,
            node=run.node, world_size=run.world,
        )
        t_hooks = time.perf_counter()
        run.hooks.on_step_end(step, report)  # the user's callbacks: not the metrics path's cost
        t_report = time.perf_counter()
        reporter.report(report)
        metrics_time = (t_hooks - t_sample) + (time.perf_counter() - t_report)
    run.clock.step_end(step)
    if decision.action is Action.STOP:  # once the step is reported, so the metrics show it
        raise NonFiniteError(decision.message)
    injection.kill_if_due(step, run.ckpt.restarted)
    if run.ckpt.due(step):
        run.gc_policy.at_checkpoint()
        run.ckpt.save(step)
        run.gc_policy.at_checkpoint()
    loss, tokens = out.loss, labels.numel()
    del inputs, labels, positions
    run.snapshots.after_step(step)
    return loss, tokens, metrics_time


def _close(run: _Rank, reporter: Reporter, error: BaseException | None) -> None:
    """Close the profiler, the snapshots, the sampler and the GC policy, run the callbacks'
    ``on_train_end(error)``, and close ``reporter`` even when a callback raises."""
    run.profiler.close()
    run.snapshots.close()
    run.sampler.close()
    run.gc_policy.close()
    try:
        run.hooks.on_train_end(error)
    finally:
        reporter.close()


def _summary(cfg: JobConfig, run: _Rank, last_loss: float | None, tokens_per_step: int) -> dict[str, Any]:
    """The summary :func:`train_loop` returns (its docstring lists the keys)."""
    rss, peak_rss = host_memory()
    snapshots, profiler = run.snapshots, run.profiler
    return {
        "rank": run.rank, "steps": cfg.training.steps, "last_loss": last_loss, **run.clock.summary(),
        "tokens_per_step": tokens_per_step, "host_rss_bytes": rss, "host_peak_rss_bytes": peak_rss,
        "allocator": run.allocator,
        "snapshots": [str(p) for p in snapshots.paths] + [str(p) for p in profiler.paths if "/profile/" not in str(p)],
        "traces": [str(p) for p in profiler.paths if "/profile/" in str(p)],
    }


def _callbacks(cfg: JobConfig, extra: list | None, ctx: CallbackContext) -> CallbackList:
    built = [load_callback(c.target, c.kwargs) for c in cfg.callbacks]
    return CallbackList(built + list(extra or []), ctx)
