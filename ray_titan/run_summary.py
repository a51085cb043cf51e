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
memory, GC count and pause, the metrics path's share of the step time) that the command prints,
and, where the run recorded them, each rank's predicted peak (``memory_plan.json``,
:mod:`ray_titan.memory_planner`) beside its measured one (``metrics/memory_breakdown.jsonl``,
``memory.breakdown_step``) with the measured split by category: :func:`format_memory_table`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ray_titan.metrics.leak import SERIES_NAMES, host_series
from ray_titan.metrics.sinks import read_steps

__all__ = ["format_memory_table", "format_table", "memory_rows", "summary_rows", "write_report"]

MiB = 2**20
_COORDS = ("pp", "dp_replicate", "dp_shard", "tp", "ep")


def _rank_tables(t: pa.Table) -> dict[int, dict[str, list]]:
    out = {}
    for rank in sorted(set(t["rank"].to_pylist())):
        rows = t.filter(pa.compute.equal(t["rank"], rank)).sort_by("step")
        out[rank] = {c: rows[c].to_pylist() for c in rows.column_names}
    return out


def _coords(r: dict[str, list], axes: tuple[str, ...] = _COORDS) -> str:
    return ", ".join(f"{k}={r[k][0]}" for k in axes if k in r and r[k] and r[k][0] is not None)


def _axes(t: pa.Table) -> tuple[str, ...]:
    """The mesh axes of the run: ``pp`` and ``dp_shard`` always, ``dp_replicate``, ``tp`` and
    ``ep`` only where some rank has a coordinate > 0 on them (the run has that axis)."""
    def has(axis: str) -> bool:
        return axis in t.column_names and any(v for v in t[axis].to_pylist())

    return tuple(a for a in _COORDS if a in ("pp", "dp_shard") or has(a))


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


def memory_rows(run_dir: str | Path) -> list[dict[str, Any]]:
    """One dict per rank with a plan or a measured breakdown: ``rank``, ``coords``,
    ``predicted_bytes`` (the plan's peak, None without a plan), ``measured_bytes`` (the profiler's
    peak at the breakdown step, None without one), ``step``, ``error`` (measured / predicted − 1),
    and the measured bytes by category at the peak (``parameters``, ``gradients``,
    ``optimizer_state``, ``activations``, ``temporaries``, ``other``: inputs and unknown)."""
    from ray_titan.memory_planner import PLAN_FILE
    from ray_titan.metrics.collector import read_breakdowns

    plan_path = Path(run_dir) / PLAN_FILE
    plan = {r["rank"]: r for r in json.loads(plan_path.read_text())["ranks"]} if plan_path.is_file() else {}
    measured = read_breakdowns(run_dir)
    rows = []
    for rank in sorted(set(plan) | set(measured)):
        p, m = plan.get(rank), measured.get(rank)
        coords = (p or m or {}).get("coords", {})
        at = m["at_peak"] if m else {}
        predicted: int | None = p["peak"] if p else None
        peak: int | None = m["peak_bytes"] if m else None
        row: dict[str, Any] = {
            "rank": rank, "coords": ", ".join(f"{k}={v}" for k, v in coords.items()),
            "predicted_bytes": predicted, "measured_bytes": peak, "step": m["step"] if m else None,
            "error": peak / predicted - 1 if peak and predicted else None,
        }
        for k in ("parameters", "gradients", "optimizer_state", "activations", "temporaries"):
            row[k] = at.get(k)
        row["other"] = (at.get("inputs", 0) + at.get("unknown", 0)) if m else None
        rows.append(row)
    return rows


def format_memory_table(rows: list[dict[str, Any]]) -> str:
    """:func:`memory_rows` as an aligned text table (MiB); empty when there are none."""
    if not rows:
        return ""
    head = ["rank", "coords", "predicted peak", "measured peak", "meas/pred", "params", "grads", "optim",
            "activations", "temporaries", "other"]

    def mib(v: int | None) -> str:
        return "" if v is None else f"{v / MiB:.1f}"

    body = [[str(r["rank"]), r["coords"], mib(r["predicted_bytes"]), mib(r["measured_bytes"]),
             "" if r["error"] is None else f"{r['error']:+.1%}", mib(r["parameters"]), mib(r["gradients"]),
             mib(r["optimizer_state"]), mib(r["activations"]), mib(r["temporaries"]), mib(r["other"])]
            for r in rows]
    step = next((r["step"] for r in rows if r["step"] is not None), None)
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    title = ("memory, MiB: the plan's peak (memory_plan.json) beside the profiler's"
             + (f" at step {step}, split by category at that peak" if step else ""))
    return "\n".join([title] + ["  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip()
                                for line in [head, *body]])


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
