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
import math
import os
import re
import shutil
import signal
import sys
import time
import warnings
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pyarrow as pa

from ray_titan import storage
from ray_titan.config.schema import ConfigError, JobConfig, apply_overrides, load_config
from ray_titan.hf import resolve_hf_job, save_last_hf
from ray_titan.interrupts import Interrupted, SignalGuard
from ray_titan.memory_planner import record_memory_plan
from ray_titan.parallel.dims import process_group_backend
from ray_titan.preflight import job_warnings, validate_job
from ray_titan.run_dir import STOP_REASON_FILE, make_run_dir, resolve_paths, under

if TYPE_CHECKING:
    from ray_titan.progress import Mode

__all__ = ["Interrupted", "RunResult", "init_local_cluster", "train"]



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
    steps_run: int = 0
    """Steps this run trained, each one optimizer update (a step a restart ran again counts once;
    a run resumed at step k runs steps k+1 .. ``training.steps``)."""
    restarts: int = 0
    """Worker-group restarts during the run."""
    collector_restarted: bool = False
    """The metrics collector was killed and restarted by Ray during the run."""
    timings: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The run's ``timings/`` files by name (``driver``, ``rank0``, ...;
    ``ray_titan.metrics.timing``): start-up marks and steady-state step timing."""
    hf_export: Path | None = None
    """The Hugging Face model directory ``checkpoint.last_save_hf`` wrote (``<run_dir>/hf``)."""
    memory_plan: dict[str, Any] | None = None
    """The memory plan made before the workers started (``ray_titan.memory_planner``,
    ``MemoryPlan.to_dict()``; also ``<run_dir>/memory_plan.json``), None if it could not be made."""
    memory_breakdown: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Every rank's memory measured at ``memory.breakdown_step``, by category at the step's peak
    (``ray_titan.metrics.profiling.StepProfiler.stop``): ``{rank: {"step", "peak_bytes",
    "at_peak": {category: bytes}, "category_peaks", ...}}``."""
    profiler_traces: list[Path] = field(default_factory=list)
    """Chrome traces of ``profiling.trace_steps``: ``<run_dir>/profile/rank{r}-step{s}.json``."""

    def memory_peaks(self) -> dict[int, tuple[int | None, int | None]]:
        """``{rank: (predicted peak bytes, measured peak bytes)}``: the plan's and the breakdown's."""
        planned = {r["rank"]: r["peak"] for r in (self.memory_plan or {}).get("ranks", [])}
        ranks = sorted(set(planned) | set(self.memory_breakdown))
        return {r: (planned.get(r), self.memory_breakdown.get(r, {}).get("peak_bytes")) for r in ranks}

    @property
    def no_update_applied(self) -> bool:
        """Every step of the run had its update skipped: the weights are those it started from.
        ``ray-titan train`` exits 1 for such a run."""
        return self.steps_run > 0 and self.skipped_steps >= self.steps_run

    @property
    def skipped_note(self) -> str:
        """``"N of M updates skipped"``, or ``""`` when none was."""
        return f"{self.skipped_steps} of {self.steps_run} updates skipped" if self.skipped_steps else ""

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

    @property
    def validation(self) -> dict[int, float]:
        """The validation losses (nats per counted token, token-weighted over the last stage's
        data-parallel ranks) by step, at the steps that evaluated (``[validation]``); empty
        without validation. Their perplexity is ``math.exp`` of each."""
        if "step_val_loss" not in self.steps.column_names:
            return {}
        steps, vals = self.step_column("step"), self.step_column("step_val_loss")
        return {s: v for s, v in zip(steps, vals) if v is not None}


# Ray Train V2 starts a detached PlacementGroupCleaner per run, which removes the run's placement
# group (and so kills every worker) once the state API says the run's controller is not alive. It
# asks the state API of RAY_API_SERVER_ADDRESS, else RAY_ADDRESS, else whatever cluster it finds
# on its machine: <temp dir>/ray/ray_current_cluster (written by `ray start` and by
# ray.cluster_utils.Cluster, of any user) or the only gcs_server process running. With another
# cluster found there, that cluster's dashboard answers "no such actor" for our live controller
# and our run is killed; with none, several or no dashboard, the cleaner's thread dies (no
# clean-up, no harm). So every cluster ray_titan starts or joins names itself to the cleaner,
# through the job's runtime env, which the controller and the cleaner inherit.
_STATE_API_VARS = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")


