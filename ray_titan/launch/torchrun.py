"""The train loop without Ray: one process, or every rank of a ``torchrun`` launch.

``python -m ray_titan.launch --config X.toml [--section.key=value ...]`` runs
:func:`ray_titan.trainer.train_loop` in this process; under ``torchrun --nproc-per-node=N``
(N = the mesh size) each rank runs it in a gloo (CPU) or NCCL (CUDA, one GPU per rank by
``LOCAL_RANK``) process group. The run directory, checkpoints and metrics are those of a Ray run:
one process reports to an in-process collector and prints its lines as it goes; under torchrun
each rank writes its reports to ``metrics/ranks/rank{r}.jsonl`` and rank 0 assembles them into
``metrics/steps.parquet`` and prints the step lines at the end; meanwhile the first rank of the
last pipeline stage prints its own loss and step time as it goes (``[rank r]`` lines).

Nothing here imports Ray: it runs where Ray is not installed (tests/integration/test_without_ray.py).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

from ray_titan.checkpoint import LocalCheckpointStorage, find_latest, save_last_hf
from ray_titan.config.schema import JobConfig, load_config
from ray_titan.metrics.collector.collector import MetricsCollector
from ray_titan.metrics.collector.leak import leak_settings
from ray_titan.metrics.collector.sinks.wandb import wandb_settings
from ray_titan.metrics.outcome import RunOutcome
from ray_titan.metrics.worker.report import (
    JsonlReporter,
    LocalReporter,
    Reporter,
    StepReport,
    rank_reports_path,
    read_rank_reports,
)
from ray_titan.metrics.worker.timing import write_timings
from ray_titan.parallel.dims import process_group_backend
from ray_titan.preflight.prepare import prepare_job
from ray_titan.run_dir import make_run_dir
from ray_titan.trainer.build import parallel_dims
from ray_titan.trainer.loop import train_loop

__all__ = ["local_cuda_device", "main"]


def local_cuda_device() -> torch.device:
    """``cuda:LOCAL_RANK`` (as torchrun sets it), made the current device; CPU without CUDA.
    Raises ``SystemExit`` when the node has fewer GPUs than this rank's ``LOCAL_RANK`` needs
    (one GPU per rank: NCCL refuses two ranks on one GPU), before CUDA's own opaque error."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local, gpus = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
    if local >= gpus:
        raise SystemExit(f"local rank {local} needs GPU {local}, but this node has {gpus} GPU(s): launch at most "
                         f"{gpus} process(es) per node (torchrun --nproc-per-node={gpus}), one GPU per rank")
    dev = torch.device("cuda", local)
    torch.cuda.set_device(dev)
    return dev


