"""ray_titan: a distributed LLM trainer on Ray (PP × FSDP2) with a metrics collector that reports
the real last-stage loss and every rank's memory.

The driver API is :func:`train`; the per-worker loop is ``ray_titan.trainer.train_loop``;
:func:`memory_plan` predicts every rank's memory before a run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ray_titan.config import ConfigError, JobConfig, load_config

if TYPE_CHECKING:
    from pathlib import Path

    from ray_titan.driver import RunResult
    from ray_titan.preflight.memory_plan import MemoryPlan

__all__ = ["ConfigError", "JobConfig", "RunResult", "load_config", "memory_plan", "train"]
__version__ = "0.1.0"


def train(
    config: JobConfig | str | Path, overrides: list[str] | None = None, progress: str = "auto", *,
    callbacks: list | None = None, dataset: Any = None,
) -> RunResult:
    """Run a training job on Ray; see :func:`ray_titan.driver.train` (imported lazily, so that
    ``import ray_titan`` does not import Ray). ``progress``: ``auto``, ``bar`` or ``lines``.
    ``callbacks``: worker-side callback objects (``ray_titan.callbacks``) run on every worker.
    ``dataset``: a ``ray.data.Dataset`` with a text column to train on (``ray_titan.data.ray_data``)."""
    from ray_titan.driver import train as _train

    return _train(config, overrides, progress, callbacks=callbacks, dataset=dataset)


def memory_plan(
    config: JobConfig, device_memory: int | str | None = None, device: str | None = None,
    routing_imbalance: float = 1.0, vocab_size: int | None = None,
) -> MemoryPlan:
    """Every rank's predicted memory, whether the job fits ``device_memory`` and the levers that
    would make it fit, before anything starts; see :func:`ray_titan.preflight.memory_plan.memory_plan`
    (imported lazily: it imports torch)."""
    from ray_titan.preflight.memory_plan import memory_plan as _plan

    return _plan(config, device_memory, device, routing_imbalance, vocab_size)


def __getattr__(name: str):
    if name == "RunResult":
        from ray_titan.driver import RunResult

        return RunResult
    raise AttributeError(name)
