"""The Ray side: cluster, metrics collector actor, TorchTrainer, and the :class:`RunResult`.

:func:`train` validates the config before anything starts, joins the Ray cluster named by
``RAY_ADDRESS`` (or the one this process is already connected to, or starts a local one sized for
the job), creates the metrics collector actor (``num_cpus=0``, owned by the driver so it outlives
the worker group), runs the train loop on ``pp × dp_replicate × dp_shard × tp`` Ray Train workers, shows the run's
progress (a bar on a terminal, the collector's console lines otherwise; :mod:`ray_titan.progress`),
and returns the run's metrics. The run directory may be a local path or a URI
(:mod:`ray_titan.storage`).

Fault tolerance: Ray Train restarts a failed worker group up to ``ray.max_failures`` times and
the restarted group resumes from the latest checkpoint (``<run_dir>/checkpoints``, kept by Ray's
``CheckpointConfig``); Ray restarts a killed collector up to ``metrics.collector_max_restarts``
times. Ctrl-C (SIGINT) makes Ray Train abort the worker group; the driver then flushes the
metrics and says where the last checkpoint is.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pyarrow as pa

from ray_titan import storage
from ray_titan.config.schema import ConfigError, JobConfig, apply_overrides, load_config
from ray_titan.hf import resolve_hf_job, save_last_hf
from ray_titan.preflight import job_warnings, validate_job
from ray_titan.run_dir import STOP_REASON_FILE, make_run_dir, resolve_paths, under

if TYPE_CHECKING:
    from ray_titan.progress import Mode

__all__ = ["RunResult", "train"]


@dataclass
class RunResult:
    """What a run produced.

    ``steps``: the per-step, per-rank metrics (``metrics/steps.parquet``; schema
    ``ray_titan.metrics.sinks.STEP_SCHEMA``). ``final_loss``: the last step's loss (token-weighted
    mean over the last pipeline stage's DP ranks, nats per token). ``errors``: steps the
    collector could not assemble or reports it found wrong (empty for a healthy run).
    ``run_dir``: a local :class:`~pathlib.Path`, or the URI string of a remote run directory.
    ``memory_verdicts``: every rank's last memory verdict, ``{rank: {"verdict", "slope_mib_per_step",
    "oom_step", "source", "coords"}}`` (``ray_titan.metrics.leak``); the verdict of every step is
    in ``steps``. ``memory_snapshots``: the files under ``<run_dir>/memory/``.
    """

    run_dir: Path | str
    steps: pa.Table
    final_loss: float | None
    errors: list[str] = field(default_factory=list)
    config: JobConfig | None = None
    memory_verdicts: dict[int, dict[str, Any]] = field(default_factory=dict)
    memory_snapshots: list[Path] = field(default_factory=list)
    checkpoint: Path | None = None
    """The latest complete checkpoint (``<run_dir>/checkpoints/step-NNNNNNNN``), None if none."""
    skipped_steps: int = 0
    """Steps whose update was dropped (``training.on_nonfinite = "skip"``)."""
    restarts: int = 0
    """Worker-group restarts during the run."""
    collector_restarted: bool = False
    """The metrics collector was killed and restarted by Ray during the run."""
    timings: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The run's ``timings/`` files by name (``driver``, ``rank0``, ...;
    ``ray_titan.metrics.timing``): start-up marks and steady-state step timing."""
    hf_export: Path | None = None
    """The Hugging Face model directory ``checkpoint.last_save_hf`` wrote (``<run_dir>/hf``)."""

    @property
    def metrics_path(self) -> Path | str:
        return under(self.run_dir, "metrics", "steps.parquet")

    @property
    def tensorboard_dir(self) -> Path | str:
        return under(self.run_dir, "tb")

    def step_column(self, column: str) -> list:
        """A step-level column (``step_loss``, ``grad_norm``, ``lr``, ...) in step order, one value
        per step (read from rank 0's rows; step-level values are the same on every rank)."""
        rows = self.steps.filter(pa.compute.equal(self.steps["rank"], 0))
        return rows.sort_by("step")[column].to_pylist()

    def losses(self) -> list[float]:
        """The step losses (nats per token) in step order."""
        return self.step_column("step_loss")


def _connect(cfg: JobConfig) -> None:
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        return
    num_cpus = cfg.ray.num_cpus or os.cpu_count() or 1
    # The dashboard serves the state API that Ray Train V2 polls to clean up after a run.
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=True, dashboard_host="127.0.0.1", log_to_driver=True)


