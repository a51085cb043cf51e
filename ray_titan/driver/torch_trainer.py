"""Ray Train's elastic scaling, restricted to worker counts the mesh fits.

Ray Train V2 grows and shrinks a worker group between ``ScalingConfig(num_workers=(min, max))``
(its ``ElasticScalingPolicy``: at a (re)start, and every ``elastic_resize_monitor_interval_s``
while running, it counts the workers the cluster's resources hold). A pipeline of ``pp`` stages
cannot run on any count: :class:`MeshScalingPolicy` is Ray's policy with that count rounded down
to the largest one a mesh fits (:func:`ray_titan.parallel.elastic.fitting_worker_counts`);
below ``min`` Ray waits for capacity, as it does for any elastic run. :class:`MeshTorchTrainer`
is Ray's ``TorchTrainer`` with that policy. Both use Ray Train V2's internal policy interface
(Ray 2.5x); nothing else of Ray's behaviour changes.

:class:`LeanTorchTrainer`, the base of every ray_titan run, leaves out what a run does not use,
each an actor process that imports Ray Train or Ray Data (~2-4 CPU-seconds) while the workers start,
on machines where start-up is CPU-bound (measured: ``python -m benchmarks.run startup``):

- Ray Train's Ray Data callback, when the run has no Ray Dataset: Ray 2.60 starts it regardless,
  with two idle actors (a ``DatasetManager`` and Ray Data's autoscaling coordinator).
- On the one-machine cluster ray_titan starts itself (``own_cluster``, see
  :func:`ray_titan.driver.init_local_cluster`), for a fixed-size run: the placement-group cleaner
  (a detached actor that removes the run's placement group if the controller dies while the
  driver lives; that cluster ends with the driver) and the requests to Ray's autoscaling
  coordinator (a cluster without an autoscaler grants nothing; :class:`LocalScalingPolicy`). The
  coordinator's start was also on the critical path (~2 s between the controller's start and the
  worker group's). On any other cluster both stay: there a controller can die alone and an
  autoscaler may add nodes.
"""

from __future__ import annotations

import bisect
from typing import Any

import ray
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy, FixedScalingPolicy
from ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client import (
    AUTOSCALING_REQUESTS_GET_TIMEOUT_S,
)
from ray.train.v2._internal.util import time_monotonic
from ray.train.v2.api.callback import UserCallback
from ray.train.v2.torch.torch_trainer import TorchTrainer

__all__ = ["CheckpointLine", "LeanTorchTrainer", "LocalScalingPolicy", "MeshScalingPolicy", "MeshTorchTrainer"]


class CheckpointLine(UserCallback):
    """One console line per checkpoint, from Ray Train's controller once every rank has reported
    it: ``ray_titan: checkpoint step-NNNNNNNN saved: <path>``. Ray Train's own lines of a save
    ("Checkpoint successfully created at", "Reporting training result") come from every worker
    (four copies on the main job); the workers keep them off the console
    (:func:`ray_titan.checkpoint.staging.quiet_ray_train_checkpoint_logs`)."""

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        if checkpoint is not None:
            print(f"ray_titan: checkpoint {checkpoint.path.rstrip('/').rsplit('/', 1)[-1]} saved: {checkpoint.path}",
                  flush=True)


class LocalScalingPolicy(FixedScalingPolicy):
    """Ray's fixed-size policy without the autoscaling coordinator: no requests for resources
    (Ray's policy sends them so that an autoscaler adds nodes), so no coordinator actor. For a
    cluster without an autoscaler; the decisions are Ray's."""

    def after_controller_start(self, train_run_context: Any) -> None:
        pass

    def _maybe_send_resource_request(self) -> None:
        pass


class MeshScalingPolicy(ElasticScalingPolicy):
    """Ray Train's elastic policy granting only ``counts`` (increasing worker counts that fit the
    mesh): the count the cluster holds is rounded down to one of them (to 0, so Ray waits, below
    the smallest)."""

    # Ray's base sets these; declared so that type-checking without Ray installed (the base is
    # then Any) still knows them.
    _latest_reserved_resources: Any
    _latest_reserved_resources_query_time: float

    def __init__(self, scaling_config: Any, counts: list[int]):
        super().__init__(scaling_config)
        self.counts = sorted(counts)

    def _get_reserved_resources(self) -> Any:
        # Ray's coordinator refreshes its view of the nodes every 20 s: a restart right after a
        # node died would ask for the dead node's workers and wait out the start timeout.
        # Recompute against live nodes (what the coordinator offers callers that pin to nodes).
        now = time_monotonic()
        if now - self._latest_reserved_resources_query_time < self.GET_RESERVED_RESOURCES_INTERVAL_S:
            return self._latest_reserved_resources
        try:
            self._latest_reserved_resources = ray.get(
                self._autoscaling_coordinator.get_reserved_resources.remote(self._requester_id, recompute=True),
                timeout=AUTOSCALING_REQUESTS_GET_TIMEOUT_S,
            )
        except Exception:  # as Ray's policy: no decision this time, ask again at the next one
            self._latest_reserved_resources = None
        self._latest_reserved_resources_query_time = time_monotonic()
        return self._latest_reserved_resources

    def _count_possible_workers(self, reserved_resources: Any) -> int:
        n = super()._count_possible_workers(reserved_resources)
        i = bisect.bisect_right(self.counts, n)
        return self.counts[i - 1] if i else 0


class LeanTorchTrainer(TorchTrainer):
    """Ray's ``TorchTrainer`` without its Ray Data callback when ``datasets`` is empty, and on a
    cluster ray_titan started itself (``own_cluster=True``) without the placement-group cleaner
    and the autoscaling coordinator (module docstring). Overrides Ray Train V2's internal
    ``_create_default_callbacks`` and ``_initialize_and_run_controller``."""

    def __init__(self, *args: Any, own_cluster: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._own_cluster = own_cluster

    def _create_default_callbacks(self) -> list[Any]:
        drop: tuple[type, ...] = () if self.datasets else (DatasetsCallback,)
        if self._own_cluster:
            drop += (PlacementGroupCleanerCallback,)
        return [c for c in super()._create_default_callbacks() if not isinstance(c, drop)]

    def _initialize_and_run_controller(self, **controller_init_kwargs: Any) -> Any:
        # Any: mypy resolves the attribute to Ray Train V1's ScalingConfig; at runtime it is V2's.
        scaling: Any = self.scaling_config
        if self._own_cluster and not scaling.elasticity_enabled:
            controller_init_kwargs["scaling_policy"] = LocalScalingPolicy(scaling)
        return super()._initialize_and_run_controller(**controller_init_kwargs)


class MeshTorchTrainer(LeanTorchTrainer):
    """``TorchTrainer`` whose elastic worker counts are ``counts`` (:class:`MeshScalingPolicy`)."""

    def __init__(self, *args: Any, counts: list[int], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._mesh_counts = counts

    def _initialize_and_run_controller(self, **controller_init_kwargs: Any) -> Any:
        controller_init_kwargs["scaling_policy"] = MeshScalingPolicy(self.scaling_config, self._mesh_counts)
        return super()._initialize_and_run_controller(**controller_init_kwargs)