_OWN_CLUSTER_VAR = "RAY_TITAN_OWN_CLUSTER"


def own_cluster() -> bool:
    """Whether this Ray job runs on a one-machine cluster ray_titan started
    (:func:`init_local_cluster`, named in the job's runtime env): it has no autoscaler and ends
    with its driver, so runs leave out Ray Train's placement-group cleaner and autoscaling
    coordinator (:class:`ray_titan.scaling.LeanTorchTrainer`)."""
    import ray

    env = (ray.get_runtime_context().runtime_env or {}).get("env_vars") or {}
    return env.get(_OWN_CLUSTER_VAR) == "1"


def init_local_cluster(num_cpus: int, **kwargs: Any) -> None:
    """``ray.init`` a new local cluster with the dashboard (its state API) on a free port of
    127.0.0.1, named in the job's runtime env as ``RAY_API_SERVER_ADDRESS`` so Ray Train's
    placement-group cleaner asks this cluster about its runs and no other; Ray Train's preemption
    watcher is off (a one-machine cluster is never drained), and so are the placement-group cleaner
    and the autoscaling coordinator of fixed-size runs (:func:`own_cluster`). ``kwargs`` go to
    ``ray.init`` (``_temp_dir``, ``log_to_driver``, ...)."""
    import socket

    import ray

    with socket.socket() as s:  # a free port now; the dashboard binds it a moment later
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{port}",
           # One machine, no autoscaler: no node is ever drained, so Ray Train's preemption
           # watcher (an actor process per worker group) would only cost its start-up.
           "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
           _OWN_CLUSTER_VAR: "1"}
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=True, dashboard_host="127.0.0.1",
             dashboard_port=port, runtime_env={"env_vars": env}, **kwargs)


def _connect(cfg: JobConfig) -> None:
    import ray

    if ray.is_initialized():
        env = (ray.get_runtime_context().runtime_env or {}).get("env_vars") or {}
        if not any(v in env for v in _STATE_API_VARS):
            print("ray_titan: warning: this Ray job's runtime env names no RAY_API_SERVER_ADDRESS or RAY_ADDRESS: "
                  "Ray Train's placement-group cleaner may ask another Ray cluster on the head node whether this "
                  "run is alive, and stop it (ray_titan.driver.init_local_cluster starts Ray safely)",
                  file=sys.stderr, flush=True)
        return
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "600")  # a loaded machine starts slowly
    address = os.environ.get("RAY_ADDRESS")
    if address:
        if re.fullmatch(r"[\w.\-]+:\d+", address):  # a GCS address (not ray://, auto or a dashboard URL)
            try:
                ray.init(address=address, log_to_driver=True, runtime_env={"env_vars": {"RAY_ADDRESS": address}})
                return
            except ValueError:  # `ray job submit --runtime-env` set RAY_ADDRESS itself: keep that one
                pass
        ray.init(address=address, log_to_driver=True)
        return
    init_local_cluster(cfg.ray.num_cpus or os.cpu_count() or 1, log_to_driver=True)


def _check_cluster(cfg: JobConfig) -> float:
    """CPUs to reserve per worker; raises :class:`ConfigError` if the connected cluster cannot
    hold the worker group (its start would otherwise wait forever)."""
    import ray

    from ray_titan.parallel.elastic import worker_range

    resources = ray.cluster_resources()
    n = worker_range(cfg)[0]  # an elastic run starts on what the cluster holds, at least min
    gpus, cluster_cpus = resources.get("GPU", 0), resources.get("CPU", 0)
    if cfg.ray.use_gpu and gpus < n:
        raise ConfigError(f"ray.use_gpu = true needs {n} GPUs (one per worker) but the cluster has {gpus:g}")
    # Default: fractions where the cluster has fewer cores than workers, never more than one each;
    # with Ray Data, one CPU left for its read tasks (they would wait forever on a full cluster).
    spare = 1.0 if cfg.data.source == "ray_data" and cluster_cpus > 1 else 0.0
    cpus = cfg.ray.cpus_per_worker or min(1.0, round((cluster_cpus - spare) / n, 3))
    if cpus * n > cluster_cpus + 1e-9:
        raise ConfigError(
            f"ray.cpus_per_worker = {cpus:g} × {n} workers = {cpus * n:g} CPUs, but the cluster "
            f"has {cluster_cpus:g}: the worker group could never start; use "
            f"ray.cpus_per_worker <= {cluster_cpus / n:.3g} (or leave it unset)"
        )
    return cpus


