"""What a Ray run returns: :class:`RunResult`, and the driver's last line about it."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from ray_titan.config.schema import JobConfig
from ray_titan.run_dir import under

__all__ = ["RunResult", "say_outcome"]


class _StepsOnDisk:
    """The ``steps`` field of :class:`RunResult`: a table given to it, or, given None, the run's
    ``metrics/steps.parquet`` read on first access only. A 16,384-rank run of 10k steps has 164M
    rows (tens of GB in Arrow): the driver reads none of them unless asked, and
    :meth:`RunResult.losses` reads rank 0's row group alone."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr = "_" + name

    def __get__(self, obj: Any, objtype: type | None = None) -> pa.Table:
        if obj is None:  # the dataclass asking for a default: there is none
            raise AttributeError(self.attr)
        if obj.__dict__.get(self.attr) is None:
            from ray_titan.metrics.reading.steps import read_steps

            obj.__dict__[self.attr] = read_steps(obj.run_dir)
        return obj.__dict__[self.attr]

    def __set__(self, obj: Any, value: pa.Table | None) -> None:
        obj.__dict__[self.attr] = value


@dataclass(repr=False, eq=False)
class RunResult:
    """What a run produced.

    ``steps``: the per-step, per-rank metrics (``metrics/steps.parquet``; schema
    ``ray_titan.metrics.schema.STEP_SCHEMA``), read from the run directory on first access when
    given None (``ray_titan.metrics.reading.steps.read_rank_history`` reads one rank's alone).
    ``final_loss``: the last step's loss (token-weighted
    mean over the last pipeline stage's DP ranks, nats per token). ``errors``: steps the
    collector could not assemble or reports it found wrong (empty for a healthy run).
    ``run_dir``: a local :class:`~pathlib.Path`, or the URI string of a remote run directory.
    ``memory_verdicts``: every rank's last memory verdict, ``{rank: {"verdict", "slope_mib_per_step",
    "oom_step", "source", "coords"}}`` (``ray_titan.metrics.collector.leak``); the verdict of every step is
    in ``steps``. ``memory_snapshots``: the files under ``<run_dir>/memory/``.
    """

    run_dir: Path | str
    steps: _StepsOnDisk = _StepsOnDisk()  # required: the descriptor gives no default
    final_loss: float | None  # type: ignore[misc]  # (mypy takes ``steps``' descriptor for a default)
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
    ``ray_titan.metrics.worker.timing``): start-up marks and steady-state step timing."""
    hf_export: Path | None = None
    """The Hugging Face model directory ``checkpoint.last_save_hf`` wrote (``<run_dir>/hf``)."""
    memory_plan: dict[str, Any] | None = None
    """The memory plan made before the workers started (``ray_titan.preflight.memory_plan``,
    ``MemoryPlan.to_dict()``; also ``<run_dir>/memory_plan.json``), None if it could not be made."""
    memory_breakdown: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Every rank's memory measured at ``memory.breakdown_step``, by category at the step's peak
    (``ray_titan.metrics.worker.profiling.StepProfiler.stop``): ``{rank: {"step", "peak_bytes",
    "at_peak": {category: bytes}, "category_peaks", ...}}``."""
    profiler_traces: list[Path] = field(default_factory=list)
    """Chrome traces of ``profiling.trace_steps``: ``<run_dir>/profile/rank{r}-step{s}.json``."""

    def __repr__(self) -> str:  # not the steps table: it may be 164M rows on disk
        return (f"RunResult(run_dir={str(self.run_dir)!r}, final_loss={self.final_loss}, "
                f"steps_run={self.steps_run}, errors={len(self.errors)}, checkpoint={self.checkpoint})")

    def memory_peaks(self) -> dict[int, tuple[int | None, int | None]]:
        """``{rank: (predicted peak bytes, measured peak bytes)}``: the plan's and the breakdown's."""
        from ray_titan.metrics.reading.memory_plan import planned_rank

        planned = (self.memory_plan or {}).get("ranks", [])
        ranks = sorted({r["rank"] for r in planned} | set(self.memory_breakdown))
        return {r: ((planned_rank(planned, r) or {}).get("peak"), self.memory_breakdown.get(r, {}).get("peak_bytes"))
                for r in ranks}

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
        return self._rank0(column)[column].to_pylist()

    def _rank0(self, *columns: str) -> pa.Table:
        """Rank 0's rows of ``columns`` (and ``step``), in step order: from the loaded table, or
        else from rank 0's row group alone."""
        if self.__dict__.get("_steps") is None:
            from ray_titan.metrics.reading.steps import read_rank_history

            return read_rank_history(self.run_dir, 0, columns=list(dict.fromkeys(["step", *columns])))
        rows = self.steps.filter(pa.compute.equal(self.steps["rank"], 0))
        return rows.sort_by("step")

    def losses(self) -> list[float]:
        """The step losses (nats per token) in step order."""
        return self.step_column("step_loss")

    @property
    def validation(self) -> dict[int, float]:
        """The validation losses (nats per counted token, token-weighted over the last stage's
        data-parallel ranks) by step, at the steps that evaluated (``[validation]``); empty
        without validation. Their perplexity is ``math.exp`` of each."""
        loaded = self.__dict__.get("_steps")
        if loaded is not None and "step_val_loss" not in loaded.column_names:
            return {}
        rows = self._rank0("step_val_loss")
        return {s: v for s, v in zip(rows["step"].to_pylist(), rows["step_val_loss"].to_pylist()) if v is not None}




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
