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

Beyond :data:`PER_RANK_LIMIT` ranks one line per rank is unreadable: ``memory.png`` is then a
rank × step heatmap of the same series and ``step_time.png`` one of the step time (both binned to
at most :data:`HEATMAP_BINS` rows and columns, each cell the bin's maximum, so a single high rank
or step still shows), with the outlier ranks (:func:`outlier_ranks`) named beside them; the summary
table then shows only the ranks worth a look and ``ranks.csv`` has them all.

It returns the summary table (one row per rank: coordinates, last verdict and rate, peak
memory, GC count and pause, the metrics path's share of the step time) that the command prints,
and, where the run recorded them, each rank's predicted peak (``memory_plan.json``,
:mod:`ray_titan.preflight.memory_plan`) beside its measured one (``metrics/memory_breakdown.jsonl``,
``memory.breakdown_step``) with the measured split by category: :func:`format_memory_table`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from ray_titan.config.units import MiB
from ray_titan.metrics.collector.breakdowns import read_breakdowns
from ray_titan.metrics.collector.leak import SERIES_NAMES, host_series
from ray_titan.metrics.fields import COORD_AXES
from ray_titan.metrics.reading.memory_plan import PLAN_FILE, planned_rank
from ray_titan.metrics.reading.steps import read_steps
from ray_titan.metrics.schema import STEP_SCHEMA

__all__ = ["HEATMAP_BINS", "OUTLIER_MIN_REL", "OUTLIER_Z", "PER_RANK_LIMIT", "ReportError", "format_memory_table",
           "format_table", "memory_rows", "outlier_ranks", "rank_figures", "summary_rows", "write_report"]

PER_RANK_LIMIT = 16
"""Up to this many ranks the report draws one line per rank and prints every rank's row."""
HEATMAP_BINS = (1024, 1000)
"""At most this many (rank, step) cells in a heatmap; larger runs are binned (max per cell)."""
OUTLIER_Z, OUTLIER_MIN_REL = 5.0, 0.05
""":func:`outlier_ranks`' rule: robust z-score above ``OUTLIER_Z`` and ``OUTLIER_MIN_REL`` away from
the stage's median."""


def _rank_tables(t: pa.Table) -> dict[int, dict[str, list]]:
    out = {}
    for rank in sorted(set(t["rank"].to_pylist())):
        rows = t.filter(pa.compute.equal(t["rank"], rank)).sort_by("step")
        out[rank] = {c: rows[c].to_pylist() for c in rows.column_names}
    return out


def _coords(r: dict[str, list], axes: tuple[str, ...] = COORD_AXES) -> str:
    return ", ".join(f"{k}={r[k][0]}" for k in axes if k in r and r[k] and r[k][0] is not None)


def _axes(t: pa.Table) -> tuple[str, ...]:
    """The mesh axes of the run: ``pp`` and ``dp_shard`` always, ``dp_replicate``, ``tp`` and
    ``ep`` only where some rank has a coordinate > 0 on them (the run has that axis)."""
    def has(axis: str) -> bool:
        return axis in t.column_names and any(v for v in t[axis].to_pylist())

    return tuple(a for a in COORD_AXES if a in ("pp", "dp_shard") or has(a))


def _memory_series(r: dict[str, list]) -> tuple[str, np.ndarray, np.ndarray | None]:
    """``(name, MiB, rss MiB or None)``: the series the leak verdict watches (ray_titan.metrics.collector.leak)
    and, when that is not RSS itself, host RSS to draw beside it."""
    dev = r.get("device_allocated_bytes")
    if dev and all(v is not None for v in dev):
        return SERIES_NAMES["device"], np.array(dev, dtype=float) / MiB, None
    rss = np.array(r["host_rss_bytes"], dtype=float) / MiB
    free = r.get("host_heap_free_bytes")
    free_mib = np.array(free, dtype=float) / MiB if free and all(v is not None for v in free) else None
    y, source = host_series(rss, free_mib)
    return SERIES_NAMES[source], y, rss if source == "host" else None


def _by_rank(t: pa.Table) -> tuple[pa.Table, np.ndarray]:
    """``t`` sorted by rank then step, and the index of each rank's first row (one entry per rank)."""
    t = t.sort_by([("rank", "ascending"), ("step", "ascending")])
    rank = t["rank"].to_numpy()
    return t, np.flatnonzero(np.r_[True, rank[1:] != rank[:-1]]) if len(rank) else np.zeros(0, np.int64)