def _datasets(cfg: JobConfig, dataset: Any) -> dict[str, Any]:
    """``TorchTrainer``'s ``datasets`` and ``dataset_config`` for ``data.source = "ray_data"``:
    every worker gets an iterator over the whole dataset in its order (not Ray Train's split;
    ``ray_titan.data.ray_data``); empty otherwise. Raises :class:`ConfigError` for a dataset
    without the text column."""
    if cfg.data.source != "ray_data":
        return {}
    from ray.data import ExecutionOptions
    from ray.train import DataConfig

    from ray_titan.data.ray_data import DATASET_NAME, read_dataset

    if dataset is None:
        dataset = read_dataset(cfg.data)
    names = dataset.schema().names
    if cfg.data.text_column not in names:
        raise ConfigError(f"data.text_column = {cfg.data.text_column!r} is not a column of the dataset; "
                          f"its columns are {names}")
    return {"datasets": {DATASET_NAME: dataset},
            "dataset_config": DataConfig(datasets_to_split=[], execution_options=ExecutionOptions(preserve_order=True))}


def _deliver_checkpoint_reports(collector: Any, run_dir: str | Path) -> None:
    """Give the collector the latest checkpoint's unacknowledged reports (``reports/rank<r>.json``):
    a run stopped (Ctrl-C, SIGTERM, a failure) after a checkpoint but before its steps' reports
    reached the collector keeps them, so its metrics reach the checkpoint's step. Reports the
    collector already has are ignored by it; best effort (``finish`` records what is missing)."""
    import ray

    from ray_titan.checkpoint import find_latest, saved_reports

    if not isinstance(run_dir, Path):
        return
    latest = find_latest(run_dir / "checkpoints")
    if latest is None:
        return
    try:
        for reports in saved_reports(latest).values():
            if reports:
                ray.get(collector.report.remote(reports), timeout=30)
    except Exception as e:  # a dead collector, an unreadable file: the flushed metrics stand
        print(f"ray_titan: warning: could not deliver the reports of {latest}: {e}", file=sys.stderr, flush=True)