def main(argv: list[str] | None = None) -> None:
    """``python -m ray_titan.launch --config X.toml [--section.key=value ...]`` without Ray.

    One process, or every rank of a ``torchrun --nproc-per-node=N`` launch (N = the mesh size).
    One process reports to an in-process collector and prints its lines as it goes; under
    torchrun each rank writes its reports to ``metrics/ranks/rank{r}.jsonl`` and rank 0 assembles
    them into the same ``metrics/steps.parquet`` at the end (one last-stage rank prints its own
    lines meanwhile). Raises ``ConfigError`` for an invalid config, ``SystemExit`` for a process
    count that is not the mesh's, a Ray Data source, a final loss that is not finite or a run that
    applied no update.
    """
    ap = argparse.ArgumentParser(prog="python -m ray_titan.launch", description=main.__doc__)
    ap.add_argument("--config", default=None, help="TOML job config (default: the built-in defaults)")
    args, overrides = ap.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    world = int(os.environ.get("WORLD_SIZE", 1))
    _check_launch(cfg, world)
    # On every rank, so a bad config stops them all before the process group; rank 0 warns and plans.
    lead = int(os.environ.get("RANK", 0)) == 0
    job = prepare_job(cfg, warn=lead, plan=lead)
    cfg = job.config
    device = local_cuda_device()
    if world > 1:
        dist.init_process_group(process_group_backend(device.type == "cuda", cfg.memory.cpu_offload))
    rank = dist.get_rank() if world > 1 else 0
    holder: list[str | None] = [str(make_run_dir(cfg))] if rank == 0 else [None]
    if world > 1:
        dist.broadcast_object_list(holder, src=0, device=device)
    assert holder[0] is not None  # rank 0's, broadcast to every rank
    run_dir = Path(holder[0])
    dims = parallel_dims(cfg)
    if rank == 0:
        job.record_plan(run_dir)

    def new_collector() -> MetricsCollector:
        return MetricsCollector(
            str(run_dir), world, dims.last_stage_ranks(), cfg.training.steps, cfg.metrics.log_freq,
            cfg.metrics.flush_every_steps, cfg.metrics.enable_tensorboard,
            leak_settings(cfg.memory), cfg.memory.on_leak, wandb=wandb_settings(cfg),
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
        summary = train_loop(cfg, _rank_reporter(cfg, run_dir, rank, dims.last_stage_ranks()[0]), device, run_dir,
                             checkpoint_storage=storage)
        write_timings(run_dir, f"rank{rank}", summary)
        dist.barrier()
        if rank == 0:
            collector = new_collector()
            for r in range(world):
                collector.report(read_rank_reports(run_dir, r))
        dist.destroy_process_group()
    if rank == 0:
        _end(cfg, run_dir, RunOutcome.from_summary(collector.finish()), world)

class _OwnLines(Reporter):
    """One rank's own console line at the steps the collector prints (the first, every
    ``log_freq``-th and the last): its loss over its own tokens and its step time. Under torchrun
    the assembled lines come only at the end, so one last-stage rank shows progress meanwhile."""

    def __init__(self, total_steps: int, log_freq: int):
        self.total_steps, self.log_freq = total_steps, log_freq

    def report(self, rep: StepReport) -> None:
        if rep.step in (1, self.total_steps) or rep.step % self.log_freq == 0:
            loss = "n/a" if rep.loss is None else f"{rep.loss:.4f}"
            print(f"[rank {rep.rank}] step {rep.step}/{self.total_steps} | own loss {loss} | "
                  f"step {rep.step_time_s:.3f}s", flush=True)


def _rank_reporter(cfg: JobConfig, run_dir: Path, rank: int, watch: int) -> Reporter:
    """A torchrun rank's reporter: its reports to ``metrics/ranks/rank{r}.jsonl`` (assembled by
    rank 0 at the end), and on rank ``watch`` (a last-stage rank: one holding a loss) its own
    console lines as it goes, announced by rank 0."""
    if rank == 0:
        print(f"ray_titan: rank {watch} prints its own loss and step time as steps go ([rank {watch}] lines); "
              "every rank's reports are assembled into metrics/steps.parquet and the step lines when the run ends",
              flush=True)
    path = rank_reports_path(run_dir, rank)
    return JsonlReporter(path, _OwnLines(cfg.training.steps, cfg.metrics.log_freq) if rank == watch else None)


def _check_launch(cfg: JobConfig, world: int) -> None:
    """Refuse, before the process group, a launch whose process count (``WORLD_SIZE``) is not the
    mesh's, and a Ray Data source (it streams through Ray: ``ray-titan train``)."""
    if cfg.world_size != world:
        raise SystemExit(
            f"the mesh needs {cfg.world_size} processes (pp × dp_replicate × dp_shard × tp = {cfg.parallelism.pp} × "
            f"{cfg.parallelism.dp_replicate} × {cfg.parallelism.dp_shard} × {cfg.parallelism.tp}) but this launch "
            f"has {world}: use torchrun --nproc-per-node={cfg.world_size}"
        )
    if cfg.data.source == "ray_data":
        raise SystemExit("data.source = 'ray_data' streams through Ray: run it with ray-titan train (the Ray driver)")


def _end(cfg: JobConfig, run_dir: Path, outcome: RunOutcome, world: int) -> None:
    """Rank 0's end of a run: the lines not shown yet (under torchrun), the metrics errors, the run
    directory and final loss; the Hugging Face export ``checkpoint.last_save_hf`` asks for. Exits
    with an error for a non-finite final loss or a run that applied no update (as ``ray-titan train``)."""
    for line in outcome.lines if world > 1 else []:
        print(line, flush=True)
    for err in outcome.errors:
        print(f"metrics error: {err}", flush=True)
    skipped, run = outcome.skipped_steps, outcome.steps_run
    note = f"  ({skipped} of {run} updates skipped)" if skipped else ""
    print(f"run dir: {run_dir}  final loss: {outcome.final_loss}{note}", flush=True)
    save_last_hf(cfg, find_latest(run_dir / "checkpoints"), run_dir)
    if not outcome.final_loss_is_finite:
        raise SystemExit(f"the final loss is {outcome.final_loss}, not finite")
    if run and skipped >= run:  # as ray-titan train: a run that applied no update learned nothing
        raise SystemExit(f"no update was applied: {skipped} of {run} updates skipped")

