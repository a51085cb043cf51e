"""Read-side analysis of a run's metrics table for MoE runs and memory flatness.

Used by the tests and the benchmark printout; works on the Parquet table the collector writes
(``ray_titan.metrics.sinks.read_steps``), so it needs no live run.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ray_titan.metrics.collector import expert_load

__all__ = ["expert_shares", "memory_slopes", "theil_sen_slope"]


def theil_sen_slope(x, y) -> float:
    """Median of the pairwise slopes ``(y_j - y_i) / (x_j - x_i)``, ``i < j`` (Theil 1950; Sen
    1968): robust to outliers such as one step's allocator spike. ``O(n²)`` pairs."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    i, j = np.triu_indices(len(x), k=1)
    dx = x[j] - x[i]
    keep = dx != 0
    return float(np.median((y[j] - y[i])[keep] / dx[keep])) if keep.any() else 0.0


def memory_slopes(steps: pa.Table, after_step: int, column: str = "host_rss_bytes") -> dict[int, float]:
    """Per rank: Theil–Sen slope of a memory ``column`` (bytes per step) over the steps
    ``> after_step``: host RSS by default, or ``host_heap_in_use_bytes`` (what malloc has handed
    out), whose difference from RSS is the allocator's own free space."""
    out = {}
    for rank in sorted(set(steps["rank"].to_pylist())):
        rows = steps.filter(pa.compute.and_(
            pa.compute.equal(steps["rank"], rank), pa.compute.greater(steps["step"], after_step)
        ))
        out[rank] = theil_sen_slope(rows["step"].to_pylist(), rows[column].to_pylist())
    return out


def expert_shares(steps: pa.Table, first_step: int, last_step: int) -> dict[int, list[float]]:
    """Per MoE layer: each expert's share of the tokens routed in steps ``first_step..last_step``
    (inclusive), summed over ranks. A perfectly balanced layer has every share ``1 / n_experts``."""
    rows = steps.filter(pa.compute.and_(
        pa.compute.greater_equal(steps["step"], first_step), pa.compute.less_equal(steps["step"], last_step)
    )).select(["moe_layers", "expert_load"]).to_pylist()
    totals = expert_load(rows)
    return {layer: [c / sum(counts) for c in counts] for layer, counts in totals.items() if sum(counts)}