def _workers_text(cfg: JobConfig, counts: list[int]) -> str:
    """``"4 workers"``, or for an elastic run ``"2..4 workers (elastic; counts the mesh fits: 2, 4)"``."""
    if not isinstance(cfg.ray.num_workers, list):
        return f"{cfg.world_size} workers"
    return f"{counts[0]}..{counts[-1]} workers (elastic; counts the mesh fits: {', '.join(map(str, counts))})"


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
    entry, cpu_at_entry = time.time(), time.process_time()
    # First, so that the imports below (seconds of CPU on a busy machine) run at it too.
    set_process_niceness(loop_config["config"]["ray"]["worker_nice"])
    import psutil
    import ray.train
    import ray.train.torch
    import torch

    from ray_titan.checkpoint import RayTrainCheckpointStorage
    from ray_titan.fault import NonFiniteError
    from ray_titan.metrics.report import CollectorReporter, JsonlReporter, Reporter, rank_reports_path, reporting_target
    from ray_titan.metrics.timing import write_timings
    from ray_titan.parallel.elastic import mesh_for_workers
    from ray_titan.trainer import train_loop

    worker_start, cpu_at_start = time.time(), time.process_time()
    cfg = JobConfig.model_validate(loop_config["config"])
    context = ray.train.get_context()
    rank = context.get_world_rank()
    # An elastic run's mesh is sized for the workers Ray granted this attempt.
    granted = mesh_for_workers(cfg, context.get_world_size())
    if granted is None:
        raise RuntimeError(f"Ray Train granted {context.get_world_size()} workers, a count no mesh of this job fits")
    cfg = granted
    if loop_config["collector"] is None:  # metrics.enabled = false
        reporter = Reporter()
    else:
        reporter = CollectorReporter(
            reporting_target(loop_config["collector"], loop_config.get("aggregators"), rank,
                             cfg.metrics.ranks_per_aggregator),
            cfg.metrics.max_inflight_reports, cfg.metrics.max_buffered_reports,
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
            node=ray.get_runtime_context().get_node_id(),
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
    summary["marks"].update(process_start=psutil.Process().create_time(), train_fn_entry=entry,
                            worker_start=worker_start)
    # Where a worker's start-up CPU goes (the startup benchmark's split): Ray's worker and
    # Ray Train's set-up before the train function, then this function's imports.
    summary["cpu_s"] = {"before_train_fn": cpu_at_entry, "train_fn_imports": cpu_at_start - cpu_at_entry,
                        "total": time.process_time()}
    write_timings(loop_config["run_dir"], f"rank{rank}", summary)


def train(
    config: JobConfig | str | Path, overrides: list[str] | None = None, progress: str = "auto", *,
    callbacks: list | None = None, dataset: Any = None,
) -> RunResult:
    """Run a training job on Ray and return its :class:`RunResult`.

    ``config`` is a :class:`JobConfig` or the path of a TOML job config; ``overrides`` are
    dotted flags (``["--training.steps=50"]``). ``progress``: ``auto`` (a progress bar when
    stdout is a terminal, plain lines otherwise), ``bar`` or ``lines``. ``callbacks``:
    worker-side callback objects (``ray_titan.callbacks``), pickled to every worker and run after
    those of the config. ``dataset``: a ``ray.data.Dataset`` with a ``data.text_column`` column to
    train on (``data.source`` becomes ``"ray_data"``; ``ray_titan.data.ray_data``: every rank
    streams it in order, nothing is materialised here); ``data.source = "ray_data"`` with
    ``data.path`` reads one with Ray Data. Raises :class:`ConfigError` for an invalid job before
    any worker starts,
    :class:`~ray_titan.metrics.leak.MemoryLeakError` when a rank's memory grew and
    ``memory.on_leak = "stop"`` ended the run, and ``ray.train.TrainingFailedError`` if training
    fails otherwise (the metrics recorded until then stay in the run directory), ``NonFiniteError``
    when a non-finite loss stopped it, and :class:`Interrupted` (a ``KeyboardInterrupt``) after
    Ctrl-C or SIGTERM, which stop the workers and end the call within seconds (``SignalGuard``).
    """
    with SignalGuard(note="no run directory was made yet") as signals:
        try:
            return _train(config, overrides, progress, callbacks, signals, dataset)
        except KeyboardInterrupt as e:  # before the workers started, or a plain Ctrl-C
            if isinstance(e, Interrupted):
                raise
            signum = signals.signum or signal.SIGINT
            message = f"ray_titan: interrupted ({signal.Signals(signum).name}); {signals.note}"
            print(message, file=sys.stderr, flush=True)
            raise Interrupted(message, signum) from None


def _train(config: JobConfig | str | Path, overrides: list[str] | None, progress: str, callbacks: list | None,
           signals: SignalGuard, dataset: Any = None) -> RunResult:

    import ray
    from ray.train.torch import TorchConfig

    # Ray Train V2's classes (what ray.train exports at runtime), named so that mypy sees them too.
    from ray.train.v2.api.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ray_titan.allocator import worker_env_vars
    from ray_titan.checkpoint import find_latest, remove_staging
    from ray_titan.metrics.collector import MetricsCollector
    from ray_titan.metrics.leak import MemoryLeakError, leak_settings
    from ray_titan.metrics.report import create_aggregators
    from ray_titan.metrics.sinks import read_steps, wandb_settings
    from ray_titan.metrics.timing import read_timings, write_timings
    from ray_titan.parallel.elastic import fitting_worker_counts, is_elastic, mesh_for_workers
    from ray_titan.progress import ConsoleThread, check_mode, make_display
    from ray_titan.scaling import LeanTorchTrainer, MeshTorchTrainer
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
    if dataset is not None:
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"source": "ray_data", "path": None})})
    cfg = resolve_hf_job(resolve_paths(cfg))
    for warning in job_warnings(cfg):
        print(f"ray_titan: warning: {warning}", file=sys.stderr, flush=True)
    # Also materialises the built-in corpus, once, before workers read it.
    cfg = validate_job(cfg, has_dataset=dataset is not None)

    _connect(cfg)
    signals.rearm()  # ray.init sets its own SIGTERM handler
    datasets = _datasets(cfg, dataset)
    dims = parallel_dims(cfg)
    cpus = _check_cluster(cfg)
    marks["cluster_ready"] = time.time()
    if cfg.training.threads_per_worker is None:
        cfg = cfg.model_copy(update={"training": cfg.training.model_copy(
            update={"threads_per_worker": max(1, int(cpus + 0.999))})})
    run_dir = make_run_dir(cfg)
    signals.note = f"the metrics flushed so far are in {run_dir}"
    storage.write_text(under(run_dir, "config.json"), cfg.model_dump_json(indent=2))
    plan = record_memory_plan(cfg, run_dir)
    counts = fitting_worker_counts(cfg)
    # An elastic run's last-stage ranks depend on the mesh of each attempt's worker count.
    last_stage_ranks: list[int] | dict[int, list[int]] = dims.last_stage_ranks() if not is_elastic(cfg) else {
        n: parallel_dims(m).last_stage_ranks() for n in counts if (m := mesh_for_workers(cfg, n)) is not None}
    # Restarted by Ray if it dies; it resumes from its flushed parts and workers resend the rest.
    # No task events: each report call would be one more entry the GCS keeps (up to 100k) and
    # the dashboard lists, and their bookkeeping costs the GCS and the actor CPU every call.
    # Any: Ray types an actor handle's `method.remote()` only for @ray.method-decorated methods.
    # On the head node (the one whose loss ends the cluster anyway): a collector on a worker
    # node would die with that node, and with it reports the lost workers cannot resend.
    head = next((n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"]),
                ray.get_runtime_context().get_node_id())
    collector: Any = ray.remote(MetricsCollector).options(
        num_cpus=0, max_restarts=cfg.metrics.collector_max_restarts, enable_task_events=False,
        scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=True),
    ).remote(
        str(run_dir), dims.world_size, last_stage_ranks, cfg.training.steps,
        cfg.metrics.log_freq, cfg.metrics.flush_every_steps, cfg.metrics.enable_tensorboard,
        leak=leak_settings(cfg.memory), on_leak=cfg.memory.on_leak,
        kill_at_step=cfg.debug.kill_collector_at_step, nice=cfg.metrics.collector_nice, wandb=wandb_settings(cfg),
        series_max_ranks=cfg.metrics.series_max_ranks,
    ) if cfg.metrics.enabled else None
    aggregators = collector and create_aggregators(collector, max(counts), cfg.metrics.ranks_per_aggregator)
    # The run directory's last part; run_dir is a URI string (no .name) on remote storage.
    run_name = run_dir.name if isinstance(run_dir, Path) else run_dir.rstrip("/").rsplit("/", 1)[-1]
    print(
        f"ray_titan: run {run_name}: {_workers_text(cfg, counts)} ({dims.describe()}, {cpus} CPU each; "
        "ranks grouped by node, tp then dp_shard innermost: the layout line follows at step 1), "
        f"{cfg.model.name}/{cfg.model.flavor}, "
        f"{cfg.training.steps} steps; last stage on ranks {dims.last_stage_ranks()}; run dir {run_dir}",
        flush=True,
    )
    trainer = (partial(MeshTorchTrainer, counts=counts) if is_elastic(cfg) else LeanTorchTrainer)(
        _worker_entry,
        own_cluster=own_cluster(),
        train_loop_config={"config": cfg.model_dump(), "collector": collector, "aggregators": aggregators,
                           "run_dir": str(run_dir),
                           "callbacks": list(callbacks or [])},
        torch_config=TorchConfig(backend=process_group_backend(cfg.ray.use_gpu, cfg.memory.cpu_offload)),
        **datasets,
        scaling_config=ScalingConfig(
            num_workers=(counts[0], counts[-1]) if is_elastic(cfg) else dims.world_size,
            use_gpu=cfg.ray.use_gpu,
            resources_per_worker={"CPU": cpus, **({"GPU": 1} if cfg.ray.use_gpu else {})},
            elastic_resize_monitor_interval_s=cfg.ray.elastic_resize_interval_s,
        ),
        run_config=RunConfig(
            # Checkpoints land in <run_dir>/checkpoints/step-NNNNNNNN (ray_titan.checkpoint).
            name="checkpoints",
            storage_path=str(run_dir),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep_latest_k or None),
            # A worker group that cannot start fails the run at once instead of retrying forever.
            failure_config=FailureConfig(
                max_failures=cfg.ray.max_failures,
                # Elastic: a start may time out while lost capacity is still counted; retry it.
                controller_failure_limit=cfg.ray.max_failures if is_elastic(cfg) else 0),
            # The allocator is chosen at process start: preloaded into the workers only.
            worker_runtime_env={"env_vars": env} if (env := worker_env_vars(cfg.memory.allocator)) else None,
        ),
    )
    if collector is None:
        return _fit_without_metrics(trainer, cfg, run_dir, marks)
    poller = _Poller(collector)
    console = ConsoleThread(poller, make_display(cfg.training.steps, cast("Mode", progress)))
    console.start()
    failure: BaseException | None = None
    summary: dict[str, Any]
    marks["fit_called"] = time.time()
    try:
        trainer.fit()
    except BaseException as e:  # keep the metrics recorded so far, then re-raise
        failure = e
    finally:
        # Each step guarded: a full disk or a dead collector must not skip the rest (an escaping
        # error here once left the console thread polling, and it started a second Ray session).
        marks["fit_returned"] = time.time()
        console.stop_event.set()  # no poll may drain lines between here and the summary
        remove_staging(run_dir)  # what an interrupted save left; room for the metrics on a full disk
        if failure is not None:
            _remove_incomplete_checkpoints(run_dir)
            _deliver_checkpoint_reports(collector, run_dir)
        try:
            summary = ray.get(collector.finish.remote(poller.shown_step), timeout=120)
        except Exception as e:  # the flushed parts are on disk; never hide a training error
            summary = {"lines": [], "errors": [f"metrics collector failed to finish: {e}"], "final_loss": None}
        console.finish(summary)
        try:
            ray.kill(collector)
        except Exception:  # already gone
            pass
        try:
            write_timings(run_dir, "driver", {"marks": marks})
        except Exception as e:
            summary["errors"].append(f"timings: {e}")
    # Checkpoints of a remote run directory stay where Ray Train put them; only local ones are found.
    latest = find_latest(run_dir / "checkpoints") if isinstance(run_dir, Path) else None
    where = (f"last checkpoint {latest} (continue with --checkpoint.load_path={latest})"
             if latest else "no checkpoint was saved")
    if isinstance(failure, (KeyboardInterrupt, SystemExit)):
        # Ray Train's SIGINT handler (or ours for SIGTERM) aborted the worker group.
        name = signal.Signals(signals.signum or signal.SIGINT).name
        print(f"ray_titan: interrupted ({name}): workers stopped; metrics in {under(run_dir, 'metrics')}; {where}",
              file=sys.stderr, flush=True)
        raise Interrupted(str(where), signals.signum or signal.SIGINT) from None
    if failure is not None:
        for err in summary["errors"]:
            print(f"ray_titan: metrics error: {err}", file=sys.stderr)
        print(f"ray_titan: run failed; metrics so far in {under(run_dir, 'metrics')}; {where}", file=sys.stderr)
        if summary.get("stop"):
            raise MemoryLeakError(summary["stop"]) from failure
        raise failure
    if summary.get("stop_reason"):
        from ray_titan.fault import NonFiniteError

        print(f"ray_titan: run stopped; metrics in {under(run_dir, 'metrics')}; {where}", file=sys.stderr)
        raise NonFiniteError(summary["stop_reason"])
    final = summary["final_loss"]
    if final is not None and not math.isfinite(final):  # never a success (training.on_nonfinite = "skip")
        summary["errors"].append(f"the final loss (step {summary.get('last_step')}) is {final}, not finite")
    for err in summary["errors"]:
        print(f"ray_titan: metrics error: {err}", file=sys.stderr)
    result = RunResult(
        run_dir=run_dir, steps=read_steps(run_dir), final_loss=summary["final_loss"],
        errors=summary["errors"], config=cfg, checkpoint=latest,
        skipped_steps=summary.get("skipped_steps", 0), steps_run=summary.get("steps_run", 0),
        restarts=summary.get("restarts", 0),
        collector_restarted=summary.get("collector_restarted", False),
        memory_verdicts=summary.get("memory_verdicts", {}),
        memory_snapshots=sorted((run_dir / "memory").glob("*"))
        if isinstance(run_dir, Path) and (run_dir / "memory").is_dir() else [],
        timings=read_timings(run_dir),
        hf_export=save_last_hf(cfg, latest, run_dir),
        memory_plan=plan, memory_breakdown=summary.get("memory_breakdown", {}),
        profiler_traces=sorted((run_dir / "profile").glob("*.json"))
        if isinstance(run_dir, Path) and (run_dir / "profile").is_dir() else [],
    )
    say_outcome(result, where)
    return result


