"""The metrics collector: one place that sees every rank at every step.

Used as a Ray actor (``ray.remote(MetricsCollector).options(num_cpus=0)``, owned by the driver)
or as a plain object in-process. Workers call :meth:`MetricsCollector.report` with batches of
step reports; when every rank has reported a step, the collector assembles it:

- loss: the token-weighted mean of the losses of the ranks that hold the last pipeline stage
  (given by the stage-to-rank mapping, ``last_stage_ranks``; weighted by their counted labels,
  ``loss_tokens``, under loss masks), and their max, each data-parallel rank counted once: the tp
  ranks of one tensor-parallel group hold the same loss and the same tokens, so only the one at
  ``tp = 0`` is counted (:func:`counted_rows`). A last-stage rank
  without a loss, or a non-last-stage rank with one, is recorded as an error, not filled in.
- tokens/s: tokens of the step (summed over the last stage's DP ranks) over the slowest rank's
  step time.
- one row per rank (timings, memory, GC pause) to Parquet, scalars to TensorBoard, and a console
  line at the first step, every ``log_freq`` steps and at the last step, which the driver drains
  and prints.
- each rank's measured memory breakdown (``memory.breakdown_step``), kept in
  ``metrics/memory_breakdown.jsonl`` as it arrives and returned by :meth:`MetricsCollector.finish`.
- a memory verdict per rank (``ray_titan.metrics.leak``: warming_up / stable / growing, MiB per
  step, projected OOM step) in every row and in TensorBoard, and a console line whenever a rank's
  verdict changes. With ``on_leak = "stop"`` a ``growing`` verdict sets :attr:`stop_reason`,
  which every later :meth:`MetricsCollector.report` call returns to the workers.

Fault tolerance. Every report carries its worker group's ``attempt_start_time``: after a worker
group restart, the replayed steps' reports supersede the lost attempt's (pending ones are
dropped, assembled rows are replaced when the table is consolidated). :meth:`report` answers
with the collector's incarnation and, per attempt, the step up to which rows are on disk; workers
hold their reports until then and resend them to a restarted collector. A collector restarted by
Ray (``max_restarts``) resumes from its flushed parts: it knows which steps are on disk and
ignores their resent reports.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import uuid
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute

from ray_titan import storage
from ray_titan.metrics import ray_metrics
from ray_titan.metrics.leak import (
    GROWING,
    VERDICTS,
    LeakMonitor,
    Verdict,
    describe_coords,
    leak_settings,
)
from ray_titan.metrics.report import MEMORY_FIELDS, MOE_PAD, PACKED_FIELDS, pack_reports
from ray_titan.metrics.sinks import (
    ParquetSink,
    TensorBoardSink,
    WandbSink,
    expert_load_scalars,
    latest_rows,
    read_raw_parts,
    step_scalars,
)
from ray_titan.metrics.step_table import StepColumns, StepTableBuffer

__all__ = [
    "BREAKDOWN_FILE", "CONSOLE_RANKS", "MetricsCollector", "counted_rows", "expert_load", "format_scale_line",
    "format_step_line", "memory_summary_scalars", "read_breakdowns", "validation_summary",
]

BREAKDOWN_FILE = "memory_breakdown.jsonl"
"""Every rank's measured memory breakdown (``memory.breakdown_step``), one JSON line each, in
``<run_dir>/metrics/``."""


def read_breakdowns(run_dir: str | Path) -> dict[int, dict[str, Any]]:
    """``{rank: breakdown}`` from ``<run_dir>/metrics/memory_breakdown.jsonl`` (the newest line of
    a rank wins: a replayed step after a restart); empty if there is none."""
    path = Path(run_dir) / "metrics" / BREAKDOWN_FILE
    out: dict[int, dict[str, Any]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                b = json.loads(line)
                out[b["rank"]] = b
    return dict(sorted(out.items()))

MiB = 2**20
_STOPPED = "run stopped: "


def counted_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows that speak for their data-parallel rank: under tensor parallel the ranks of one
    tp group (same coordinates but ``tp``) compute the same loss, route the same tokens and read
    the same batch, so only ``tp = 0`` is kept; without TP, every row."""
    return [r for r in rows if r["coords"].get("tp", 0) == 0]


def expert_load(rows: list[dict[str, Any]]) -> dict[int, list[int]]:
    """A step's expert load per MoE layer: tokens (× top-k) routed to each expert, summed over
    the ranks holding the layer (every data-parallel rank routes its own tokens). ``rows`` are the
    step's rows (dicts with ``moe_layers`` and ``expert_load``); empty for a dense model."""
    out: dict[int, list[int]] = {}
    for r in rows:
        for layer, counts in zip(r.get("moe_layers") or [], r.get("expert_load") or []):
            acc = out.setdefault(layer, [0] * len(counts))
            for e, c in enumerate(counts):
                acc[e] += c
    return dict(sorted(out.items()))


def validation_summary(last: list[dict[str, Any]]) -> dict[str, float | None]:
    """``{"val/loss", "val/perplexity"}`` of a step from its last-stage ranks' reports: the
    token-weighted mean of their validation losses and its exponential; None at steps without
    an evaluation."""
    with_val = [r for r in last if r.get("val_loss") is not None and r.get("val_tokens")]
    tokens = sum(r["val_tokens"] for r in with_val)
    if not tokens:
        return {"val/loss": None, "val/perplexity": None}
    loss = sum(r["val_loss"] * r["val_tokens"] for r in with_val) / tokens
    return {"val/loss": loss, "val/perplexity": math.exp(min(loss, 700.0))}


def _step_figures(step: int, total: int, s: dict[str, Any], memory: str) -> str:
    """The head of a step's console line: loss, throughput, step time, LR, gradient norm, then
    ``memory`` (the ranks' host memory), the MoE imbalance, validation and a skipped update."""
    loss = "loss     n/a" if s["loss"] is None else f"loss {s['loss']:8.4f}"
    line = (
        f"step {step:>{len(str(total))}}/{total} | {loss} | {s['tokens_per_s']:9.0f} tok/s | "
        f"step {s['step_time_s']:.3f}s | lr {s['lr']:.2e} | gnorm {s['grad_norm']:.3f} | {memory}"
    )
    if s.get("moe_imbalance") is not None:
        line += f" | moe load max/mean {s['moe_imbalance']:.2f}"
    if s.get("val/loss") is not None:
        line += f" | val loss {s['val/loss']:.4f} (ppl {s['val/perplexity']:.2f})"
    if s.get("skipped"):
        line += " | update skipped (non-finite)"
    return line


