"""Read-side analysis of a run's metrics table for MoE runs and memory flatness.

Used by the tests and the benchmark printout; works on the Parquet table the collector writes
(``ray_titan.metrics.reading.steps.read_steps``), so it needs no live run.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from ray_titan.metrics.collector.leak import theil_sen_slope

__all__ = ["expert_load", "expert_shares", "memory_slopes"]


def expert_load(rows: list[dict[str, Any]]) -> dict[int, list[int]]:
    """Expert load per MoE layer: tokens (× top-k) routed to each expert, summed over the rows
    (dicts with ``moe_layers`` and ``expert_load``: the ranks holding a layer, each data-parallel
    rank routing its own tokens); empty for a dense model."""
    out: dict[int, list[int]] = {}
    for r in rows:
        for layer, counts in zip(r.get("moe_layers") or [], r.get("expert_load") or []):
            acc = out.setdefault(layer, [0] * len(counts))
            for e, c in enumerate(counts):
                acc[e] += c
    return dict(sorted(out.items()))


def memory_slopes(steps: pa.Table, after_step: int, column: str = "host_rss_bytes") -> dict[int, float]:
    """Per rank: Theil–Sen slope of a memory ``column`` (bytes per step) over the steps
    ``> after_step``: host RSS by default, or ``host_heap_in_use_bytes`` (what malloc has handed
    out), whose difference from RSS is the allocator's own free space."""
    out = {}
    for rank in sorted(set(steps["rank"].to_pylist())):
        rows = steps.filter(pa.compute.and_(
            pa.compute.equal(steps["rank"], rank), pa.compute.greater(steps["step"], after_step)
        ))
        try:
            out[rank] = theil_sen_slope(rows["step"].to_pylist(), rows[column].to_pylist())
        except ValueError:  # fewer than two steps after ``after_step``: nothing to measure
            out[rank] = 0.0
    return out


def expert_shares(steps: pa.Table, first_step: int, last_step: int) -> dict[int, list[float]]:
    """Per MoE layer: each expert's share of the tokens routed in steps ``first_step..last_step``
    (inclusive), summed over ranks. A perfectly balanced layer has every share ``1 / n_experts``."""
    rows = steps.filter(pa.compute.and_(
        pa.compute.greater_equal(steps["step"], first_step), pa.compute.less_equal(steps["step"], last_step)
    )).select(["moe_layers", "expert_load"]).to_pylist()
    totals = expert_load(rows)
    return {layer: [c / sum(counts) for c in counts] for layer, counts in totals.items() if sum(counts)}
