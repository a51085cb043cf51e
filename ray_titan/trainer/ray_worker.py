"""The worker side of a Ray run: the function Ray Train runs on every worker.

:func:`worker_entry` is ``TorchTrainer``'s ``train_loop_per_worker``: it lowers the worker's
niceness, takes the config the driver made for the number of workers Ray granted (an elastic
attempt's mesh), reports to the driver's metrics collector and runs :func:`ray_titan.trainer.train_loop`.
A non-finite loss ends the run on every rank without a restart (rank 0 tells the driver why).
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from typing import Any

from ray_titan import storage
from ray_titan.config.schema import JobConfig
from ray_titan.run_dir import STOP_REASON_FILE, under

__all__ = ["set_process_niceness", "worker_entry"]


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


def worker_entry(loop_config: dict[str, Any]) -> None:
    """Ray Train's ``train_loop_per_worker``: take the config of the worker count Ray granted
    (``loop_config["configs"]``, validated and rewritten by the driver before any worker started:
    :func:`ray_titan.preflight.prepare.worker_configs`), report to the collector."""
    entry, cpu_at_entry = time.time(), time.process_time()
    configs: dict[int, JobConfig] = loop_config["configs"]
    # First, so that the imports below (seconds of CPU on a busy machine) run at it too.
    set_process_niceness(next(iter(configs.values())).ray.worker_nice)
    import psutil
    import ray.train
    import ray.train.torch
    import torch

    from ray_titan.checkpoint import RayTrainCheckpointStorage
    from ray_titan.metrics.worker.report import (
        CollectorReporter,
        JsonlReporter,
        Reporter,
        rank_reports_path,
        reporting_target,
    )
    from ray_titan.metrics.worker.timing import write_timings
    from ray_titan.trainer import train_loop
    from ray_titan.trainer.nonfinite import NonFiniteError

    worker_start, cpu_at_start = time.time(), time.process_time()
    context = ray.train.get_context()
    rank = context.get_world_rank()
    # An elastic run's mesh is sized for the workers Ray granted this attempt.
    if context.get_world_size() not in configs:
        raise RuntimeError(f"Ray Train granted {context.get_world_size()} workers, a count no mesh of this job fits")
    cfg = configs[context.get_world_size()]
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
