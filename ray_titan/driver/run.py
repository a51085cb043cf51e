"""The Ray driver's run, top to bottom (:func:`train`).

:func:`train` prepares the job and its memory plan before anything starts
(:func:`ray_titan.preflight.prepare.prepare_job`), joins the Ray cluster named by ``RAY_ADDRESS`` (or the one
this process is already connected to, or starts a local one sized for the job; :mod:`.cluster`),
makes the run directory and writes the plan into it, starts the metrics collector actor
(:mod:`.collector_actor`), runs the train loop on
``pp × dp_replicate × dp_shard × tp`` Ray Train workers (:mod:`.torch_trainer`, each running
:func:`ray_titan.trainer.ray_worker.worker_entry`), shows the run's progress (a bar on a terminal,
the collector's console lines otherwise; :mod:`.progress`), reads the collector's summary as a
:class:`~ray_titan.metrics.outcome.RunOutcome` and raises what stopped the run or returns its
:class:`~ray_titan.driver.result.RunResult`. The run directory may be a local path or a URI
(:mod:`ray_titan.storage`).

Fault tolerance: Ray Train restarts a failed worker group up to ``ray.max_failures`` times and
the restarted group resumes from the latest checkpoint (``<run_dir>/checkpoints``, kept by Ray's
``CheckpointConfig``); Ray restarts a killed collector up to ``metrics.collector_max_restarts``
times. Ctrl-C (SIGINT) makes Ray Train abort the worker group; the driver then flushes the
metrics and says where the last checkpoint is.
"""

from __future__ import annotations

import shutil
import signal
import sys
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pyarrow as pa

from ray_titan import storage
from ray_titan.checkpoint import save_last_hf
from ray_titan.config.schema import ConfigError, JobConfig
from ray_titan.driver.cluster import connect, cpus_per_worker, init_local_cluster, own_cluster
from ray_titan.driver.collector_actor import (
    Poller,
    deliver_checkpoint_reports,
    end_collector,
    finish_collector,
    start_aggregators,
    start_collector,
)
from ray_titan.driver.result import RunResult, say_outcome
from ray_titan.driver.signals import Interrupted, SignalGuard
from ray_titan.metrics.outcome import RunOutcome
from ray_titan.parallel.dims import process_group_backend
from ray_titan.preflight.prepare import on_cluster, prepare_job, worker_configs
from ray_titan.run_dir import STOP_REASON_FILE, make_run_dir, under

if TYPE_CHECKING:
    from ray_titan.driver.progress import Mode

__all__ = ["Interrupted", "RunResult", "init_local_cluster", "say_outcome", "train"]


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


def _workers_text(cfg: JobConfig, counts: list[int]) -> str:
    """``"4 workers"``, or for an elastic run ``"2..4 workers (elastic; counts the mesh fits: 2, 4)"``."""
    if not isinstance(cfg.ray.num_workers, list):
        return f"{cfg.world_size} workers"
    return f"{counts[0]}..{counts[-1]} workers (elastic; counts the mesh fits: {', '.join(map(str, counts))})"


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
    :class:`~ray_titan.metrics.outcome.MemoryLeakError` when a rank's memory grew and
    ``memory.on_leak = "stop"`` ended the run, and ``ray.train.TrainingFailedError`` if training
    fails otherwise (the metrics recorded until then stay in the run directory), ``NonFiniteError``
    when a non-finite loss stopped it, and :class:`Interrupted` (a ``KeyboardInterrupt``) after
    Ctrl-C, SIGTERM or SIGHUP, which stop the workers and end the call within seconds (``SignalGuard``).
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
    """:func:`train`'s run, top to bottom: prepare the job (and its memory plan), join the cluster,
    make the run directory and write the plan into it, start the collector and the worker group,
    wait for it, and read the outcome."""
    from ray_titan.driver.progress import check_mode

    check_mode(progress)
    marks = {"train_called": time.time()}
    job = prepare_job(config, overrides, dataset=dataset is not None)  # resolve, validate, plan
    cfg = job.config

    connect(cfg)
    signals.rearm()  # ray.init sets its own SIGTERM handler
    datasets = _datasets(cfg, dataset)
    cpus = cpus_per_worker(cfg)
    marks["cluster_ready"] = time.time()
    cfg = on_cluster(cfg, cpus)
    run_dir = make_run_dir(cfg)
    signals.note = f"the metrics flushed so far are in {run_dir}"
    storage.write_text(under(run_dir, "config.json"), cfg.model_dump_json(indent=2))
    plan = job.record_plan(run_dir)
    configs = worker_configs(cfg)  # what each worker trains with, by the workers Ray grants
    counts = sorted(configs)
    collector = start_collector(cfg, run_dir, counts)
    aggregators = start_aggregators(cfg, collector, counts)
    _say_start(cfg, run_dir, counts, cpus)
    trainer = _ray_trainer(cfg, run_dir, configs, cpus, (collector, aggregators), callbacks, datasets)
    if collector is None:
        return _fit_without_metrics(trainer, cfg, run_dir, marks)
    failure, outcome = _fit(trainer, collector, cfg, run_dir, progress, marks)
    latest = _latest_checkpoint(run_dir)
    where = (f"last checkpoint {latest} (continue with --checkpoint.load_path={latest})"
             if latest else "no checkpoint was saved")
    _raise_if_stopped(failure, outcome, signals, run_dir, where)
    result = _result(cfg, run_dir, outcome, latest, plan)
    say_outcome(result, where)
    return result