def _floats(t: pa.Table, col: str) -> np.ndarray:
    """Column ``col`` as float64, NaN for nulls (or all NaN if the table lacks it)."""
    if col not in t.column_names:
        return np.full(t.num_rows, np.nan)
    return t[col].cast(pa.float64()).to_numpy(zero_copy_only=False)


def _memory_values(t: pa.Table) -> tuple[str, np.ndarray]:
    """``(name, bytes)`` of the series the leak verdict watches, for every row: device allocated
    where every row has it, else host RSS less malloc's free bytes where every row has those,
    else host RSS (ray_titan.metrics.collector.leak.host_series)."""
    dev = _floats(t, "device_allocated_bytes")
    if len(dev) and not np.isnan(dev).any():
        return SERIES_NAMES["device"], dev
    free = _floats(t, "host_heap_free_bytes")
    y, source = host_series(_floats(t, "host_rss_bytes"), None if np.isnan(free).any() else free)
    return SERIES_NAMES[source], y


def summary_rows(t: pa.Table) -> list[dict[str, Any]]:
    """One dict per rank: ``rank``, ``coords``, ``verdict`` (last), ``slope_mib_per_step``,
    ``oom_step``, ``peak_host_rss_mib``, ``peak_device_reserved_mib`` (None on CPU),
    ``gc_count``, ``gc_pause_s`` (total), ``steps``, ``metrics_share``: the rank's seconds in its
    memory samples and reports (``metrics_time_s``) over its step time, the steps that carry a
    figure (None before that column existed), and ``outlier``: why :func:`outlier_ranks` names
    it (None if it does not). Vectorised over ranks (a sort and numpy reductions), so 16K ranks
    cost seconds, not a filter per rank."""
    axes = _axes(t)
    t, first = _by_rank(t)
    if not len(first):
        return []
    last = np.r_[first[1:], t.num_rows] - 1
    n = np.diff(np.r_[first, t.num_rows])

    def reduce(values: np.ndarray, how) -> np.ndarray:
        return how.reduceat(values, first)

    host_peak = reduce(_floats(t, "host_peak_rss_bytes"), np.fmax)
    dev_peak = reduce(_floats(t, "device_peak_reserved_bytes"), np.fmax)
    gc_ran = ~np.isnan(_floats(t, "gc_generation"))
    gc_pause = np.nan_to_num(_floats(t, "gc_pause_s"))
    gc_count, gc_total = reduce(gc_ran.astype(np.int64), np.add), reduce(np.where(gc_ran, gc_pause, 0.0), np.add)
    mt, st = _floats(t, "metrics_time_s"), _floats(t, "step_time_s")
    has_mt = ~np.isnan(mt)
    spent = reduce(np.where(has_mt, st, 0.0), np.add)
    share = np.where(spent > 0, reduce(np.where(has_mt, mt, 0.0), np.add) / np.where(spent > 0, spent, 1), np.nan)
    share[reduce(has_mt.astype(np.int64), np.add) == 0] = np.nan
    firsts = t.take(pa.array(first)).select([a for a in axes if a in t.column_names] + ["rank"]).to_pylist()
    lasts = t.take(pa.array(last)).select(
        [c for c in ("memory_verdict", "memory_slope_mib_per_step", "memory_oom_step") if c in t.column_names]
    ).to_pylist()
    why: dict[int, str] = {}
    for o in outlier_ranks(t):
        why[o["rank"]] = "; ".join(filter(None, [why.get(o["rank"]), o["why"]]))

    def opt(v: float, scale: float = 1.0) -> float | None:
        return None if np.isnan(v) else float(v) / scale

    return [{
        "rank": f["rank"], "coords": ", ".join(f"{a}={f[a]}" for a in axes if f.get(a) is not None),
        "verdict": lz.get("memory_verdict"), "slope_mib_per_step": lz.get("memory_slope_mib_per_step"),
        "oom_step": lz.get("memory_oom_step"), "peak_host_rss_mib": opt(host_peak[i], MiB),
        "peak_device_reserved_mib": opt(dev_peak[i], MiB),
        "gc_count": int(gc_count[i]), "gc_pause_s": float(gc_total[i]), "steps": int(n[i]),
        "metrics_share": opt(share[i]), "outlier": why.get(f["rank"]),
    } for i, (f, lz) in enumerate(zip(firsts, lasts))]