def _check_cluster(cfg: JobConfig) -> float:
    """CPUs to reserve per worker; raises :class:`ConfigError` if the connected cluster cannot
    hold the worker group (its start would otherwise wait forever)."""
    import ray

    resources = ray.cluster_resources()
    n = cfg.world_size
    gpus, cluster_cpus = resources.get("GPU", 0), resources.get("CPU", 0)
    if cfg.ray.use_gpu and gpus < n:
        raise ConfigError(f"ray.use_gpu = true needs {n} GPUs (one per worker) but the cluster has {gpus:g}")
    # Default: fractions where the cluster has fewer cores than workers, never more than one each.
    cpus = cfg.ray.cpus_per_worker or min(1.0, round(cluster_cpus / n, 3))
    if cpus * n > cluster_cpus + 1e-9:
        raise ConfigError(
            f"ray.cpus_per_worker = {cpus:g} × {n} workers = {cpus * n:g} CPUs, but the cluster "
            f"has {cluster_cpus:g}: the worker group could never start; use "
            f"ray.cpus_per_worker <= {cluster_cpus / n:.3g} (or leave it unset)"
        )
    return cpus


def set_process_niceness(nice: int) -> bool:
    """Set the niceness of every thread of this process (Linux niceness is per thread; threads
    started later inherit their creator's) to ``nice``. Returns False, with a warning, where
    the process may not lower it (no ``CAP_SYS_NICE``) or the platform has no
    ``os.setpriority``; it then keeps what it had."""
    tids = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
    try:
        for tid in tids:
            with contextlib.suppress(ProcessLookupError):  # a thread that has ended since
                os.setpriority(os.PRIO_PROCESS, tid, nice)
    except (PermissionError, AttributeError) as e:
        warnings.warn(f"ray.worker_nice = {nice}: cannot set this worker's niceness ({e}); it keeps "
                      f"{os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, 'getpriority') else 'its own'}",
                      stacklevel=2)
        return False
    return True


def _worker_entry(loop_config: dict[str, Any]) -> None:
    """Ray Train's ``train_loop_per_worker``: rebuild the config, report to the collector."""
    # First, so that the imports below (seconds of CPU on a busy machine) run at it too.
    set_process_niceness(loop_config["config"]["ray"]["worker_nice"])
    import ray.train
    import ray.train.torch
    import torch

    from ray_titan.checkpoint import RayTrainCheckpointStorage
    from ray_titan.fault import NonFiniteError
    from ray_titan.metrics.report import CollectorReporter, JsonlReporter, Reporter, rank_reports_path
    from ray_titan.metrics.timing import write_timings
    from ray_titan.trainer import train_loop

    worker_start = time.time()
    cfg = JobConfig.model_validate(loop_config["config"])
    rank = ray.train.get_context().get_world_rank()
    if loop_config["collector"] is None:  # metrics.enabled = false
        reporter = Reporter()
    else:
        reporter = CollectorReporter(
            loop_config["collector"], cfg.metrics.max_inflight_reports, cfg.metrics.max_buffered_reports,
            interval_s=cfg.metrics.report_interval_s,
        )
    if cfg.metrics.save_rank_reports:
        reporter = JsonlReporter(rank_reports_path(loop_config["run_dir"], rank), reporter)
    # Only a worker that reserved a GPU may use one; Ray does not hide unreserved GPUs.
    device = ray.train.torch.get_device() if cfg.ray.use_gpu else torch.device("cpu")
    try:
        summary = train_loop(
            cfg, reporter, device, run_dir=loop_config["run_dir"], callbacks=loop_config.get("callbacks"),
            checkpoint_storage=RayTrainCheckpointStorage(loop_config["run_dir"]) if cfg.checkpoint.enable else None,
        )
    except NonFiniteError as e:
        # Every rank stops at the same step. Raising would make Ray Train restart the group
        # (ray.max_failures), only to meet the same NaN: end the run and let the driver raise.
        if ray.train.get_context().get_world_rank() == 0:
            if loop_config["collector"] is None:  # metrics.enabled = false: the driver reads it here
                storage.write_text(under(loop_config["run_dir"], STOP_REASON_FILE), str(e))
            else:
                ray.get(loop_config["collector"].stop_run.remote(str(e)), timeout=120)
        return
    summary["marks"]["worker_start"] = worker_start
    write_timings(loop_config["run_dir"], f"rank{rank}", summary)