def format_step_line(step: int, total: int, s: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The console line of a step: loss of the last stage, throughput, times, and every rank's
    memory (host RSS, and device allocated / peak reserved where there is a device)."""
    mem = " ".join(f"r{r['rank']}:{r['host_rss_bytes'] / MiB:.0f}" for r in rows)
    line = _step_figures(step, total, s, f"rss MiB {mem}")
    if rows[0].get("device_allocated_bytes") is not None:
        dev = " ".join(
            f"r{r['rank']}:{r['device_allocated_bytes'] / MiB:.0f}/{r['device_peak_reserved_bytes'] / MiB:.0f}"
            for r in rows
        )
        line += f" | dev alloc/peak MiB {dev}"
    return line


CONSOLE_RANKS = 16
"""Up to this many ranks the console line names every rank's memory; beyond, it summarises."""
GROWING_CODE = 2  # index of GROWING in leak's codes
_F = {name: i for i, name in enumerate(PACKED_FIELDS)}


class _Columns:
    """A step's packed reports (:func:`~ray_titan.metrics.report.pack_reports`) by column name."""

    def __init__(self, values: np.ndarray, null: np.ndarray):
        self.values, self.nulls = values, null

    def get(self, name: str) -> np.ndarray:
        """float64 ``(ranks,)``; NaN where a report had None."""
        return self.values[:, _F[name]]

    def null(self, name: str) -> np.ndarray:
        return self.nulls[:, _F[name]]

    def int(self, name: str) -> np.ndarray:
        """int64 ``(ranks,)``; 0 where a report had None."""
        k = _F[name]
        return np.where(self.nulls[:, k], 0.0, self.values[:, k]).astype(np.int64)


def _expert_load(objects: list[tuple]) -> dict[int, list[int]]:
    """:func:`expert_load` of the packed objects of a step's counted rows, summed in numpy by the
    layers each rank holds (a pipeline stage's ranks hold the same layers)."""
    groups: dict[tuple[int, ...], list] = {}
    for o in objects:
        if o[1]:
            groups.setdefault(tuple(o[1]), []).append(o[2])
    out: dict[int, np.ndarray] = {}
    for layers, loads in groups.items():
        total: np.ndarray | list[np.ndarray]
        try:
            total = np.asarray(loads, dtype=np.int64).sum(axis=0)  # (layers, experts)
        except ValueError:  # ragged: expert counts differ between layers
            total = [np.sum([x[i] for x in loads], axis=0) for i in range(len(layers))]
        for layer, counts in zip(layers, total):
            out[layer] = out[layer] + counts if layer in out else np.asarray(counts)
    return {layer: [int(x) for x in out[layer]] for layer in sorted(out)}


def _with_moe_lists(objects: list[tuple], moe: tuple[np.ndarray, np.ndarray]) -> list[tuple]:
    """A part's objects with ``moe_layers`` and ``expert_load`` taken back from its blocks."""
    keep = moe[0] != MOE_PAD
    return [(o[0], lay[k].tolist(), load[k].tolist(), o[3], o[4])
            for o, lay, load, k in zip(objects, moe[0], moe[1], keep)]


def _moe_blocks(parts: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray] | None:
    """The parts' ``moe`` blocks stacked, padded to the most layers (:data:`MOE_PAD`: pipeline
    stages hold different numbers of MoE layers); None where a part has none, or where layers
    count different numbers of experts."""
    blocks = [p.get("moe") for p in parts]
    if any(b is None for b in blocks):
        return None
    most = max(b[0].shape[1] for b in blocks)  # type: ignore[index]
    experts = {b[1].shape[2] for b in blocks if (b[0] != MOE_PAD).any()}  # type: ignore[index]
    if len(experts) > 1:
        return None
    e = experts.pop() if experts else 0
    layers, loads = [], []
    for lay, load in blocks:  # type: ignore[misc]
        n, k = lay.shape
        if k != most or load.shape[2] != e:
            padded = np.zeros((n, most, e), np.int64)
            padded[:, :k] = load if load.shape[2] == e else 0
            lay, load = np.pad(lay, ((0, 0), (0, most - k)), constant_values=MOE_PAD), padded
        layers.append(lay)
        loads.append(load)
    return np.concatenate(layers), np.concatenate(loads)


def _expert_load_blocks(layers: np.ndarray, load: np.ndarray) -> dict[int, list[int]]:
    """:func:`expert_load` of the counted rows' blocks: ``layers`` (ranks, L), ``load`` (ranks, L, E)."""
    if not layers.size:
        return {}
    out: dict[int, np.ndarray] = {}
    held, inverse = np.unique(layers, axis=0, return_inverse=True)  # one row per pipeline stage
    for g, row in enumerate(held):
        total = load[inverse.reshape(-1) == g].sum(axis=0)
        for layer, counts in zip(row.tolist(), total):
            if layer != MOE_PAD:
                out[layer] = out[layer] + counts if layer in out else counts
    return {layer: out[layer].tolist() for layer in sorted(out)}


_SINK_FIELDS = ("rank", "host_rss_bytes", "host_peak_rss_bytes", "device_allocated_bytes", "device_reserved_bytes",
                "device_peak_active_bytes", "device_peak_reserved_bytes", "gc_generation", "gc_pause_s")
_SINK_INDEX = np.array([_F[k] for k in _SINK_FIELDS])


def _sink_rows(c: _Columns, code: np.ndarray, slope: np.ndarray, at: np.ndarray) -> list[dict[str, Any]]:
    """The rows of the step's ranks ``at`` (indices, int ``(k,)``) with the fields the console
    line and the per-rank series read (:func:`format_step_line`,
    :func:`~ray_titan.metrics.sinks.step_scalars`): rank, memory (bytes), GC, verdict and slope
    (MiB per step); None where a report had none."""
    values = c.values[np.ix_(at, _SINK_INDEX)].tolist()
    nulls = c.nulls[np.ix_(at, _SINK_INDEX)].tolist()
    rows = []
    for i, vs, ns in zip(at.tolist(), values, nulls):
        row: dict[str, Any] = {k: None if null else v if k == "gc_pause_s" else int(v)
                               for k, v, null in zip(_SINK_FIELDS, vs, ns)}
        row["memory_verdict"] = VERDICTS[int(code[i])]
        row["memory_slope_mib_per_step"] = None if math.isnan(slope[i]) else float(slope[i])
        rows.append(row)
    return rows


def _max_memory(c: _Columns) -> dict[str, Any] | None:
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


def _extremes(c: _Columns, key: str, at: np.ndarray | None = None) -> str | None:
    """``"min 2900 (r5) / med 3000 / max 3400 (r1)"`` of a memory field in MiB over the ranks
    (``at``: a mask of them), None where no rank has it."""
    v, ranks = c.get(key), c.get("rank")
    if at is not None:
        v, ranks = v[at], ranks[at]
    ok = ~np.isnan(v)
    if not ok.any():
        return None
    v, ranks = v[ok] / MiB, ranks[ok]
    lo, hi = int(np.argmin(v)), int(np.argmax(v))
    return f"min {v[lo]:.0f} (r{ranks[lo]:.0f}) / med {np.median(v):.0f} / max {v[hi]:.0f} (r{ranks[hi]:.0f})"


def format_scale_line(step: int, total: int, s: dict[str, Any], c: _Columns, code: np.ndarray) -> str:
    """The console line of a step of more than :data:`CONSOLE_RANKS` ranks: the step's figures as
    :func:`format_step_line`'s, then min / median / max of host RSS and of device allocated and
    peak reserved memory (MiB) with the ranks at the extremes, the verdict counts with every
    ``growing`` rank named, and per pipeline stage the largest RSS and device peak."""
    line = _step_figures(step, total, s, f"{len(code)} ranks | rss MiB {_extremes(c, 'host_rss_bytes')}")
    for key, what in (("device_allocated_bytes", "dev alloc"), ("device_peak_reserved_bytes", "dev peak")):
        text = _extremes(c, key)
        if text:
            line += f" | {what} MiB {text}"
    counts = np.bincount(code.astype(np.int64), minlength=3)
    growing = c.get("rank")[code == GROWING_CODE].astype(np.int64).tolist()
    line += f" | memory {counts[1]} stable, {counts[0]} warming_up, {counts[2]} growing"
    if growing:
        line += f" ({', '.join(f'r{r}' for r in growing)})"
    pp = c.int("pp")
    stages = []
    dev = not c.null("device_peak_reserved_bytes").all()
    for stage in np.unique(pp).tolist():
        at = pp == stage
        key = "device_peak_reserved_bytes" if dev else "host_rss_bytes"
        v = c.get(key)[at]
        i = int(np.nanargmax(v))
        stages.append(f"pp{stage} {v[i] / MiB:.0f} (r{c.get('rank')[at][i]:.0f})")
    line += f" | max {'dev peak' if dev else 'rss'} MiB by stage: " + ", ".join(stages)
    return line


def memory_summary_scalars(c: _Columns, code: np.ndarray) -> list[tuple[str, float]]:
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
    counts = np.bincount(code.astype(np.int64), minlength=3)
    out += [(f"memory/ranks_{v}", float(k)) for v, k in zip(VERDICTS, counts.tolist())]
    return out


def _newest_reports(parts: list[dict[str, Any]]) -> tuple[_Columns, list[tuple], tuple | None, list[str]]:
    """A step's packed reports (:func:`~ray_titan.metrics.report.pack_reports`, one part per call
    that brought some) joined, keeping each rank's newest report (a resent duplicate collapses),
    in rank order: the columns, each rank's objects, the MoE load blocks (None where ragged) and
    the mesh axes."""
    values = np.concatenate([p["values"] for p in parts])
    null = np.concatenate([p["null"] for p in parts])
    moe = _moe_blocks(parts)
    # Where layers count different numbers of experts the step goes element by element: the
    # parts' blocks back into the objects.
    objects = [o for p in parts for o in (p["objects"] if moe is not None or p.get("moe") is None
                                          else _with_moe_lists(p["objects"], p["moe"]))]
    ranks_all = values[:, _F["rank"]].astype(np.int64)
    if len(ranks_all) > 1 and not (ranks_all[1:] > ranks_all[:-1]).all():  # not already one per rank in order
        rev = len(ranks_all) - 1 - np.unique(ranks_all[::-1], return_index=True)[1]
        values, null = values[rev], null[rev]
        objects = [objects[i] for i in rev.tolist()]
        if moe is not None:
            moe = (moe[0][rev], moe[1][rev])
    if moe is None:  # ragged MoE shapes: element by element
        objects = [(o[0], o[1] or [], o[2] or [], o[3], o[4]) for o in objects]
    return _Columns(values, null), objects, moe, parts[0]["axes"]


class MetricsCollector:
    """Assembles steps from all ranks' reports and writes them to the sinks.

    Args:
        run_dir: the run directory; metrics go to ``metrics/`` and ``tb/`` inside it. A remote URI
            (``s3://...``, see :mod:`ray_titan.storage`) is written through a local staging
            directory that is uploaded at every flush and at the end.
        world_size: number of ranks that report every step (an elastic run's largest; each
            report names its own worker group's size).
        last_stage_ranks: global ranks holding the last pipeline stage, or for an elastic run
            ``{world size: those ranks}`` for every worker count it may run on.
        total_steps: steps of the run (for the console line).
        log_freq: console line every this many steps.
        flush_every_steps: Parquet part and TensorBoard flush every this many assembled steps.
        enable_tensorboard: write TensorBoard event files.
        leak: settings of the memory verdict, keyword arguments of
            :class:`~ray_titan.metrics.leak.LeakMonitor` (default: its defaults in ``[memory]``).
        on_leak: ``"warn"`` or ``"stop"`` (see the module docstring).
        kill_at_step: fault injection (``debug.kill_collector_at_step``): SIGKILL this actor when
            it assembles that step, in its first life only.
        nice: lower this process's CPU priority by this much (``os.nice``) first; for the Ray
            actor (``metrics.collector_nice``), not for a collector inside a worker.
        wandb: :class:`~ray_titan.metrics.sinks.WandbSink`'s arguments (``wandb_settings``) to
            also log every step to Weights & Biases; None: no W&B.
        series_max_ranks: ``metrics.series_max_ranks``: TensorBoard and W&B get every rank's
            memory series (and every expert's share of its MoE layer's load) up to this many
            ranks; beyond, per-stage and overall summaries (:func:`memory_summary_scalars`), the
            ``growing`` ranks' own series and each MoE layer's max / mean load.
        first_step: the run's first step (1 for a run that does not resume from a checkpoint):
            the completeness check counts steps missing from there, not only from the first one
            recorded; None: unknown (from the first recorded).
    """

    MAX_ERRORS = 1000

    def __init__(
        self,
        run_dir: str,
        world_size: int,
        last_stage_ranks: list[int] | dict[int, list[int]],
        total_steps: int,
        log_freq: int = 10,
        flush_every_steps: int = 20,
        enable_tensorboard: bool = True,
        leak: dict[str, Any] | None = None,
        on_leak: str = "warn",
        kill_at_step: int | None = None,
        nice: int = 0,
        wandb: dict[str, Any] | None = None,
        series_max_ranks: int = 64,
        first_step: int | None = None,
    ):
        if nice:
            os.nice(nice)
        self.mirror = None
        if storage.is_remote(run_dir):
            self.mirror = storage.Mirror(storage.staging_dir(run_dir), run_dir)
            run_dir = str(self.mirror.local_dir)
        self.run_dir = Path(run_dir)
        self.last_by_size = ({n: sorted(r) for n, r in last_stage_ranks.items()} if isinstance(last_stage_ranks, dict)
                             else {world_size: sorted(last_stage_ranks)})
        self.world_size, self.last = world_size, self.last_by_size[world_size]
        self._last_tables: dict[int, np.ndarray] = {}
        self._layout_shown: set[float] = set()
        self.total_steps, self.log_freq, self.flush_every = total_steps, log_freq, flush_every_steps
        self.parquet = ParquetSink(self.run_dir / "metrics")
        self.rows = StepTableBuffer()  # assembled steps until the next flush
        self.tb = TensorBoardSink(self.run_dir / "tb") if enable_tensorboard else None
        self.wandb = WandbSink(self.run_dir, **wandb) if wandb else None
        self._pending: dict[int, list[dict[str, Any]]] = {}  # step -> packed parts (pack_reports)
        self._seen: dict[int, set[int]] = {}  # step -> ranks with a pending report
        self._sizes: dict[int, int] = {}  # step -> ranks of its worker group
        self._aggregator_dropped: dict[str, int] = {}
        self._lines: list[tuple[int | None, str]] = []  # (step it belongs to, text)
        self.errors: list[str] = []
        self.errors_total = 0
        self.assembled = 0
        self.last_step = 0
        self.final_loss: float | None = None
        self.latest: dict[str, Any] | None = None
        self.dropped: dict[int, int] = {}
        self._since_flush = 0
        self._closed = False
        self._mesh_written = False
        self.leak = LeakMonitor(**(leak or leak_settings()))
        self.on_leak = on_leak
        self.series_max_ranks = series_max_ranks
        self.first_step = first_step
        self.stop_reason: str | None = None

        self.incarnation = uuid.uuid4().hex
        self.kill_at_step = kill_at_step
        self._pending_attempt: dict[int, float] = {}  # step -> attempt of its pending reports
        self._done: dict[int, float] = {}  # step -> newest attempt assembled for it
        self._unflushed: list[tuple[float, int]] = []
        self._flushed: dict[float, set[int]] = {}
        self._durable: dict[float, int] = {}  # attempt -> every step from _first[attempt] to this is on disk
        self._first: dict[float, int] = {}
        self._errors_path = self.run_dir / "metrics" / "errors.jsonl"
        self._write_errors: set[str] = set()
        self._errors_unwritten = False
        self._breakdowns_unwritten = False
        self._write_failing = False  # the last Parquet flush failed (a full disk)
        self._breakdown_path = self.run_dir / "metrics" / BREAKDOWN_FILE
        self.breakdowns: dict[int, dict[str, Any]] = {}
        self.restarted = _reconstructed()
        self._newest_attempt = float("-inf")
        self._resume()

    # -- worker-facing -------------------------------------------------------------------------
    def report(self, batch: list[dict[str, Any]] | dict[str, Any], dropped: int = 0,
               flush: bool = False) -> dict[str, Any]:
        """Accept a batch of step reports: a list of ``StepReport.to_dict()`` from one rank, or a
        group's reports in columns (:func:`~ray_titan.metrics.report.pack_reports`, from a
        :class:`~ray_titan.metrics.report.MetricsAggregator`, whose own dropped reports are
        ``dropped``); ``flush`` writes what is assembled to disk now.

        Returns ``{"incarnation": id of this collector life, "durable": {attempt_start_time:
        step}, "stop": reason or None}``: every step up to ``step`` of that attempt is on disk;
        ``stop`` is set once the run must stop (the memory verdict under ``on_leak = "stop"``);
        ``write_failing``: the last flush failed, so rows wait in memory for room on disk.
        """
        packed: dict[str, Any] | None
        if isinstance(batch, dict):
            packed = batch
            if dropped:  # the aggregator's own count so far
                self._aggregator_dropped[packed.get("sender", "")] = dropped
        else:
            packed = pack_reports(batch, dropped) if batch else None
        if packed is not None and len(packed["objects"]):
            self._accept(packed)
        for step in sorted(s for s, seen in self._seen.items() if len(seen) == self._sizes[s]):
            self._pending_attempt.pop(step)
            del self._seen[step], self._sizes[step]
            self._assemble(step, self._pending.pop(step))
        if flush:
            self.flush()
        return {"incarnation": self.incarnation, "durable": dict(self._durable), "stop": self.stop_reason,
                "write_failing": self._write_failing}

    def _accept(self, packed: dict[str, Any]) -> None:
        """File a packed batch's reports under their steps: a step's reports of one attempt only
        (a restarted worker group's replay supersedes the lost attempt's), none of a step already
        assembled by that attempt or a newer one."""
        v = packed["values"]
        step_col, attempt_col, rank_col = v[:, _F["step"]], v[:, _F["attempt_start_time"]], v[:, _F["rank"]]
        drops = v[:, _F["dropped"]]
        for r in np.nonzero(drops > 0)[0].tolist():
            self.dropped[int(rank_col[r])] = int(drops[r])
        if (step_col == step_col[0]).all() and (attempt_col == attempt_col[0]).all():
            pairs = [(float(attempt_col[0]), float(step_col[0]))]  # an aggregator's batch: one step
        else:  # sorted by attempt, then step
            pairs = np.unique(np.column_stack([attempt_col, step_col]), axis=0).tolist()
        for attempt, fstep in pairs:
            step = int(fstep)
            if attempt > self._newest_attempt:
                self._new_attempt(attempt, step)
            if self._assembled_by(step) >= attempt:
                continue  # resent or superseded reports of a step already assembled
            if self._pending_attempt.get(step, attempt) < attempt:  # a restarted worker group replays this step
                self._pending.pop(step, None)
                self._seen.pop(step, None)
            elif self._pending_attempt.get(step, attempt) > attempt:
                continue
            at = np.nonzero((step_col == fstep) & (attempt_col == attempt))[0]
            part = at if len(at) < len(v) else slice(None)
            self._pending_attempt[step] = attempt
            self._pending.setdefault(step, []).append(
                {"values": v[part], "null": packed["null"][part], "axes": packed["axes"],
                 "moe": None if packed.get("moe") is None else (packed["moe"][0][part], packed["moe"][1][part]),
                 "objects": packed["objects"] if isinstance(part, slice) else [packed["objects"][i] for i in at]})
            self._seen.setdefault(step, set()).update(rank_col[part].astype(np.int64).tolist())
            size = v[at[0], _F["world_size"]]
            self._sizes[step] = self.world_size if np.isnan(size) or size <= 0 else int(size)

    def stop_run(self, reason: str) -> None:
        """A worker ended the run on purpose (a non-finite loss under ``on_nonfinite = "stop"``):
        recorded, and returned by :meth:`finish` as ``stop_reason`` for the driver to raise."""
        self._error(f"{_STOPPED}{reason}")

    # -- driver-facing -------------------------------------------------------------------------
    def drain_lines(self, shown_step: int = 0) -> list[str]:
        """Console lines produced since the last call. ``shown_step``: the newest step the
        caller has shown; a collector restarted by Ray re-assembles the steps its previous life
        had not flushed, and their lines (and verdict messages) were shown then, so they are
        dropped."""
        lines, self._lines = self._lines, []
        hide = shown_step if self.restarted else 0
        return [text for step, text in lines if step is None or step > hide]

    def poll(self, shown_step: int = 0) -> dict[str, Any]:
        """``{"lines": drain_lines(shown_step), "latest": the newest assembled step's progress}``
        (see :mod:`ray_titan.driver.progress`), one call per driver refresh."""
        return {"lines": self.drain_lines(shown_step), "latest": self.latest}

    def finish(self, shown_step: int = 0) -> dict[str, Any]:
        """Record incomplete steps as errors, flush and close the sinks, and summarise
        (``shown_step``: as for :meth:`drain_lines`).

        Returns ``{"steps": n, "last_step", "final_loss", "errors": [...], "lines": [...],
        "steps_path", "skipped_steps", "steps_run", "restarts", "memory_verdicts", "memory_breakdown"}``
        (``steps_run``: the distinct steps in the table, each one optimizer update;
        ``skipped_steps``: those whose update was dropped, by their newest attempt; ``restarts``:
        worker-group restarts seen in the table; ``memory_breakdown``: ``{rank: breakdown}``).
        Idempotent.
        """
        if not self._closed:
            for step in sorted(self._pending):
                missing = sorted(set(range(self._sizes[step])) - self._seen[step])
                self._error(f"step {step}: no report from rank(s) {_span(missing) if len(missing) > 16 else missing}")
            self._pending.clear()
            self._seen.clear()
            self._sizes.clear()
            if self._aggregator_dropped:
                self._error(f"the metrics aggregators dropped {sum(self._aggregator_dropped.values())} report(s): "
                            "the collector was too slow")
            for rank, n in sorted(self.dropped.items()):
                self._error(f"rank {rank} dropped {n} report(s) before they were on disk: the collector was too "
                            "slow or restarted (raise metrics.max_buffered_reports or lower metrics.flush_every_steps)")
            self._skipped_steps = self._restarts = self._steps_run = 0
            self._stage_rows()
            try:
                steps_path: Path = self.parquet.close()
                self._check_complete(steps_path)
            except OSError as e:  # the flushed parts stay readable (read_steps)
                lost = self.parquet.unflushed_steps()
                self._write_failed(e.strerror or str(e))
                if lost:
                    self._error(f"metrics of steps {lost[0]}..{lost[-1]} could not be written; the steps "
                                f"flushed before are in {self.parquet.parts}")
                steps_path = self.parquet.parts
            if self.tb:
                self._tensorboard(self.tb.close)
            if self.wandb:
                self.wandb.close()
            if self._breakdowns_unwritten:
                try:
                    self._breakdown_path.write_text(
                        "".join(json.dumps(b) + "\n" for b in self.breakdowns.values()), encoding="utf-8")
                except OSError:
                    pass
            if self._errors_unwritten:
                try:
                    self._errors_path.write_text("".join(json.dumps(e) + "\n" for e in self.errors), encoding="utf-8")
                except OSError:
                    pass
            self._sync("at the end")
            self._closed = True
            self._steps_path = str(steps_path)
        return {
            "steps": self.assembled,
            "last_step": self.last_step,
            "final_loss": self.final_loss,
            "errors": list(self.errors),
            "lines": self.drain_lines(shown_step),
            "latest": self.latest,
            "steps_path": self._steps_path,
            "memory_verdicts": self.leak.summary(),
            "memory_breakdown": dict(sorted(self.breakdowns.items())),
            "stop": self.stop_reason,
            "skipped_steps": self._skipped_steps,
            "steps_run": self._steps_run,
            "restarts": self._restarts,
            "collector_restarted": self.restarted,
            "stop_reason": next((e[len(_STOPPED):] for e in self.errors if e.startswith(_STOPPED)), None),
        }

    # -- internals -----------------------------------------------------------------------------
    def _resume(self) -> None:
        """After a restart by Ray: what the previous life flushed is on disk; carry on from it."""
        raw = read_raw_parts(self.parquet.parts)
        self.breakdowns = read_breakdowns(self.run_dir)
        if self._errors_path.is_file():
            self.errors = [json.loads(line) for line in self._errors_path.read_text().splitlines()]
            self.errors_total = len(self.errors)
        if raw.num_rows == 0:
            return
        for attempt, step in zip(raw["attempt_start_time"].to_pylist(), raw["step"].to_pylist()):
            self._done[step] = max(self._done.get(step, float("-inf")), attempt)
            self._flushed.setdefault(attempt, set()).add(step)
        for attempt in self._flushed:
            self._advance_durable(attempt)
        self._newest_attempt = max(self._flushed)
        rows = latest_rows(raw)
        self.assembled = len(set(rows["step"].to_pylist()))
        self.last_step = max(rows["step"].to_pylist())
        self.final_loss = rows.filter(pa.compute.equal(rows["step"], self.last_step))["step_loss"][0].as_py()
        self._lines.append((None, f"ray_titan: metrics collector restarted; {self.assembled} steps were on disk "
                                  f"(up to step {self.last_step})"))
        # The memory verdicts carry on from the flushed rows, instead of warming up again.
        for r in rows.select(["rank", "pp", "dp_shard", "ep"]).to_pylist():
            self.leak.coords[r["rank"]] = {a: r[a] for a in ("pp", "dp_shard", "ep")}
        steps = rows["step"].to_numpy()
        for step in np.unique(steps)[-self.leak.banks["host"].window:].tolist():  # a window is all a verdict holds
            t = rows.filter(pa.array(steps == step))
            self.leak.update_many(step, t["rank"].to_numpy(), {
                k: t[k].to_numpy(zero_copy_only=False).astype(float) for k in MEMORY_FIELDS})
        if self.tb:  # events after the last flush may be torn or partial: the resent reports redo them
            self.tb.close()
            self.tb = TensorBoardSink(self.run_dir / "tb", purge_step=self.last_step + 1)

    def _new_attempt(self, attempt: float, step: int) -> None:
        """A worker group (re)started at ``step``: replayed steps replace the old ones in TensorBoard."""
        if self._newest_attempt > float("-inf"):
            self._lines.append((None, f"ray_titan: worker group restarted; resuming at step {step}"))
            if self.tb and step <= self.last_step:
                self.tb.close()
                self.tb = TensorBoardSink(self.tb.tb_dir, purge_step=step)
        self._newest_attempt = attempt

    def _advance_durable(self, attempt: float) -> None:
        """Move ``attempt``'s watermark over its newly flushed steps, and forget the per-step
        records it now covers (steps ``_first[attempt] .. _durable[attempt]``), so the
        bookkeeping stays as small as the unflushed part of the run."""
        done = self._flushed[attempt]
        if attempt not in self._durable:
            self._durable[attempt] = min(done) - 1
            self._first[attempt] = min(done)
        wm = self._durable[attempt]
        while wm + 1 in done:
            wm += 1
            done.discard(wm)
            if self._done.get(wm) == attempt:
                del self._done[wm]
        self._durable[attempt] = wm

    def _assembled_by(self, step: int) -> float:
        """The newest attempt whose report of ``step`` was assembled (-inf: none)."""
        newest = self._done.get(step, float("-inf"))
        for attempt, wm in self._durable.items():
            if attempt > newest and self._first[attempt] <= step <= wm:
                newest = attempt
        return newest

    def _check_complete(self, steps_path: Path) -> None:
        """Every rank has a row at every step from the run's first (:attr:`first_step`, else the
        first recorded) to the last recorded. Reads the
        table in batches of four int columns, counting rows per step in numpy: memory is one
        batch plus a few integers per step, whatever the ranks (a 16,384-rank, 10k-step table
        has 164M rows)."""
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(steps_path)
        # One row per step and rank, the newest attempt's (consolidate): a step a restart ran again counts once.
        n = np.zeros(0, np.int64)  # rows per step of ranks the step's worker group holds
        size = np.zeros(0, np.int64)
        skipped = np.zeros(0, np.int64)
        self._restarts = 0
        columns = ["step", "rank", "skipped_update", "attempt", "world_size"]
        for b in pf.iter_batches(batch_size=1 << 20, columns=columns):
            step = b["step"].to_numpy()
            if not len(step):
                continue
            ws = pa.compute.fill_null(b["world_size"], 0).to_numpy()
            ws = np.where(ws > 0, ws, self.world_size)
            if step.max() >= len(n):
                grow = int(step.max()) + 1 - len(n)
                n, size, skipped = (np.concatenate([a, np.zeros(grow, np.int64)]) for a in (n, size, skipped))
            n += np.bincount(step, weights=b["rank"].to_numpy() < ws, minlength=len(n)).astype(np.int64)
            np.maximum.at(size, step, ws)
            skipped += np.bincount(step, weights=b["skipped_update"].to_numpy(zero_copy_only=False),
                                   minlength=len(n)).astype(np.int64)
            self._restarts = max(self._restarts, int(pa.compute.max(b["attempt"]).as_py() or 0))
        seen = np.nonzero(size)[0]
        self._skipped_steps = int(np.count_nonzero(skipped))
        self._steps_run = len(seen)
        if not len(seen):
            return
        start = int(seen[0]) if self.first_step is None else max(0, min(self.first_step, int(seen[0])))
        size[size == 0] = self.world_size  # a step with no row at all
        short = [int(x) for x in np.nonzero(n[start:] < size[start:])[0] + start]
        if short:
            self._missing_rows(pf, short, size)

    def _missing_rows(self, pf: Any, short: list[int], size: np.ndarray) -> None:
        """An error per step of ``short`` naming the ranks with no row (a second pass, reading
        those steps' ranks only)."""
        have: dict[int, set[int]] = {s: set() for s in short}
        for b in pf.iter_batches(batch_size=1 << 20, columns=["step", "rank"]):
            keep = pa.compute.is_in(b["step"], pa.array(short, pa.int64()))
            for s, r in zip(b["step"].filter(keep).to_pylist(), b["rank"].filter(keep).to_pylist()):
                have[s].add(r)
        for s in short:
            missing = [r for r in range(int(size[s])) if r not in have[s]]
            self._error(f"step {s}: the metrics table has no row for rank(s) {missing}")

    def _layout(self, ranks: np.ndarray, nodes: list[str | None], coords: list[dict[str, int]]) -> str:
        """``"ray_titan: layout of 4 ranks: node 1a2b3c4d: ranks 0-1 (pp=0 × dp_shard=0-1); ..."``
        (the first 16 nodes; how many more there are)."""
        by_node: dict[str, list[int]] = {}
        for i, node in enumerate(nodes):
            by_node.setdefault(node or "?", []).append(i)
        parts = []
        for node, idx in list(by_node.items())[:16]:
            axes = " × ".join(f"{a}={_span(sorted({coords[i][a] for i in idx}))}" for a in coords[idx[0]])
            parts.append(f"node {node[:8]}: ranks {_span([int(ranks[i]) for i in idx])} ({axes})")
        more = f"; ... and {len(by_node) - 16} more nodes" if len(by_node) > 16 else ""
        return f"ray_titan: layout of {len(ranks)} ranks on {len(by_node)} node(s): " + "; ".join(parts) + more

    def _assemble(self, step: int, parts: list[dict[str, Any]]) -> None:
        """A step whose every rank has reported, in columns: the step's figures, each rank's
        verdict, one Parquet row per rank, the sinks' scalars and the console lines."""
        c, objects, moe, axes = _newest_reports(parts)
        ranks = c.int("rank")
        n = len(ranks)
        size = self._size_of(c)
        summary, last, counted = self._step_summary(step, c, objects, size)
        load = (_expert_load_blocks(moe[0][counted], moe[1][counted]) if moe is not None
                else _expert_load([objects[i] for i in np.nonzero(counted)[0].tolist()]))
        aux = c.get("aux_loss")[counted & ~c.null("aux_loss")]
        # Each DP replica's layers sum to its balance loss; average the replicas.
        summary["moe/aux_loss"] = float(aux.sum() / max(1, int(last.sum()))) if len(aux) else None
        summary["moe_imbalance"] = max(
            (max(x) * len(x) / sum(x) for x in load.values() if sum(x)), default=None
        )
        for o in objects:
            if o[4]:
                self._breakdown(o[4])
        attempt = float(c.get("attempt_start_time")[0])
        coords = self._new_coords(c, ranks, axes, attempt)
        mem = {k: c.get(k) for k in MEMORY_FIELDS}
        code, slope, oom, changes = self.leak.update_many(step, ranks, mem, every=max(1, -(-n // self.VERDICT_RANKS)))
        self.rows.add(StepColumns(c.values, c.nulls, objects, moe, summary, code, slope, oom, size))
        ray_metrics.export_step(self.run_dir.name, step, summary, c.int("pp"), ranks, mem)  # Prometheus / Grafana
        messages = self._verdict_messages(step, changes)
        growing = np.nonzero(code == GROWING_CODE)[0]
        small = n <= max(CONSOLE_RANKS, self.series_max_ranks)
        rows = _sink_rows(c, code, slope, np.arange(n) if small else growing)
        self._to_sinks(step, summary, rows, c, code, load, messages, ranks, coords)
        if step % self.log_freq == 0 or step == self.total_steps or step == 1 or summary["val/loss"] is not None:
            line = (format_step_line(step, self.total_steps, summary, rows) if n <= CONSOLE_RANKS
                    else format_scale_line(step, self.total_steps, summary, c, code))
            self._lines.append((step, line))
        self._lines += [(step, m) for m in messages]
        # Where each worker group runs, once per attempt (reports that name their node).
        if objects[0][0] and attempt not in self._layout_shown and coords is not None:
            self._layout_shown.add(attempt)
            self._lines.append((step, self._layout(ranks, [o[0] for o in objects], coords)))
        self._step_done(step, attempt, summary, c)

    def _step_summary(self, step: int, c: _Columns, objects: list[tuple],
                      size: int) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
        """The step's figures (loss over the last stage's counted ranks, token-weighted; tokens/s
        over the slowest rank's step time; validation), with the masks of the last stage's
        counted ranks and of the counted ranks (``tp = 0``); a last-stage rank without a loss or
        another rank with one is recorded as an error."""
        ranks = c.int("rank")
        on_last = self._last_stage_mask(size, ranks)
        has_loss = ~c.null("loss")
        for r in ranks[on_last & ~has_loss].tolist():
            self._error(f"step {step}: last-stage rank {r} reported no loss")
        for r in ranks[~on_last & has_loss].tolist():
            self._error(f"step {step}: rank {r} is not on the last stage but reported a loss")
        counted = c.int("tp") == 0  # a tp group's ranks hold one data-parallel rank's figures
        last = on_last & counted
        with_loss = last & has_loss
        weights = np.where(c.null("loss_tokens"), c.get("tokens"), c.get("loss_tokens"))[with_loss]
        tokens_w = weights.sum()
        loss = float((c.get("loss")[with_loss] * weights).sum() / tokens_w) if tokens_w else None
        step_time = float(c.get("step_time_s").max())
        summary: dict[str, Any] = {
            "loss": loss,
            "loss_max": float(c.get("loss")[with_loss].max()) if with_loss.any() else None,
            "tokens": int(c.get("tokens")[last].sum()),
            "step_time_s": step_time,
            "lr": float(c.get("lr")[0]),
            "grad_norm": float(c.get("grad_norm")[0]),
            "skipped": bool(c.get("skipped_update")[0]),
        }
        summary["tokens_per_s"] = summary["tokens"] / step_time if step_time > 0 else 0.0
        val = last & ~c.null("val_loss") & (np.nan_to_num(c.get("val_tokens")) > 0)
        val_tokens = c.get("val_tokens")[val].sum()
        val_loss = float((c.get("val_loss")[val] * c.get("val_tokens")[val]).sum() / val_tokens) if val.any() else None
        summary["val/loss"] = val_loss
        summary["val/perplexity"] = None if val_loss is None else math.exp(min(val_loss, 700.0))
        mixed = [objects[i][3] for i in np.nonzero(last)[0].tolist() if objects[i][3]]  # one per DP group
        summary["source_tokens"] = [sum(x) for x in zip(*mixed)] if mixed else None
        return summary, last, counted

    def _last_stage_mask(self, size: int, ranks: np.ndarray) -> np.ndarray:
        """bool ``(ranks,)``: which of ``ranks`` hold the last stage in a worker group of ``size``
        (a lookup table per size: ``np.isin`` costs ~0.1 ms a step at any size)."""
        table = self._last_tables.get(size)
        top = int(ranks.max()) + 1 if len(ranks) else 0
        if table is None or len(table) < top:
            last = self.last_by_size.get(size, self.last)
            table = np.zeros(max(top, max(last, default=-1) + 1), bool)
            table[last] = True
            self._last_tables[size] = table
        return table[ranks]

    def _new_coords(self, c: _Columns, ranks: np.ndarray, axes: list[str],
                    attempt: float) -> list[dict[str, int]] | None:
        """Each rank's mesh coordinates when the verdicts or the layout line need them (new ranks,
        a new attempt), else None: building them per rank is the cost worth skipping per step."""
        if len(self.leak.coords) >= len(ranks) and attempt in self._layout_shown:
            return None
        coords = [dict(zip(axes, map(int, row))) for row in
                  c.values[:, [_F[a] for a in axes]].tolist()] if axes else [{} for _ in range(len(ranks))]
        self.leak.coords.update(zip(ranks.tolist(), coords))
        return coords

    def _to_sinks(self, step: int, summary: dict[str, Any], rows: list[dict[str, Any]], c: _Columns,
                  code: np.ndarray, load: dict[int, list[int]], messages: list[str], ranks: np.ndarray,
                  coords: list[dict[str, int]] | None) -> None:
        """The step's scalars to W&B and TensorBoard: per rank up to ``series_max_ranks`` ranks,
        beyond that per stage and overall plus the growing ranks' own series (``rows``)."""
        if not (self.wandb or self.tb):
            return
        scalars = {k: summary[k] for k in ("loss", "loss_max", "tokens_per_s", "lr", "grad_norm", "step_time_s",
                                           "moe/aux_loss", "val/loss", "val/perplexity")}
        per_rank = len(ranks) <= self.series_max_ranks
        values = step_scalars(scalars, rows) + ([] if per_rank else memory_summary_scalars(c, code))
        if self.wandb:
            self.wandb.log(step, values + expert_load_scalars(load, shares=per_rank))
        if not self.tb:
            return
        self._tensorboard(self.tb.add_scalars, step, values)
        if load:
            self._tensorboard(self.tb.add_expert_load, step, load, per_rank)
        if not self._mesh_written and coords is not None:  # what ``rank{r}`` in the tags is
            self._tensorboard(self.tb.add_text, "mesh/ranks", "\n".join(
                f"- {describe_coords(r, co)}" for r, co in zip(ranks.tolist(), coords)), step)
            self._mesh_written = True
        for message in messages:
            self._tensorboard(self.tb.add_text, "memory/verdict", message, step)

    def _step_done(self, step: int, attempt: float, summary: dict[str, Any], c: _Columns) -> None:
        """Bookkeeping after a step is assembled: the newest step's figures, what is unflushed,
        a flush every ``flush_every`` steps, and the injected collector kill."""
        self.assembled += 1
        if step >= self.last_step:  # the newest step's loss, None (and an error) if it had none
            self.last_step, self.final_loss = step, summary["loss"]
            self.latest = {"step": step, "total": self.total_steps, "loss": summary["loss"],
                           "tokens_per_s": summary["tokens_per_s"], "max_memory": _max_memory(c)}
        self._done[step] = attempt
        self._unflushed.append((attempt, step))
        self._since_flush += 1
        if self._since_flush >= self.flush_every:
            self.flush()
        if step == self.kill_at_step:
            if not self.restarted:
                os.kill(os.getpid(), signal.SIGKILL)

    VERDICT_RANKS = 256
    """Theil–Sen slopes refitted per step at most: a larger job's ranks each get theirs every
    ``ceil(ranks / this)`` steps, in turn (:meth:`LeakMonitor.update_many`'s ``every``), so the
    verdict costs about the same at every step; the verdict itself is exact at every step."""

    def _size_of(self, c: _Columns) -> int:
        """The worker group size of a step's reports (the run's for reports that do not say)."""
        size = c.get("world_size")[0]
        return self.world_size if np.isnan(size) or size <= 0 else int(size)

    def _verdict_messages(self, step: int, changes: list[tuple[int, Verdict]]) -> list[str]:
        """The console messages of the ranks whose verdict changed: one per rank up to
        :data:`CONSOLE_RANKS` changes, beyond that a count per verdict, and every ``growing`` rank
        by name always. Under ``on_leak = "stop"`` a growing rank sets :attr:`stop_reason`."""
        messages = []
        named = changes if len(changes) <= CONSOLE_RANKS else [(r, v) for r, v in changes if v.verdict == GROWING]
        for rank, v in named:
            message = f"memory: {self.leak.describe(rank)} {self.leak.format(v)} at step {step}"
            if v.verdict == GROWING and self.on_leak == "stop" and self.stop_reason is None:
                self.stop_reason = (f"{self.leak.describe(rank)}: memory {self.leak.format(v)} since step {step}; "
                                    "memory.on_leak = 'stop' ended the run")
                message = (f"memory: {self.leak.describe(rank)} {self.leak.format(v)} at step {step}; "
                           "memory.on_leak = 'stop' ends the run")
            messages.append(message)
        if len(changes) > CONSOLE_RANKS:
            counts: dict[str, int] = {}
            for _, v in changes:
                counts[v.verdict] = counts.get(v.verdict, 0) + 1
            messages += [f"memory: {k} rank(s) now {verdict} at step {step}" for verdict, k in counts.items()
                         if verdict != GROWING]
        return messages

    def _breakdown(self, breakdown: dict[str, Any]) -> None:
        """Keep a rank's measured memory breakdown, on disk at once (it survives a restart). A
        full disk must not cost the step its row: the failure is recorded and the breakdowns are
        written again at the end."""
        self.breakdowns[breakdown["rank"]] = breakdown
        try:
            with open(self._breakdown_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(breakdown) + "\n")
        except OSError as e:
            self._breakdowns_unwritten = True
            self._write_failed(f"memory breakdown {self._breakdown_path}: {e.strerror or e}")

    def _error(self, message: str) -> None:
        # Bounded: a systematic error would otherwise add one message per step.
        self.errors_total += 1
        if len(self.errors) > self.MAX_ERRORS:
            return
        if len(self.errors) == self.MAX_ERRORS:
            message = "... further errors are counted in errors_total only"
        self.errors.append(message)
        try:
            with open(self._errors_path, "a", encoding="utf-8") as f:  # survives a collector restart
                f.write(json.dumps(message) + "\n")
        except OSError:  # a full disk: written again at the end, and the driver gets it in finish()
            self._errors_unwritten = True

    def flush(self) -> None:
        """Write a Parquet part of the assembled rows and flush TensorBoard. A write error (a
        full disk) is recorded once, naming the file and the cause; the rows stay in memory and
        the next flush tries again, so nothing that fits on disk later is lost."""
        self._since_flush = 0
        self._stage_rows()
        try:
            self.parquet.flush()
        except OSError as e:
            self._write_failing = True
            self._write_failed(e.strerror or str(e))
            return  # nothing new is durable: the workers keep (and resend) these reports
        self._write_failing = False
        if self.tb:
            self._tensorboard(self.tb.flush)
        for attempt, step in self._unflushed:
            self._flushed.setdefault(attempt, set()).add(step)
        for attempt in {a for a, _ in self._unflushed}:
            self._advance_durable(attempt)
        self._unflushed = []
        self._sync("after a flush")

    def _stage_rows(self) -> None:
        """The assembled steps' rows, built into one table, to the Parquet sink's queue."""
        table = self.rows.take()
        if table is not None:
            self.parquet.add_table(table)

    def _write_failed(self, message: str) -> None:
        """Record a failed write once per message (a full disk fails every flush alike)."""
        if message not in self._write_errors:
            self._write_errors.add(message)
            self._error(f"metrics: {message}")
            self._lines.append((None, f"ray_titan: metrics: {message}"))

    def _tensorboard(self, write, *args: Any) -> None:
        """A TensorBoard write; on an error TensorBoard is given up for this life of the
        collector (the Parquet rows hold the same figures) and the error recorded."""
        try:
            write(*args)
        except OSError as e:
            self._write_failed(f"TensorBoard events in {self.run_dir / 'tb'}: {e}; TensorBoard stops here")
            tb, self.tb = self.tb, None
            try:
                tb.close()  # type: ignore[union-attr]
            except OSError:
                pass

    def _sync(self, when: str) -> None:
        if self.mirror is None:
            return
        try:
            self.mirror.sync()
        except Exception as e:  # the staged copy is complete; the next sync retries
            self._error(f"upload of metrics to {self.mirror.destination} failed {when}: {e}")


def _span(values: list[int]) -> str:
    """``[0, 1, 2]`` → ``"0-2"``; ``[3]`` → ``"3"``; ``[0, 2]`` → ``"0,2"``."""
    if len(values) > 1 and values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}-{values[-1]}"
    return ",".join(map(str, values))


def _reconstructed() -> bool:
    """Whether this is a Ray actor restarted after its process died (False outside Ray)."""
    ray = sys.modules.get("ray")  # an actor has Ray imported; the launcher (no Ray) must not import it
    try:
        if ray is None or not ray.is_initialized():
            return False
        # The property reads Ray's own deprecated ``RuntimeContext.actor_id`` (Ray 2.60), which
        # printed a RayDeprecationWarning on every run's console; only that warning is ignored,
        # and only here: nothing of ours calls the deprecated API.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"(?s).*\nUse get_actor_id\(\) instead$")
            return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # not in an actor
        return False