def _block_medians(x: np.ndarray, first: np.ndarray) -> np.ndarray:
    """The median of each block ``x[first[i]:first[i + 1]]``, NaNs left out (NaN: none left),
    with one sort instead of a call per block."""
    block = np.repeat(np.arange(len(first)), np.diff(np.r_[first, len(x)]))
    x = x[np.lexsort((x, block))]  # within each block ascending, NaNs last
    k = np.add.reduceat(~np.isnan(x), first) if len(x) else np.zeros(0, np.int64)
    lo, hi = first + np.maximum(k - 1, 0) // 2, first + k // 2  # the middle one or two of the k values
    return np.where(k > 0, (x[lo] + x[hi]) / 2, np.nan)


def outlier_ranks(t: pa.Table, z: float = OUTLIER_Z, min_rel: float = OUTLIER_MIN_REL) -> list[dict[str, Any]]:
    """The ranks whose memory or step time stands out from the other ranks of their pipeline
    stage (ranks of one stage hold the same layers, so their memory should match; earlier stages
    hold more activations under 1F1B, so stages are not compared with each other). Per rank: the
    peak of the series the verdict watches (:func:`_memory_values`) and the median step time.
    A rank is named when its robust z-score, ``|x - median| / (1.4826 · MAD)`` over its stage
    (Iglewicz and Hoaglin's modified z-score, with MAD scaled to a normal's σ), exceeds ``z`` and
    it is more than ``min_rel`` (a fraction) from the stage's median, so a stage of near-identical
    ranks (MAD ≈ 0) does not name noise. Returns ``[{"rank", "pp", "what": "memory" |
    "step time", "value", "median", "why"}]`` (bytes or seconds), most extreme first."""
    if t.num_rows == 0:
        return []
    t, first = _by_rank(t)
    _, mem = _memory_values(t)
    peak = np.fmax.reduceat(mem, first)
    st = _floats(t, "step_time_s")
    median_time = _block_medians(st, first)
    ranks = t["rank"].to_numpy()[first]
    stage = t["pp"].to_numpy()[first] if "pp" in t.column_names else np.zeros(len(first), np.int64)
    out = []
    for what, x, unit in (("memory", peak, MiB), ("step time", median_time, 1.0)):
        for s in np.unique(stage):
            sel = np.flatnonzero((stage == s) & ~np.isnan(x))
            if len(sel) < 3:
                continue
            med = float(np.median(x[sel]))
            mad = 1.4826 * float(np.median(np.abs(x[sel] - med)))
            dev = np.abs(x[sel] - med)
            score = dev / mad if mad > 0 else np.where(dev > 0, np.inf, 0.0)
            for i in np.flatnonzero((score > z) & (dev > min_rel * abs(med))):
                r, v = int(ranks[sel[i]]), float(x[sel[i]])
                fmt = (lambda b: f"{b / MiB:,.0f} MiB") if unit == MiB else (lambda b: f"{b:.3g} s")
                out.append({"rank": r, "pp": int(s), "what": what, "value": v, "median": med,
                            "z": float(score[i]),
                            "why": f"{what} {fmt(v)} vs its stage's median {fmt(med)} ({v / med - 1:+.0%})"})
    return sorted(out, key=lambda o: -abs(o["value"] / o["median"] - 1) if o["median"] else 0.0)


def format_table(rows: list[dict[str, Any]], limit: int = PER_RANK_LIMIT) -> str:
    """The summary rows as an aligned text table. Beyond ``limit`` rows, only the ranks worth a
    look (verdict ``growing``, an OOM step, or an outlier, whose reason is its last column) and a
    line counting the others."""
    shown = rows if len(rows) <= limit else [
        r for r in rows if r["verdict"] == "growing" or r["oom_step"] is not None or r.get("outlier")]
    head = ["rank", "coords", "verdict", "MiB/step", "OOM step", "peak RSS MiB", "peak dev MiB", "GCs", "GC s",
            "metrics %"] + (["outlier"] if len(rows) > limit else [])
    body = [[
        str(r["rank"]), r["coords"], str(r["verdict"]),
        "" if r["slope_mib_per_step"] is None else f"{r['slope_mib_per_step']:+.3f}",
        "" if r["oom_step"] is None else str(r["oom_step"]),
        "" if r["peak_host_rss_mib"] is None else f"{r['peak_host_rss_mib']:.0f}",
        "" if r["peak_device_reserved_mib"] is None else f"{r['peak_device_reserved_mib']:.0f}",
        str(r["gc_count"]), f"{r['gc_pause_s']:.3f}",
        "" if r.get("metrics_share") is None else f"{100 * r['metrics_share']:.2f}",
    ] + ([r.get("outlier") or ""] if len(rows) > limit else []) for r in shown]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip() for line in [head, *body]]
    if len(shown) < len(rows):
        verdicts: dict[str, int] = {}
        for r in rows:
            verdicts[str(r["verdict"])] = verdicts.get(str(r["verdict"]), 0) + 1
        lines.append(f"({len(rows) - len(shown)} of {len(rows)} ranks not shown: no growth, no outlier; verdicts: "
                     + ", ".join(f"{v} {k}" for k, v in sorted(verdicts.items())) + "; every rank: ranks.csv)")
    return "\n".join(lines)