def _say_start(cfg: JobConfig, run_dir: Path | str, counts: list[int], cpus: float) -> None:
    """The run's first line: its name, workers, mesh, model, steps, last stage and run directory."""
    from ray_titan.trainer.build import parallel_dims

    dims = parallel_dims(cfg)
    # The run directory's last part; run_dir is a URI string (no .name) on remote storage.
    run_name = run_dir.name if isinstance(run_dir, Path) else run_dir.rstrip("/").rsplit("/", 1)[-1]
    print(
        f"ray_titan: run {run_name}: {_workers_text(cfg, counts)} ({dims.describe()}, {cpus} CPU each; "
        "ranks grouped by node, tp then dp_shard innermost: the layout line follows at step 1), "
        f"{cfg.model.name}/{cfg.model.flavor}, "
        f"{cfg.training.steps} steps; last stage on ranks {dims.last_stage_ranks()}; run dir {run_dir}",
        flush=True,
    )


def _ray_trainer(cfg: JobConfig, run_dir: Path | str, configs: dict[int, JobConfig], cpus: float,
                 metrics: tuple[Any, list | None], callbacks: list | None, datasets: dict[str, Any]) -> Any:
    """Ray Train's trainer of the run: one worker per rank (the range of ``configs``' worker counts
    for an elastic run), each running :func:`ray_titan.trainer.ray_worker.worker_entry` with the
    config of its worker count (:func:`ray_titan.preflight.prepare.worker_configs`); ``metrics``: the
    collector and the metrics aggregators (None: the ranks call the collector)."""
    from ray.train.torch import TorchConfig

    # Ray Train V2's classes (what ray.train exports at runtime), named so that mypy sees them too.
    from ray.train.v2.api.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

    from ray_titan.allocator import worker_env_vars
    from ray_titan.driver.torch_trainer import CheckpointLine, LeanTorchTrainer, MeshTorchTrainer
    from ray_titan.parallel.elastic import is_elastic
    from ray_titan.trainer.ray_worker import worker_entry

    elastic, counts = is_elastic(cfg), sorted(configs)
    return (partial(MeshTorchTrainer, counts=counts) if elastic else LeanTorchTrainer)(
        worker_entry,
        own_cluster=own_cluster(),
        train_loop_config={"configs": configs, "collector": metrics[0], "aggregators": metrics[1],
                           "run_dir": str(run_dir), "callbacks": list(callbacks or [])},
        torch_config=TorchConfig(backend=process_group_backend(cfg.ray.use_gpu, cfg.memory.cpu_offload)),
        **datasets,
        scaling_config=ScalingConfig(
            num_workers=(counts[0], counts[-1]) if elastic else cfg.world_size,
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
                controller_failure_limit=cfg.ray.max_failures if elastic else 0),
            callbacks=[CheckpointLine()],
            # The allocator is chosen at process start: preloaded into the workers only.
            worker_runtime_env={"env_vars": env} if (env := worker_env_vars(cfg.memory.allocator)) else None,
        ),
    )


def _fit(trainer: Any, collector: Any, cfg: JobConfig, run_dir: Path | str, progress: str,
         marks: dict[str, float]) -> tuple[BaseException | None, RunOutcome]:
    """Run the worker group while the console shows the collector's lines; whatever ends it (a
    failure, Ctrl-C), keep the metrics: the error it raised (None if none) and the run's outcome."""
    from ray_titan.checkpoint import remove_staging
    from ray_titan.driver.progress import ConsoleThread, make_display
    from ray_titan.metrics.worker.timing import write_timings

    poller = Poller(collector)
    console = ConsoleThread(poller, make_display(cfg.training.steps, cast("Mode", progress)))
    console.start()
    failure: BaseException | None = None
    marks["fit_called"] = time.time()
    try:
        trainer.fit()
    except BaseException as e:  # keep the metrics recorded so far; the caller re-raises
        failure = e
    # Each step guarded: a full disk or a dead collector must not skip the rest (an escaping
    # error here once left the console thread polling, and it started a second Ray session).
    marks["fit_returned"] = time.time()
    console.stop_event.set()  # no poll may drain lines between here and the summary
    remove_staging(run_dir)  # what an interrupted save left; room for the metrics on a full disk
    if failure is not None:
        _remove_incomplete_checkpoints(run_dir)
        deliver_checkpoint_reports(collector, run_dir)
    outcome = finish_collector(collector, poller.shown_step)
    console.finish(outcome.console_payload())
    end_collector(collector)
    try:
        write_timings(run_dir, "driver", {"marks": marks})
    except Exception as e:
        outcome.errors.append(f"timings: {e}")
    return failure, outcome