def train(
    config: JobConfig | str | Path, overrides: list[str] | None = None, progress: str = "auto", *,
    callbacks: list | None = None,
) -> RunResult:
    """Run a training job on Ray and return its :class:`RunResult`.

    ``config`` is a :class:`JobConfig` or the path of a TOML job config; ``overrides`` are
    dotted flags (``["--training.steps=50"]``). ``progress``: ``auto`` (a progress bar when
    stdout is a terminal, plain lines otherwise), ``bar`` or ``lines``. ``callbacks``:
    worker-side callback objects (``ray_titan.callbacks``), pickled to every worker and run after
    those of the config. Raises :class:`ConfigError` for an invalid job before any worker starts,
    :class:`~ray_titan.metrics.leak.MemoryLeakError` when a rank's memory grew and
    ``memory.on_leak = "stop"`` ended the run, and ``ray.train.TrainingFailedError`` if training
    fails otherwise (the metrics recorded until then stay in the run directory), ``NonFiniteError``
    when a non-finite loss stopped it, and ``KeyboardInterrupt`` after Ctrl-C.
    """
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from ray_titan.allocator import worker_env_vars
    from ray_titan.checkpoint import find_latest
    from ray_titan.metrics.collector import MetricsCollector
    from ray_titan.metrics.leak import MemoryLeakError, leak_settings
    from ray_titan.metrics.sinks import read_steps
    from ray_titan.metrics.timing import read_timings, write_timings
    from ray_titan.progress import ConsoleThread, check_mode, make_display
    from ray_titan.trainer.build import parallel_dims

    check_mode(progress)
    marks = {"train_called": time.time()}
    if isinstance(config, JobConfig):
        cfg = config
        if overrides:
            cfg = JobConfig.from_dict(apply_overrides(cfg.model_dump(), overrides))
    else:
        cfg = load_config(config, overrides)
    dump = cfg.job.dump_folder
    if "://" not in dump and not Path(dump).expanduser().is_absolute() and "working_dir_files" in Path.cwd().parts:
        print(
            f"ray_titan: warning: job.dump_folder = {cfg.job.dump_folder!r} is relative and this job "
            "runs in Ray's temporary copy of its working directory, which Ray deletes; pass an "
            "absolute --job.dump_folder (shared storage on a multi-node cluster) to keep the run",
            file=sys.stderr, flush=True,
        )
    cfg = resolve_hf_job(resolve_paths(cfg))
    for warning in job_warnings(cfg):
        print(f"ray_titan: warning: {warning}", file=sys.stderr, flush=True)
    validate_job(cfg)  # also materialises the built-in corpus, once, before workers read it

    _connect(cfg)
    dims = parallel_dims(cfg)
    cpus = _check_cluster(cfg)
    marks["cluster_ready"] = time.time()
    if cfg.training.threads_per_worker is None:
        cfg = cfg.model_copy(update={"training": cfg.training.model_copy(
            update={"threads_per_worker": max(1, int(cpus + 0.999))})})
    run_dir = make_run_dir(cfg)
    storage.write_text(under(run_dir, "config.json"), cfg.model_dump_json(indent=2))
    # Restarted by Ray if it dies; it resumes from its flushed parts and workers resend the rest.
    # No task events: each report call would be one more entry the GCS keeps (up to 100k) and
    # the dashboard lists, and their bookkeeping costs the GCS and the actor CPU every call.
    # Any: Ray types an actor handle's `method.remote()` only for @ray.method-decorated methods.
    collector: Any = ray.remote(MetricsCollector).options(
        num_cpus=0, max_restarts=cfg.metrics.collector_max_restarts, enable_task_events=False,
    ).remote(
        str(run_dir), dims.world_size, dims.last_stage_ranks(), cfg.training.steps,
        cfg.metrics.log_freq, cfg.metrics.flush_every_steps, cfg.metrics.enable_tensorboard,
        leak=leak_settings(cfg.memory), on_leak=cfg.memory.on_leak,
        kill_at_step=cfg.debug.kill_collector_at_step, nice=cfg.metrics.collector_nice,
    ) if cfg.metrics.enabled else None
    # The run directory's last part; run_dir is a URI string (no .name) on remote storage.
    run_name = run_dir.name if isinstance(run_dir, Path) else run_dir.rstrip("/").rsplit("/", 1)[-1]
    print(
        f"ray_titan: run {run_name}: {dims.world_size} workers ({dims.describe()}, {cpus} CPU each), "
        f"{cfg.model.name}/{cfg.model.flavor}, "
        f"{cfg.training.steps} steps; last stage on ranks {dims.last_stage_ranks()}; run dir {run_dir}",
        flush=True,
    )
    trainer = TorchTrainer(
        _worker_entry,
        train_loop_config={"config": cfg.model_dump(), "collector": collector, "run_dir": str(run_dir),
                           "callbacks": list(callbacks or [])},
        torch_config=TorchConfig(backend="nccl" if cfg.ray.use_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=dims.world_size, use_gpu=cfg.ray.use_gpu,
            resources_per_worker={"CPU": cpus, **({"GPU": 1} if cfg.ray.use_gpu else {})},
        ),
        # The ignores: worker_runtime_env and controller_failure_limit are Ray Train V2's (the
        # RunConfig and FailureConfig ray.train exports at runtime); mypy resolves the V1 classes.
        run_config=RunConfig(  # type: ignore[call-arg]
            # Checkpoints land in <run_dir>/checkpoints/step-NNNNNNNN (ray_titan.checkpoint).
            name="checkpoints",
            storage_path=str(run_dir),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep_latest_k or None),
            # A worker group that cannot start fails the run at once instead of retrying forever.
            failure_config=FailureConfig(  # type: ignore[call-arg]
                max_failures=cfg.ray.max_failures, controller_failure_limit=0),
            # The allocator is chosen at process start: preloaded into the workers only.
            worker_runtime_env={"env_vars": env} if (env := worker_env_vars(cfg.memory.allocator)) else None,
        ),
    )
    if collector is None:
        return _fit_without_metrics(trainer, cfg, run_dir, marks)
    console = ConsoleThread(lambda: ray.get(collector.poll.remote(), timeout=30),
                            make_display(cfg.training.steps, cast("Mode", progress)))  # checked above
    console.start()
    failure: BaseException | None = None
    summary: dict[str, Any]
    marks["fit_called"] = time.time()
    try:
        trainer.fit()
    except BaseException as e:  # keep the metrics recorded so far, then re-raise
        failure = e
    finally:
        marks["fit_returned"] = time.time()
        write_timings(run_dir, "driver", {"marks": marks})
        console.stop_event.set()  # no poll may drain lines between here and the summary
        try:
            summary = ray.get(collector.finish.remote(), timeout=120)
        except Exception as e:  # the flushed parts are on disk; never hide a training error
            summary = {"lines": [], "errors": [f"metrics collector failed to finish: {e}"], "final_loss": None}
        console.finish(summary)
        ray.kill(collector)
    # Checkpoints of a remote run directory stay where Ray Train put them; only local ones are found.
    latest = find_latest(run_dir / "checkpoints") if isinstance(run_dir, Path) else None
    where = (f"last checkpoint {latest} (continue with --checkpoint.load_path={latest})"
             if latest else "no checkpoint was saved")
    if isinstance(failure, (KeyboardInterrupt, SystemExit)):
        # Ray Train's SIGINT handler aborted the worker group and exits the driver.
        print(f"ray_titan: interrupted: workers stopped; metrics in {under(run_dir, 'metrics')}; {where}",
              file=sys.stderr, flush=True)
        raise KeyboardInterrupt(str(where)) from None
    if failure is not None:
        print(f"ray_titan: run failed; metrics so far in {under(run_dir, 'metrics')}; {where}", file=sys.stderr)
        if summary.get("stop"):
            raise MemoryLeakError(summary["stop"]) from failure
        raise failure
    if summary.get("stop_reason"):
        from ray_titan.fault import NonFiniteError

        print(f"ray_titan: run stopped; metrics in {under(run_dir, 'metrics')}; {where}", file=sys.stderr)
        raise NonFiniteError(summary["stop_reason"])
    for err in summary["errors"]:
        print(f"ray_titan: metrics error: {err}", file=sys.stderr)
    result = RunResult(
        run_dir=run_dir, steps=read_steps(run_dir), final_loss=summary["final_loss"],
        errors=summary["errors"], config=cfg, checkpoint=latest,
        skipped_steps=summary.get("skipped_steps", 0), restarts=summary.get("restarts", 0),
        collector_restarted=summary.get("collector_restarted", False),
        memory_verdicts=summary.get("memory_verdicts", {}),
        memory_snapshots=sorted((run_dir / "memory").glob("*"))
        if isinstance(run_dir, Path) and (run_dir / "memory").is_dir() else [],
        timings=read_timings(run_dir),
        hf_export=save_last_hf(cfg, latest, run_dir),
    )
    print(f"ray_titan: done: final loss {result.final_loss}, metrics {result.metrics_path}, "
          f"{where}", flush=True)
    return result


def _fit_without_metrics(trainer, cfg: JobConfig, run_dir: Path | str, marks: dict[str, float]) -> RunResult:
    """``metrics.enabled = false``: run the worker group with no collector; only timings are kept."""
    from ray_titan.metrics.timing import read_timings, write_timings

    marks["fit_called"] = time.time()
    try:
        trainer.fit()
    finally:
        marks["fit_returned"] = time.time()
        write_timings(run_dir, "driver", {"marks": marks})
    where = f"metrics.enabled = false: timings only in {under(run_dir, 'timings')}"
    stop = under(run_dir, STOP_REASON_FILE)
    if storage.exists(stop):
        from ray_titan.fault import NonFiniteError

        print(f"ray_titan: run stopped ({where})", file=sys.stderr, flush=True)
        raise NonFiniteError(storage.read_text(stop))
    print(f"ray_titan: done ({where})", flush=True)
    return RunResult(run_dir=run_dir, steps=pa.table({}), final_loss=None, config=cfg, timings=read_timings(run_dir))
