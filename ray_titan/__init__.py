"""ray_titan: a distributed LLM trainer on Ray (PP × FSDP2) with a metrics collector that reports
the real last-stage loss and every rank's memory.

The driver API is :func:`train`; the per-worker loop is ``ray_titan.trainer.train_loop``;
:func:`memory_plan` predicts every rank's memory before a run.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import TYPE_CHECKING, Any

from ray_titan.config import ConfigError, JobConfig, load_config

if TYPE_CHECKING:
    from pathlib import Path

    from ray_titan.driver import RunResult
    from ray_titan.memory_planner import MemoryPlan

# Modules that moved (issues 28, 40): importing an old name fails with a message naming the new one.
_MOVED = {"ray_titan.progress": "ray_titan.driver.progress", "ray_titan.interrupts": "ray_titan.driver.signals",
          "ray_titan.scaling": "ray_titan.driver.torch_trainer", "ray_titan.gc": "ray_titan.trainer.gc_schedule",
          "ray_titan.run_report": "ray_titan.run_summary", "ray_titan.hf": "ray_titan.checkpoint.huggingface",
          # issue 40: the worker-only helpers went under the trainer
          "ray_titan.gc_schedule": "ray_titan.trainer.gc_schedule", "ray_titan.fault": "ray_titan.trainer.nonfinite",
          **{f"ray_titan.models.{f}.hf": f"ray_titan.models.{f}.state_dict_adapter"
             for f in ("llama", "qwen3", "deepseek_v2", "deepseek_v3", "qwen3_moe", "gpt_oss")}}


class _MovedModules(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path`` (an editable install's finder could otherwise find a stale copy);
    answers only the old names, so every other import goes on to the usual finders."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname in _MOVED:
            raise ModuleNotFoundError(f"{fullname} is now {_MOVED[fullname]}", name=fullname)


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())

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
    would make it fit, before anything starts; see :func:`ray_titan.memory_planner.memory_plan`
    (imported lazily: it imports torch)."""
    from ray_titan.memory_planner import memory_plan as _plan

    return _plan(config, device_memory, device, routing_imbalance, vocab_size)


def __getattr__(name: str):
    if name == "RunResult":
        from ray_titan.driver import RunResult

        return RunResult
    raise AttributeError(name)