def _latest_checkpoint(run_dir: Path | str) -> Path | None:
    """The run's latest complete checkpoint; checkpoints of a remote run directory stay where Ray
    Train put them, so only local ones are found."""
    from ray_titan.checkpoint import find_latest

    return find_latest(run_dir / "checkpoints") if isinstance(run_dir, Path) else None


def _raise_if_stopped(failure: BaseException | None, outcome: RunOutcome, signals: SignalGuard,
                      run_dir: Path | str, where: str) -> None:
    """Raise what ended a run that did not finish: :class:`Interrupted` after Ctrl-C or SIGTERM,
    :class:`~ray_titan.metrics.outcome.MemoryLeakError` when the leak policy stopped a failed run,
    the failure itself otherwise, and ``NonFiniteError`` when a non-finite loss stopped it; each
    after saying where the metrics and the last checkpoint (``where``) are."""
    metrics = under(run_dir, "metrics")
    if isinstance(failure, (KeyboardInterrupt, SystemExit)):
        # Ray Train's SIGINT handler (or ours for SIGTERM, SIGHUP) aborted the worker group.
        name = signal.Signals(signals.signum or signal.SIGINT).name
        print(f"ray_titan: interrupted ({name}): workers stopped; metrics in {metrics}; {where}",
              file=sys.stderr, flush=True)
        raise Interrupted(str(where), signals.signum or signal.SIGINT) from None
    if failure is not None:
        from ray_titan.metrics.outcome import MemoryLeakError

        for err in outcome.errors:
            print(f"ray_titan: metrics error: {err}", file=sys.stderr)
        print(f"ray_titan: run failed; metrics so far in {metrics}; {where}", file=sys.stderr)
        if outcome.memory_leak:
            raise MemoryLeakError(outcome.memory_leak) from failure
        raise failure
    if outcome.nonfinite_loss:
        from ray_titan.trainer.nonfinite import NonFiniteError

        print(f"ray_titan: run stopped; metrics in {metrics}; {where}", file=sys.stderr)
        raise NonFiniteError(outcome.nonfinite_loss)


def _result(cfg: JobConfig, run_dir: Path | str, outcome: RunOutcome, latest: Path | None,
            plan: dict[str, Any] | None) -> RunResult:
    """The :class:`RunResult` of a finished run, its metrics errors printed (a non-finite final
    loss, never a success under ``training.on_nonfinite = "skip"``, is one); exports the last
    checkpoint to Hugging Face when ``checkpoint.last_save_hf`` asks."""
    from ray_titan.metrics.worker.timing import read_timings

    if not outcome.final_loss_is_finite:
        outcome.errors.append(f"the final loss (step {outcome.last_step}) is {outcome.final_loss}, not finite")
    for err in outcome.errors:
        print(f"ray_titan: metrics error: {err}", file=sys.stderr)
    local = run_dir if isinstance(run_dir, Path) else None
    return RunResult(
        run_dir=run_dir, steps=None, final_loss=outcome.final_loss,
        errors=outcome.errors, config=cfg, checkpoint=latest,
        skipped_steps=outcome.skipped_steps, steps_run=outcome.steps_run, restarts=outcome.restarts,
        collector_restarted=outcome.collector_restarted, memory_verdicts=outcome.memory_verdicts,
        memory_snapshots=sorted((local / "memory").glob("*")) if local and (local / "memory").is_dir() else [],
        timings=read_timings(run_dir),
        hf_export=save_last_hf(cfg, latest, run_dir),
        memory_plan=plan, memory_breakdown=outcome.memory_breakdown,
        profiler_traces=sorted((local / "profile").glob("*.json")) if local and (local / "profile").is_dir() else [],
    )


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
    from ray_titan.metrics.worker.timing import read_timings, write_timings

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
        from ray_titan.trainer.nonfinite import NonFiniteError

        print(f"ray_titan: run stopped ({where})", file=sys.stderr, flush=True)
        raise NonFiniteError(storage.read_text(stop))
    print(f"ray_titan: done ({where})", flush=True)
    return RunResult(run_dir=run_dir, steps=pa.table({}), final_loss=None, config=cfg, timings=read_timings(run_dir))