def memory_rows(run_dir: str | Path) -> list[dict[str, Any]]:
    """One dict per rank with a plan or a measured breakdown: ``rank``, ``coords``,
    ``predicted_bytes`` (the plan's peak, None without a plan), ``measured_bytes`` (the profiler's
    peak at the breakdown step, None without one), ``step``, ``error`` (measured / predicted − 1),
    and the measured bytes by category at the peak (``parameters``, ``gradients``,
    ``optimizer_state``, ``activations``, ``temporaries``, ``other``: inputs and unknown). Raises
    :class:`ReportError` naming a plan or breakdown file that cannot be read."""
    plan_path = Path(run_dir) / PLAN_FILE
    try:
        return _memory_rows(run_dir, plan_path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # JSONDecodeError is a ValueError
        raise ReportError(f"cannot read {plan_path} or {Path(run_dir) / 'metrics'}'s memory breakdowns: "
                          f"{type(e).__name__}: {e}; not written by ray_titan, or damaged (move them away to "
                          "report without them)") from None


def _memory_rows(run_dir: str | Path, plan_path: Path) -> list[dict[str, Any]]:
    planned = sorted(json.loads(plan_path.read_text())["ranks"], key=lambda r: int(r["rank"])) \
        if plan_path.is_file() else []
    measured = read_breakdowns(run_dir)
    rows = []
    # A mesh over LISTED_RANKS has one plan per span of ranks: its first rank's row, and the
    # measured ranks' inside it.
    for rank in sorted({r["rank"] for r in planned} | set(measured)):
        p, m = planned_rank(planned, rank), measured.get(rank)
        coords = (p or m or {}).get("coords", {})
        at = m["at_peak"] if m else {}
        predicted: int | None = int(p["peak"]) if p else None
        peak: int | None = int(m["peak_bytes"]) if m else None
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


def _collapse(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs of consecutive ranks with the same plan and no measurement as one row, its ``rank``
    ``"first-last"`` and its ``coords`` the first rank's (ranks of one stage share a plan)."""
    out: list[dict[str, Any]] = []
    same = [k for k in rows[0] if k not in ("rank", "coords")] if rows else []
    for r in rows:
        prev = out[-1] if out else None
        if (prev is not None and r["measured_bytes"] is None and prev["measured_bytes"] is None
                and all(prev[k] == r[k] for k in same) and prev["_last"] + 1 == r["rank"]):
            prev["_last"] = r["rank"]
            continue
        out.append({**r, "_last": r["rank"]})
    return [{**{k: v for k, v in r.items() if k != "_last"},
             "rank": r["rank"] if r["_last"] == r["rank"] else f"{r['rank']}-{r['_last']}"} for r in out]


def format_memory_table(rows: list[dict[str, Any]], limit: int = PER_RANK_LIMIT) -> str:
    """:func:`memory_rows` as an aligned text table (MiB); empty when there are none. Beyond
    ``limit`` rows, runs of consecutive ranks with the same plan and no measurement are one row
    (``rank`` ``"first-last"``)."""
    if not rows:
        return ""
    if len(rows) > limit:
        rows = _collapse(rows)
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


_REPORT_COLUMNS = [
    "step", "rank", *COORD_AXES, "step_loss", "step_val_loss", "step_time_s", "metrics_time_s", "memory_verdict",
    "memory_slope_mib_per_step", "memory_oom_step", "host_rss_bytes", "host_peak_rss_bytes", "host_heap_free_bytes",
    "device_allocated_bytes", "device_peak_reserved_bytes", "gc_generation", "gc_pause_s",
]


class ReportError(ValueError):
    """A run file the report cannot read (corrupt, truncated, of another schema, a symbolic link
    loop): the message names the file and what is wrong with it."""


def _read_metrics(run_dir: str | Path) -> pa.Table:
    """The report's columns of the run's metrics, each of the type ray_titan writes; raises
    :class:`ReportError` naming the file for anything else."""
    where = Path(run_dir) / "metrics"
    try:
        t = read_steps(run_dir, columns=_REPORT_COLUMNS)
    except (pa.ArrowException, OSError) as e:  # truncated, empty, not Parquet, ELOOP, EACCES
        raise ReportError(f"cannot read the metrics in {where}: {str(e).rstrip('.')}; not a table this "
                          "ray_titan wrote, or damaged") from None
    link = where / "steps.parquet"
    if t.num_rows == 0 and link.is_symlink() and not link.exists():  # pyarrow sees no file at all
        raise ReportError(f"{link} is a symbolic link that leads nowhere (a loop, or a missing target)")
    missing = [c for c in ("step", "rank") if c not in t.column_names]
    if missing:
        raise ReportError(f"the metrics in {where} have no {missing[0]!r} column; not a table ray_titan wrote")
    for i, name in enumerate(t.column_names):
        want = STEP_SCHEMA.field(name).type
        if t.schema.field(name).type != want:
            try:
                t = t.set_column(i, name, t[name].cast(want))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                raise ReportError(f"the metrics in {where}: column {name!r} is {t.schema.field(name).type}, "
                                  f"not {want}; not a table ray_titan wrote") from None
    return t


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> tuple[list[Path], list[dict[str, Any]]]:
    """Write ``loss.png`` and ``memory.png`` to ``out_dir`` (default ``<run_dir>/report``), and
    beyond :data:`PER_RANK_LIMIT` ranks the heatmaps of :func:`rank_figures` and ``ranks.csv``
    (every rank's summary row), and return their paths and :func:`summary_rows`. Reads only the
    columns it plots. Raises ``FileNotFoundError`` if the run has no recorded steps,
    :class:`ReportError` if its metrics cannot be read (corrupt, truncated, not ray_titan's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = _read_metrics(run_dir)
    if t.num_rows == 0:
        raise FileNotFoundError(f"{run_dir}: no metrics (metrics/steps.parquet or metrics/parts/)")
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    axes = _axes(t)
    rows = summary_rows(t)

    first_rank = t.filter(pc.equal(t["rank"], pc.min(t["rank"]))).sort_by("step")
    first = {c: first_rank[c].to_pylist() for c in ("step", "step_loss", "step_val_loss") if c in t.column_names}
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

    if len(rows) > PER_RANK_LIMIT:
        paths = [out / "loss.png", *rank_figures(t, out, Path(run_dir).name)]
        csv = out / "ranks.csv"
        pacsv.write_csv(pa.Table.from_pylist(rows), csv)
        return [*paths, csv], rows

    fig, ax = plt.subplots(figsize=(9, 5))
    what, dashed = "memory", False
    for rank, r in _rank_tables(t).items():
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
    return [out / "loss.png", out / "memory.png"], rows


def _grid(t: pa.Table, values: np.ndarray, bins: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(grid, ranks, steps)``: ``values`` (one per row of ``t``) on a rank × step grid of at
    most ``bins`` cells, each the maximum of the rows that fall in it (NaN: none), and the
    distinct ranks and steps it spans."""
    rank, step = t["rank"].to_numpy(), t["step"].to_numpy()
    ranks, steps = np.unique(rank), np.unique(step)
    nr, ns = min(len(ranks), bins[0]), min(len(steps), bins[1])
    rb = np.searchsorted(ranks, rank) * nr // len(ranks)
    sb = np.searchsorted(steps, step) * ns // len(steps)
    grid = np.full((nr, ns), np.nan)
    np.fmax.at(grid, (rb, sb), values)
    return grid, ranks, steps


def _stage_step_medians(stage: np.ndarray, step: np.ndarray, values: np.ndarray) -> np.ndarray:
    """For every row, the median of ``values`` over the rows of its (stage, step)."""
    _, key = np.unique(np.stack([stage, step]), axis=1, return_inverse=True)
    key = key.ravel()
    order = np.argsort(key, kind="stable")
    first = np.flatnonzero(np.r_[True, key[order][1:] != key[order][:-1]])
    return _block_medians(values[order], first)[key]


def rank_figures(t: pa.Table, out: Path, title: str, bins: tuple[int, int] = HEATMAP_BINS) -> list[Path]:
    """Write ``memory.png`` (the series the memory verdict watches, MiB) and ``step_time.png``
    (seconds) as rank × step heatmaps (rank on the y axis, pipeline stages' first ranks marked,
    binned to at most ``bins`` cells, each a bin's maximum), each beside the same grid as percent
    of the rank's stage's median at that step, with :func:`outlier_ranks` marked on the y axis
    and listed below. Returns their paths."""
    import matplotlib.pyplot as plt

    outliers = outlier_ranks(t)
    name, mem = _memory_values(t)
    stage_first = (t.group_by("pp").aggregate([("rank", "min")])["rank_min"].to_numpy()
                   if "pp" in t.column_names else np.zeros(0))
    paths = []
    stage = t["pp"].to_numpy() if "pp" in t.column_names else np.zeros(t.num_rows, np.int64)
    for fname, what, values, unit in (("memory.png", "memory", mem / MiB, f"{name} (MiB)"),
                                      ("step_time.png", "step time", _floats(t, "step_time_s"), "step time (s)")):
        fig, (ax, ax_rel) = plt.subplots(1, 2, figsize=(15, 6), sharey=True)
        grid, ranks, steps = _grid(t, values, bins)
        extent = (steps[0] - 0.5, steps[-1] + 0.5, ranks[0], ranks[-1] + 1)
        lo, hi = np.nanpercentile(grid, [0.5, 99.9]) if np.isfinite(grid).any() else (0.0, 1.0)
        im = ax.imshow(grid, aspect="auto", origin="lower", interpolation="nearest", cmap="viridis", vmin=lo,
                       vmax=max(hi, lo + 1e-9), extent=extent)
        fig.colorbar(im, ax=ax, label=unit + ", max per cell", extend="max")
        # Beside it, each value against its stage's median at that step: an outlier stands out
        # there even where stages differ more than it does from its own.
        rel, _, _ = _grid(t, 100 * (values / _stage_step_medians(stage, t["step"].to_numpy(), values) - 1), bins)
        lim = max(5.0, float(np.nanmax(np.abs(rel))) if np.isfinite(rel).any() else 5.0)
        im = ax_rel.imshow(rel, aspect="auto", origin="lower", interpolation="nearest", cmap="RdBu_r", vmin=-lim,
                           vmax=lim, extent=extent)
        fig.colorbar(im, ax=ax_rel, label="% vs the stage's median at the step, max per cell")
        if 1 < len(stage_first) <= 64:
            for r in stage_first[1:]:
                ax.axhline(r, color="white", lw=0.4, alpha=0.6)
        binned = f" ({grid.shape[0]} × {grid.shape[1]} cells)" if grid.shape != (len(ranks), len(steps)) else ""
        ax.set(xlabel="step", ylabel="rank", title=f"{title}: {what}, {len(ranks)} ranks × {len(steps)} steps{binned}")
        ax_rel.set(xlabel="step", title=f"{what} against its pipeline stage")
        mine = [o for o in outliers if o["what"] == what]
        for o in mine:
            ax.annotate("", xy=(steps[0] - 0.5, o["rank"] + 0.5), xytext=(-14, 0), textcoords="offset points",
                        arrowprops={"arrowstyle": "->", "color": "red"}, annotation_clip=False)
        listed = "\n".join(f"rank {o['rank']} (pp={o['pp']}): {o['why']}" for o in mine[:20])
        more = f"\n… and {len(mine) - 20} more" if len(mine) > 20 else ""
        fig.text(0.01, 0.01, (f"outliers ({what} robust z > {OUTLIER_Z:g} within the stage, "
                              f"> {OUTLIER_MIN_REL:.0%} off its median; red arrows):\n" + listed + more)
                 if mine else f"no {what} outlier (robust z > {OUTLIER_Z:g} within a stage)", fontsize=7, va="bottom")
        fig.tight_layout(rect=(0, 0.04 + 0.018 * min(len(mine), 21), 1, 1))
        fig.savefig(out / fname, dpi=120)
        plt.close(fig)
        paths.append(out / fname)
    return paths

