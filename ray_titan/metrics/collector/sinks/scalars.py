"""The scalars TensorBoard and W&B get, by tag: a step's figures and each logged rank's memory,
verdict, slope and GC pause (:func:`step_scalars`), beyond ``metrics.series_max_ranks`` ranks the
memory per pipeline stage and overall (:func:`memory_summary_scalars`), and per MoE layer its
experts' load (:func:`expert_load_scalars`). A verdict is logged as its code
(:data:`~ray_titan.metrics.fields.VERDICT_CODES`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ray_titan.config.units import MiB
from ray_titan.metrics.collector.columns import Columns
from ray_titan.metrics.fields import VERDICT_CODES, VERDICTS

__all__ = ["expert_load_scalars", "memory_summary_scalars", "step_scalars"]



def step_scalars(scalars: Mapping[str, float | None], rows: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """A step's scalars by tag, as TensorBoard and W&B get them: ``scalars`` (the step-level
    figures, None left out) and, per rank, its memory (MiB), verdict, slope and GC pause."""
    values = [(k, v) for k, v in scalars.items() if v is not None]
    for row in rows:
        rank = row["rank"]
        for k in ("host_rss_bytes", "host_peak_rss_bytes", "device_allocated_bytes",
                  "device_reserved_bytes", "device_peak_active_bytes", "device_peak_reserved_bytes"):
            if row.get(k) is not None:
                values.append((f"memory/rank{rank}/{k.removesuffix('_bytes')}_mib", row[k] / MiB))
        if row.get("memory_verdict") is not None:
            values.append((f"memory/rank{rank}/verdict", VERDICT_CODES[row["memory_verdict"]]))
        if row.get("memory_slope_mib_per_step") is not None:
            values.append((f"memory/rank{rank}/slope_mib_per_step", row["memory_slope_mib_per_step"]))
        if row.get("gc_generation") is not None:
            values.append((f"gc/rank{rank}/pause_s", row["gc_pause_s"]))
    return values


def expert_load_scalars(load: dict[int, list[int]], shares: bool = True) -> list[tuple[str, float]]:
    """Per MoE layer: max over mean of the experts' token counts (1 = perfectly balanced) and,
    with ``shares``, each expert's share of the layer's routed tokens."""
    values = []
    for layer, counts in load.items():
        total = sum(counts)
        if total:
            values.append((f"moe/layer{layer}/load_max_over_mean", max(counts) * len(counts) / total))
            if shares:
                values += [(f"moe/layer{layer}/expert{e}_share", c / total) for e, c in enumerate(counts)]
    return values


def memory_summary_scalars(c: Columns, code: np.ndarray) -> list[tuple[str, float]]:
    """Per-rank series summarised for TensorBoard and W&B beyond ``metrics.series_max_ranks``
    ranks: ``memory/all/<field>_{min,median,max}_mib`` and ``memory/pp<s>/<field>_{min,median,max}_mib``
    for host RSS and device allocated / peak reserved memory, and ``memory/ranks_{verdict}``."""
    out: list[tuple[str, float]] = []
    pp = c.int("pp")
    groups = [("all", None)] + [(f"pp{s}", pp == s) for s in np.unique(pp).tolist()]
    for key in ("host_rss_bytes", "device_allocated_bytes", "device_peak_reserved_bytes"):
        v = c.get(key)
        if np.isnan(v).all():
            continue
        name = key.removesuffix("_bytes")
        for g, at in groups:
            x = (v if at is None else v[at]) / MiB
            out += [(f"memory/{g}/{name}_min_mib", float(np.nanmin(x))),
                    (f"memory/{g}/{name}_median_mib", float(np.nanmedian(x))),
                    (f"memory/{g}/{name}_max_mib", float(np.nanmax(x)))]
    counts = np.bincount(code.astype(np.int64), minlength=len(VERDICTS))
    out += [(f"memory/ranks_{v}", float(k)) for v, k in zip(VERDICTS, counts.tolist())]
    return out
