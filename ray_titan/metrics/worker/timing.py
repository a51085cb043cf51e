"""Run timings: start-up marks and steady-state throughput, recorded whether or not the
metrics collector is on.

Each rank writes one small JSON file at the end of its train loop, ``<run_dir>/timings/rank{r}.json``,
and the driver writes ``<run_dir>/timings/driver.json``. Marks are Unix times (seconds), so
marks of different processes on one machine compare directly:

===================  ========  ==============================================================
mark                 written   when
===================  ========  ==============================================================
train_called         driver    ``ray_titan.train`` entered
cluster_ready        driver    Ray cluster joined or started, resources checked
fit_called           driver    collector created, ``TorchTrainer.fit`` about to run
fit_returned         driver    the worker group finished
process_start        rank      the Ray worker process was created
train_fn_entry       rank      the train function entered (process group up), before its imports
worker_start         rank      the train function's imports done
loop_start           rank      ``train_loop`` entered
data_ready           rank      tokenizer and corpus loaded, loader built
model_built          rank      stages built, parallelized, initialised; optimizer built
step1_end            rank      first optimizer step done
last_step_end        rank      last optimizer step done
===================  ========  ==============================================================

Throughput is measured without the first :data:`WARMUP_STEPS` steps (allocator and
first-collective warm-up): ``steady_steps`` steps took ``steady_time_s`` seconds
(``time.perf_counter``), each with ``tokens_per_step`` label tokens on this rank.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

__all__ = ["WARMUP_STEPS", "StepClock", "read_timings", "timings_dir", "write_timings"]

WARMUP_STEPS = 2


class StepClock:
    """Marks and steady-state timing of one rank's loop. Holds a fixed number of floats, so a
    long run does not grow it."""

    def __init__(self, total_steps: int):
        self.total_steps = total_steps
        self.marks: dict[str, float] = {}
        self._steady_start: float | None = None
        self._last: float | None = None
        self.warmup = WARMUP_STEPS if total_steps > WARMUP_STEPS else 0
        if self.warmup == 0:
            self._steady_start = time.perf_counter()

    def mark(self, name: str) -> None:
        """Record the Unix time now as ``name``."""
        self.marks[name] = time.time()

    def step_end(self, step: int) -> None:
        """Call at the end of optimizer step ``step`` (1-based)."""
        now = time.perf_counter()
        if step == 1:
            self.mark("step1_end")
        if step == self.warmup:
            self._steady_start = now
        self._last = now

    def summary(self) -> dict[str, Any]:
        """``{"marks", "steady_steps", "steady_time_s"}`` (``last_step_end`` added to marks)."""
        self.mark("last_step_end")
        if self._last is not None and self._steady_start is not None:
            steady_steps, steady_time_s = self.total_steps - self.warmup, self._last - self._steady_start
        else:
            steady_steps, steady_time_s = 0, 0.0
        return {"marks": dict(self.marks), "steady_steps": steady_steps, "steady_time_s": steady_time_s}


def timings_dir(run_dir: str | Path) -> Path:
    """``<run_dir>/timings``."""
    return Path(run_dir) / "timings"


def write_timings(run_dir: str | Path, name: str, data: dict[str, Any]) -> str:
    """Write ``data`` as ``<run_dir>/timings/<name>.json`` (``name``: ``rank{r}`` or ``driver``);
    ``run_dir`` may be a storage URI (``ray_titan.storage``). Returns where it went."""
    from ray_titan import storage

    storage.makedirs(storage.join(run_dir, "timings"))
    path = storage.join(run_dir, "timings", f"{name}.json")
    storage.write_text(path, json.dumps(data, indent=1))
    return path


def read_timings(run_dir: str | Path) -> dict[str, dict[str, Any]]:
    """Every timings file of a run, keyed by name (``driver``, ``rank0``, ...)."""
    from ray_titan import storage

    if storage.is_remote(run_dir):
        return {}  # read them from the bucket when needed; the driver does not list it
    return {p.stem: json.loads(p.read_text()) for p in sorted(timings_dir(run_dir).glob("*.json"))}
