"""A step's figures from its reports in columns: the loss of the last pipeline stage, tokens/s,
validation, mixture tokens (:func:`step_summary`), which ranks hold the last stage
(:class:`LastStage`), the rank with the most memory (:func:`max_memory`), the ranks' rows the
console and the per-rank series read (:func:`rank_rows`), and the run's progress (:class:`Tally`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ray_titan.metrics.collector.columns import SOURCES, Columns
from ray_titan.metrics.fields import VERDICTS

__all__ = ["RANK_ROW_FIELDS", "LastStage", "StepSummary", "Tally", "group_size", "max_memory", "rank_rows",
           "step_summary"]


class LastStage:
    """Which ranks hold the last pipeline stage, per worker group size: ``last_by_size`` is
    ``{world size: those ranks}`` (an elastic run's every size; else the run's one)."""

    def __init__(self, last_by_size: dict[int, list[int]], world_size: int):
        self.last_by_size, self.world_size = last_by_size, world_size
        self._tables: dict[int, np.ndarray] = {}

    def mask(self, size: int, ranks: np.ndarray) -> np.ndarray:
        """bool ``(ranks,)``: which of ``ranks`` hold the last stage in a worker group of ``size``
        (a lookup table per size: ``np.isin`` costs ~0.1 ms a step at any size)."""
        table = self._tables.get(size)
        top = int(ranks.max()) + 1 if len(ranks) else 0
        if table is None or len(table) < top:
            last = self.last_by_size.get(size, self.last_by_size[self.world_size])
            table = np.zeros(max(top, max(last, default=-1) + 1), bool)
            table[last] = True
            self._tables[size] = table
        return table[ranks]


@dataclass
class StepSummary:
    """:func:`step_summary`'s answer: ``figures`` (the step's figures by name, as the sinks and the
    console read them), the masks ``last`` (the last stage's counted ranks) and ``counted`` (the
    ranks that speak for their data-parallel rank: ``tp = 0`` and ``cp = 0``), and ``errors`` (reports found
    wrong, for the caller to record)."""

    figures: dict[str, Any]
    last: np.ndarray
    counted: np.ndarray
    errors: list[str] = field(default_factory=list)


def step_summary(step: int, c: Columns, objects: list[tuple], on_last: np.ndarray) -> StepSummary:
    """The step's figures: the loss over the last stage's counted ranks (``on_last``: the ranks
    on the last stage), token-weighted, and their max; tokens and tokens/s over the slowest rank's
    step time; LR, gradient norm and a skipped update; validation; mixture tokens. A last-stage
    rank without a loss or another rank with one is an error."""
    ranks = c.int("rank")
    has_loss = ~c.null("loss")
    errors = [f"step {step}: last-stage rank {r} reported no loss" for r in ranks[on_last & ~has_loss].tolist()]
    errors += [f"step {step}: rank {r} is not on the last stage but reported a loss"
               for r in ranks[~on_last & has_loss].tolist()]
    # A tp group's ranks hold one data-parallel rank's figures, and so do its cp ranks (their
    # loss and counted labels reduced over cp by the step: ray_titan.trainer.step).
    counted = (c.int("tp") == 0) & (c.int("cp") == 0)
    last = on_last & counted
    with_loss = last & has_loss
    weights = np.where(c.null("loss_tokens"), c.get("tokens"), c.get("loss_tokens"))[with_loss]
    tokens_w = weights.sum()
    loss = float((c.get("loss")[with_loss] * weights).sum() / tokens_w) if tokens_w else None
    step_time = float(c.get("step_time_s").max())
    s: dict[str, Any] = {
        "loss": loss,
        "loss_max": float(c.get("loss")[with_loss].max()) if with_loss.any() else None,
        "tokens": int(c.get("tokens")[last].sum()),
        "step_time_s": step_time,
        "lr": float(c.get("lr")[0]),
        "grad_norm": float(c.get("grad_norm")[0]),
        "skipped": bool(c.get("skipped_update")[0]),
    }
    s["tokens_per_s"] = s["tokens"] / step_time if step_time > 0 else 0.0
    val = last & ~c.null("val_loss") & (np.nan_to_num(c.get("val_tokens")) > 0)
    val_tokens = c.get("val_tokens")[val].sum()
    val_loss = float((c.get("val_loss")[val] * c.get("val_tokens")[val]).sum() / val_tokens) if val.any() else None
    s["val/loss"] = val_loss
    s["val/perplexity"] = None if val_loss is None else math.exp(min(val_loss, 700.0))
    mixed = [objects[i][SOURCES] for i in np.nonzero(last)[0].tolist() if objects[i][SOURCES]]  # one per DP group
    s["source_tokens"] = [sum(x) for x in zip(*mixed)] if mixed else None
    return StepSummary(s, last, counted, errors)


def max_memory(c: Columns) -> dict[str, Any] | None:
    """The rank with the most memory: device peak reserved where there is a device, else host RSS."""
    if not c.null("device_peak_reserved_bytes")[0]:
        key, kind = "device_peak_reserved_bytes", "dev peak"
    else:
        key, kind = "host_rss_bytes", "rss"
    v = c.get(key)
    if np.isnan(v).all():
        return None
    i = int(np.nanargmax(v))
    return {"rank": int(c.get("rank")[i]), "bytes": int(v[i]), "kind": kind}


def group_size(c: Columns, world_size: int) -> int:
    """The worker group size of a step's reports (``world_size``, the run's, for reports that do not say)."""
    size = c.get("world_size")[0]
    return world_size if np.isnan(size) or size <= 0 else int(size)


RANK_ROW_FIELDS = ("rank", "host_rss_bytes", "host_peak_rss_bytes", "device_allocated_bytes", "device_reserved_bytes",
                   "device_peak_active_bytes", "device_peak_reserved_bytes", "gc_generation", "gc_pause_s")
"""The fields of a rank's row that the console line and the per-rank series read."""


def rank_rows(c: Columns, code: np.ndarray, slope: np.ndarray, at: np.ndarray) -> list[dict[str, Any]]:
    """The rows of the step's ranks ``at`` (indices, int ``(k,)``) with :data:`RANK_ROW_FIELDS`
    (bytes, GC; None where a report had none) and the rank's verdict and slope (MiB per step)."""
    rows = c.rows(RANK_ROW_FIELDS, at)
    for row, i in zip(rows, at.tolist()):
        row["memory_verdict"] = VERDICTS[int(code[i])]
        row["memory_slope_mib_per_step"] = None if math.isnan(slope[i]) else float(slope[i])
    return rows


class Tally:
    """The run's progress: steps assembled, the newest step and its loss (None, and an error, if
    it had none), and ``latest``, the newest step's payload for the driver's progress display."""

    def __init__(self, total_steps: int):
        self.total_steps = total_steps
        self.assembled = 0
        self.last_step = 0
        self.final_loss: float | None = None
        self.latest: dict[str, Any] | None = None

    def record(self, step: int, figures: dict[str, Any], c: Columns) -> None:
        self.assembled += 1
        if step >= self.last_step:
            self.last_step, self.final_loss = step, figures["loss"]
            self.latest = {"step": step, "total": self.total_steps, "loss": figures["loss"],
                           "tokens_per_s": figures["tokens_per_s"], "max_memory": max_memory(c)}

    def restore(self, assembled: int, last_step: int, final_loss: float | None) -> None:
        """A restarted collector's progress, from its flushed rows."""
        self.assembled, self.last_step, self.final_loss = assembled, last_step, final_loss