def say_outcome(result: RunResult, where: str) -> None:
    """Print a finished run's last line: ``ray_titan: done: final loss …`` (with ``(N of M updates
    skipped)`` when any was), or, on stderr, ``ray_titan: no update was applied: …`` for a run
    whose every update was skipped (``ray-titan train`` exits 1 for it). ``where``: the last
    checkpoint, in words."""
    if result.no_update_applied:
        print(f"ray_titan: no update was applied: {result.skipped_note} (training.on_nonfinite = 'skip' "
              f"dropped every one; the weights are those the run started from); final loss {result.final_loss}, "
              f"metrics {result.metrics_path}, {where}", file=sys.stderr, flush=True)
        return
    skipped = f" ({result.skipped_note})" if result.skipped_note else ""
    print(f"ray_titan: done: final loss {result.final_loss}{skipped}, metrics {result.metrics_path}, "
          f"{where}", flush=True)


class _Poller:
    """The console thread's call to the collector; remembers the newest step shown, so that a
    collector restarted by Ray does not show again the steps it re-assembles."""

    def __init__(self, collector: Any):
        self.collector, self.shown_step = collector, 0

    def __call__(self) -> dict[str, Any]:
        import ray

        if not ray.is_initialized():  # never let a late poll start a new local cluster
            raise RuntimeError("Ray is shut down")
        payload = ray.get(self.collector.poll.remote(self.shown_step), timeout=30)
        if payload.get("latest"):
            self.shown_step = max(self.shown_step, payload["latest"]["step"])
        return payload


