"""A run's outcome, typed: what the metrics collector's ``finish()`` returns, with one name per
reason a run stopped, and :class:`MemoryLeakError`, what a rank and the driver raise when the
memory-leak policy stopped the run.

The collector summarises a run as a dict (:meth:`ray_titan.metrics.collector.collector.MetricsCollector.finish`),
where the key ``"stop"`` holds why the memory-leak policy stopped the run and the key
``"stop_reason"`` why a non-finite loss did. :meth:`RunOutcome.from_summary` reads that dict once,
at the boundary, so the driver and the launcher name each reason for what it is
(:attr:`RunOutcome.memory_leak`, :attr:`RunOutcome.nonfinite_loss`, :attr:`RunOutcome.stop_reason`).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MemoryLeakError", "RunOutcome", "StopReason"]


class MemoryLeakError(RuntimeError):
    """A rank's memory is growing and ``memory.on_leak = "stop"`` ended the run. The message
    names the rank, its mesh coordinates and the rate."""


class StopReason(enum.Enum):
    """Why a run's training ended, as its metrics tell it."""

    COMPLETED = "completed"
    """It ran to its last step (or to where a failure or an interrupt ended it)."""
    MEMORY_LEAK = "memory_leak"
    """A rank's memory grew step after step and ``memory.on_leak = "stop"`` ended the run."""
    NONFINITE_LOSS = "nonfinite_loss"
    """A non-finite loss stopped every rank (``training.on_nonfinite = "stop"``)."""


@dataclass
class RunOutcome:
    """The collector's summary of a run (:meth:`MetricsCollector.finish`), typed.

    ``final_loss``: the last step's loss (nats per token), None without one; ``last_step``: the
    newest step assembled; ``errors``: steps the collector could not assemble or reports it found
    wrong; ``lines``: console lines not shown yet; ``latest``: the newest step's payload for the
    progress display; ``memory_verdicts`` / ``memory_breakdown``: ``{rank: ...}``
    (``ray_titan.metrics.collector.leak``, ``ray_titan.metrics.worker.profiling``); ``skipped_steps``,
    ``steps_run``, ``restarts``, ``collector_restarted``: as :class:`ray_titan.driver.RunResult`'s.
    """

    final_loss: float | None = None
    last_step: int | None = None
    errors: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    latest: dict[str, Any] | None = None
    memory_verdicts: dict[int, dict[str, Any]] = field(default_factory=dict)
    memory_breakdown: dict[int, dict[str, Any]] = field(default_factory=dict)
    skipped_steps: int = 0
    steps_run: int = 0
    restarts: int = 0
    collector_restarted: bool = False
    memory_leak: str | None = None
    """Why the memory-leak policy stopped the run (the collector's ``"stop"``), None if it did not."""
    nonfinite_loss: str | None = None
    """Why a non-finite loss stopped the run (the collector's ``"stop_reason"``), None if none did."""

    @classmethod
    def from_summary(cls, summary: dict[str, Any]) -> RunOutcome:
        """The outcome of the collector's ``finish()`` dict (keys it lacks take their defaults)."""
        return cls(
            final_loss=summary.get("final_loss"), last_step=summary.get("last_step"),
            errors=list(summary.get("errors", [])), lines=list(summary.get("lines", [])),
            latest=summary.get("latest"), memory_verdicts=summary.get("memory_verdicts", {}),
            memory_breakdown=summary.get("memory_breakdown", {}),
            skipped_steps=summary.get("skipped_steps", 0), steps_run=summary.get("steps_run", 0),
            restarts=summary.get("restarts", 0), collector_restarted=summary.get("collector_restarted", False),
            memory_leak=summary.get("stop"), nonfinite_loss=summary.get("stop_reason"),
        )

    @classmethod
    def collector_failed(cls, error: BaseException) -> RunOutcome:
        """The outcome when the collector could not finish: no loss, the error recorded (the
        metrics it flushed before stay on disk)."""
        return cls(errors=[f"metrics collector failed to finish: {error}"])

    @property
    def stop_reason(self) -> StopReason:
        """Why training ended: a memory leak or a non-finite loss stopping it, else completed."""
        if self.memory_leak:
            return StopReason.MEMORY_LEAK
        if self.nonfinite_loss:
            return StopReason.NONFINITE_LOSS
        return StopReason.COMPLETED

    @property
    def final_loss_is_finite(self) -> bool:
        """False only for a final loss that is NaN or infinite (never a success)."""
        return self.final_loss is None or math.isfinite(self.final_loss)

    def console_payload(self) -> dict[str, Any]:
        """What the progress display shows last: ``{"lines", "latest"}`` as the collector's poll."""
        return {"lines": self.lines, "latest": self.latest}
