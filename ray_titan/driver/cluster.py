"""The Ray cluster a run uses: join the one named by ``RAY_ADDRESS`` (or the one this process is
connected to), or start a local one sized for the job; check that it can hold the worker group.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from ray_titan.config.schema import ConfigError, JobConfig

__all__ = ["connect", "cpus_per_worker", "init_local_cluster", "own_cluster"]


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
    coordinator (:class:`ray_titan.driver.torch_trainer.LeanTorchTrainer`)."""
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


def connect(cfg: JobConfig) -> None:
    """Join the Ray cluster this process is connected to, or the one ``RAY_ADDRESS`` names, or
    start a local one sized by ``ray.num_cpus`` (:func:`init_local_cluster`)."""
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


def cpus_per_worker(cfg: JobConfig) -> float:
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