def _remove_incomplete_checkpoints(run_dir: Path | str) -> None:
    """After a failed run: remove checkpoint directories newer than the latest complete one
    (a save cut short, by a full disk for one), so the space they hold goes to the metrics."""
    from ray_titan.checkpoint import find_latest

    if not isinstance(run_dir, Path) or not (run_dir / "checkpoints").is_dir():
        return
    latest = find_latest(run_dir / "checkpoints")
    for p in (run_dir / "checkpoints").glob("step-*"):
        if latest is None or p.name > latest.name:
            shutil.rmtree(p, ignore_errors=True)


def _fit_without_metrics(trainer, cfg: JobConfig, run_dir: Path | str, marks: dict[str, float]) -> RunResult:
    """``metrics.enabled = false``: run the worker group with no collector; only timings are kept."""
    from ray_titan.checkpoint import remove_staging
    from ray_titan.metrics.timing import read_timings, write_timings

    marks["fit_called"] = time.time()
    try:
        trainer.fit()
    finally:
        marks["fit_returned"] = time.time()
        remove_staging(run_dir)
        write_timings(run_dir, "driver", {"marks": marks})
    where = f"metrics.enabled = false: timings only in {under(run_dir, 'timings')}"
    stop = under(run_dir, STOP_REASON_FILE)
    if storage.exists(stop):
        from ray_titan.fault import NonFiniteError

        print(f"ray_titan: run stopped ({where})", file=sys.stderr, flush=True)
        raise NonFiniteError(storage.read_text(stop))
    print(f"ray_titan: done ({where})", flush=True)
    return RunResult(run_dir=run_dir, steps=pa.table({}), final_loss=None, config=cfg, timings=read_timings(run_dir))
