"""``ray-titan report RUN_DIR``: plots and a summary table of a run's metrics.

Reads ``<run_dir>/metrics/steps.parquet`` (or its flushed parts, after a crash) and writes, with
matplotlib's Agg backend (no display needed):

- ``<run_dir>/report/loss.png``: the step loss (last pipeline stage) over steps, and the
  validation loss at the steps that evaluated;
- ``<run_dir>/report/memory.png``: every rank's memory over steps, the series its verdict
  watches (device allocated where the ranks have a device, else host RSS less malloc's free
  bytes, with RSS itself dashed), one line per rank labelled with its mesh coordinates, the
  steps with a ``growing`` verdict marked in red, the end of warm-up marked, and the rank's last
  verdict in the legend;

and returns the summary table (one row per rank: coordinates, last verdict and rate, peak
memory, GC count and pause, the metrics path's share of the step time) that the command prints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ray_titan.metrics.leak import SERIES_NAMES, host_series
from ray_titan.metrics.sinks import read_steps

__all__ = ["format_table", "summary_rows", "write_report"]

MiB = 2**20
_COORDS = ("pp", "dp_shard", "ep")


def _rank_tables(t: pa.Table) -> dict[int, dict[str, list]]:
    out = {}
    for rank in sorted(set(t["rank"].to_pylist())):
        rows = t.filter(pa.compute.equal(t["rank"], rank)).sort_by("step")
        out[rank] = {c: rows[c].to_pylist() for c in rows.column_names}
    return out


def _coords(r: dict[str, list], axes: tuple[str, ...] = _COORDS) -> str:
    return ", ".join(f"{k}={r[k][0]}" for k in axes if k in r and r[k] and r[k][0] is not None)


def _axes(t: pa.Table) -> tuple[str, ...]:
    """The mesh axes of the run: ``ep`` only where some rank has ep > 0 (an EP run)."""
    ep = t["ep"].to_pylist() if "ep" in t.column_names else []
    return _COORDS if any(v for v in ep) else tuple(a for a in _COORDS if a != "ep")


def _memory_series(r: dict[str, list]) -> tuple[str, np.ndarray, np.ndarray | None]:
    """``(name, MiB, rss MiB or None)``: the series the leak verdict watches (ray_titan.metrics.leak)
    and, when that is not RSS itself, host RSS to draw beside it."""
    dev = r.get("device_allocated_bytes")
    if dev and all(v is not None for v in dev):
        return SERIES_NAMES["device"], np.array(dev, dtype=float) / MiB, None
    rss = np.array(r["host_rss_bytes"], dtype=float) / MiB
    free = r.get("host_heap_free_bytes")
    free_mib = np.array(free, dtype=float) / MiB if free and all(v is not None for v in free) else None
    y, source = host_series(rss, free_mib)
    return SERIES_NAMES[source], y, rss if source == "host" else None


def summary_rows(t: pa.Table) -> list[dict[str, Any]]:
    """One dict per rank: ``rank``, ``coords``, ``verdict`` (last), ``slope_mib_per_step``,
    ``oom_step``, ``peak_host_rss_mib``, ``peak_device_reserved_mib`` (None on CPU),
    ``gc_count``, ``gc_pause_s`` (total), ``steps``, ``metrics_share``: the rank's seconds in its
    memory samples and reports (``metrics_time_s``) over its step time, the steps that carry a
    figure (None before that column existed)."""
    rows, axes = [], _axes(t)
    for rank, r in _rank_tables(t).items():
        verdicts = r.get("memory_verdict") or [None]
        dev_peak = [v for v in r.get("device_peak_reserved_bytes", []) if v is not None]
        gcs = [p for g, p in zip(r.get("gc_generation", []), r["gc_pause_s"]) if g is not None]
        rows.append({
            "rank": rank, "coords": _coords(r, axes), "verdict": verdicts[-1],
            "slope_mib_per_step": (r.get("memory_slope_mib_per_step") or [None])[-1],
            "oom_step": (r.get("memory_oom_step") or [None])[-1],
            "peak_host_rss_mib": max(r["host_peak_rss_bytes"]) / MiB,
            "peak_device_reserved_mib": max(dev_peak) / MiB if dev_peak else None,
            "gc_count": len(gcs), "gc_pause_s": float(sum(gcs)), "steps": len(r["step"]),
            "metrics_share": _metrics_share(r),
        })
    return rows


def _metrics_share(r: dict[str, list]) -> float | None:
    pairs = [(c, s) for c, s in zip(r.get("metrics_time_s", []), r["step_time_s"]) if c is not None]
    spent = sum(s for _, s in pairs)
    return sum(c for c, _ in pairs) / spent if pairs and spent > 0 else None


def format_table(rows: list[dict[str, Any]]) -> str:
    """The summary rows as an aligned text table."""
    head = ["rank", "coords", "verdict", "MiB/step", "OOM step", "peak RSS MiB", "peak dev MiB", "GCs", "GC s",
            "metrics %"]
    body = [[
        str(r["rank"]), r["coords"], str(r["verdict"]),
        "" if r["slope_mib_per_step"] is None else f"{r['slope_mib_per_step']:+.3f}",
        "" if r["oom_step"] is None else str(r["oom_step"]),
        f"{r['peak_host_rss_mib']:.0f}",
        "" if r["peak_device_reserved_mib"] is None else f"{r['peak_device_reserved_mib']:.0f}",
        str(r["gc_count"]), f"{r['gc_pause_s']:.3f}",
        "" if r.get("metrics_share") is None else f"{100 * r['metrics_share']:.2f}",
    ] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip() for line in [head, *body])


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> tuple[list[Path], list[dict[str, Any]]]:
    """Write ``loss.png`` and ``memory.png`` to ``out_dir`` (default ``<run_dir>/report``) and
    return their paths and :func:`summary_rows`. Raises ``FileNotFoundError`` if the run has
    no recorded steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = read_steps(run_dir)
    if t.num_rows == 0:
        raise FileNotFoundError(f"{run_dir}: no metrics (metrics/steps.parquet or metrics/parts/)")
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    ranks, axes = _rank_tables(t), _axes(t)

    first = ranks[min(ranks)]
    fig, ax = plt.subplots(figsize=(8, 4))
    loss = np.array([np.nan if v is None else v for v in first["step_loss"]], dtype=float)
    ax.plot(first["step"], loss, lw=1, label="train")
    val = [(s, v) for s, v in zip(first["step"], first.get("step_val_loss") or []) if v is not None]
    if val:
        ax.plot(*zip(*val), marker="o", ms=3, lw=1, label="validation")
        ax.legend()
    ax.set(xlabel="step", ylabel="loss (nats/token)", title=f"{Path(run_dir).name}: loss of the last stage")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 5))
    what, dashed = "memory", False
    for rank, r in ranks.items():
        what, y, rss = _memory_series(r)
        steps = np.array(r["step"])
        verdicts = r.get("memory_verdict") or [None] * len(steps)
        label = f"rank {rank} ({_coords(r, axes)}): {verdicts[-1]}"
        if verdicts[-1] == "growing" and r.get("memory_slope_mib_per_step"):
            label += f" {r['memory_slope_mib_per_step'][-1]:+.2f} MiB/step"
        (line,) = ax.plot(steps, y, lw=1, label=label)
        if rss is not None:
            ax.plot(steps, rss, lw=0.8, ls="--", alpha=0.6, color=line.get_color())
            dashed = True
        growing = np.array([v == "growing" for v in verdicts])
        if growing.any():
            ax.scatter(steps[growing], y[growing], s=8, color="red", zorder=3)
        warm = [i for i, v in enumerate(verdicts) if v == "warming_up"]
        if warm and warm[-1] + 1 < len(steps):
            ax.axvline(steps[warm[-1] + 1], color=line.get_color(), ls=":", lw=0.8)
    ax.scatter([], [], s=8, color="red", label="verdict growing")
    ax.set(xlabel="step", ylabel=f"{what} (MiB)",
           title=f"{Path(run_dir).name}: {what} per rank\n(dotted: end of warm-up"
                 + ("; dashed: host RSS)" if dashed else ")"))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=120)
    plt.close(fig)
    return [out / "loss.png", out / "memory.png"], summary_rows(t)
