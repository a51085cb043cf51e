"""The step's figures as Ray metrics (``ray.util.metrics``), for Ray's Prometheus endpoint and the
dashboard's Grafana.

The collector calls :func:`export_step` once per assembled step. Ray prefixes application
metrics with ``ray_``, so Prometheus sees (every series labelled ``job``: the run directory's
name, ``<job.name>-<stamp>``, so two runs of one job stay apart):

- ``ray_titan_step``, ``ray_titan_loss`` (the step's loss, nats per token), ``ray_titan_tokens_per_s``,
  ``ray_titan_step_time_s`` (the slowest rank's), ``ray_titan_val_loss`` (at steps that evaluated);
- ``ray_titan_stage_memory_bytes{stage, series, stat}``: per pipeline stage, the min, median and
  max over its ranks of ``device_allocated`` (ranks with a device) and ``host_rss``;
- ``ray_titan_stage_memory_max_rank{stage, series}``: the rank holding that max.

A handful of series per stage, never one per rank: at 16,384 ranks on 16 stages that is about 130
series per job, which Prometheus takes at any scrape interval. The gauges are values at the
last export (Ray pushes them every ``metrics_report_interval_ms``, 10 s by default), so a
per-step history belongs to ``steps.parquet``, not here. Without a connected Ray (the launcher's
in-process collector) :func:`export_step` does nothing. Label values pass :func:`label_value`:
Ray encodes them as ASCII, so a ``job.name`` such as ``café`` would otherwise stop the export.
"""

from __future__ import annotations

import sys
import time
import unicodedata
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["MEMORY_EVERY_S", "METRIC_NAMES", "export_step", "label_value"]

_SCALARS = {  # summary key → (gauge name, description)
    "loss": ("titan_loss", "The step's loss (last pipeline stage, token-weighted), nats per token"),
    "tokens_per_s": ("titan_tokens_per_s", "Tokens per second of the step (the whole job)"),
    "step_time_s": ("titan_step_time_s", "Seconds of the step (the slowest rank's)"),
    "val/loss": ("titan_val_loss", "Validation loss at the last evaluation, nats per token"),
}
METRIC_NAMES = ["titan_step", *(n for n, _ in _SCALARS.values()), "titan_stage_memory_bytes",
                "titan_stage_memory_max_rank"]
"""The gauges' names as given to Ray (Prometheus shows them with Ray's ``ray_`` prefix)."""

_SERIES = {"device_allocated": "device_allocated_bytes", "host_rss": "host_rss_bytes"}
_gauges: dict[str, Any] = {}
_failed = False
MEMORY_EVERY_S = 1.0
"""The per-stage memory gauges are recomputed at most this often (seconds): Ray pushes them every
10 s, and at 16K ranks a recomputation takes tens of milliseconds, not worth paying every step."""
_last_memory = [float("-inf")]


def label_value(value: str) -> str:
    """``value`` as a label value Ray's gauges take: ASCII (Ray's ``Gauge.set`` encodes tag
    values as ASCII and raises ``UnicodeEncodeError`` otherwise, which would stop the whole
    export). Accents are dropped (Unicode NFKD, combining marks removed: ``café`` → ``cafe``), as
    a user would type the name in a Prometheus query; any other non-ASCII character becomes its
    Python escape (``日`` → ``\\u65e5``), so names that differ in it stay apart. ASCII is unchanged."""
    if value.isascii():
        return value
    plain = "".join(c for c in unicodedata.normalize("NFKD", value) if not unicodedata.combining(c))
    return plain.encode("ascii", "backslashreplace").decode("ascii")


def _gauge(name: str, description: str, tags: tuple[str, ...]) -> Any:
    from ray.util.metrics import Gauge

    if name not in _gauges:  # one Gauge object per process: Ray registers it once
        _gauges[name] = Gauge(name, description=description, tag_keys=tags)
    return _gauges[name]


def export_step(job: str, step: int, summary: Mapping[str, Any], pp: np.ndarray, ranks: np.ndarray,
                memory: Mapping[str, np.ndarray]) -> None:
    """Set the gauges (module docstring) from one assembled step: ``summary``, the collector's
    step figures (``loss``, ``tokens_per_s``, ``step_time_s``, ``val/loss``; None leaves a gauge
    at its last value), and the step's ranks in columns: ``pp`` and ``ranks`` (int, ``(ranks,)``)
    and ``memory`` with ``device_allocated_bytes`` and ``host_rss_bytes`` (float ``(ranks,)``,
    bytes, NaN where a rank has none), read at most every :data:`MEMORY_EVERY_S` seconds (a numpy
    sort and ~6 gauge updates per stage; the scalars are set at every step). Does nothing when
    Ray is not initialised in this process; a failure (Ray's metrics agent gone) is printed once
    and the export stops, so the collector's own work goes on."""
    global _failed
    ray = sys.modules.get("ray")  # not imported: certainly not initialised (and not worth importing)
    if _failed or ray is None or not ray.is_initialized():
        return
    try:
        _export(job, step, summary, pp, ranks, memory)
    except Exception as e:
        _failed = True
        print(f"ray_titan: warning: Ray metrics export stopped: {type(e).__name__}: {e}", file=sys.stderr)


def _export(job: str, step: int, summary: Mapping[str, Any], pp: np.ndarray, ranks: np.ndarray,
            memory: Mapping[str, np.ndarray]) -> None:
    job = label_value(job)  # the only label a user names (stage and series are ours, ASCII)
    tags = {"job": job}
    _gauge("titan_step", "The last step assembled", ("job",)).set(step, tags=tags)
    for key, (name, description) in _SCALARS.items():
        if summary.get(key) is not None:
            _gauge(name, description, ("job",)).set(float(summary[key]), tags=tags)
    now = time.monotonic()
    if not len(ranks) or now - _last_memory[0] < MEMORY_EVERY_S:
        return
    _last_memory[0] = now
    stage = np.asarray(pp, np.int64)
    order = np.argsort(stage, kind="stable")
    stage, rank = stage[order], np.asarray(ranks, np.int64)[order]
    bounds = [*np.flatnonzero(np.r_[True, stage[1:] != stage[:-1]]), len(stage)]
    mem = _gauge("titan_stage_memory_bytes", "Per pipeline stage, min / median / max over its ranks, bytes",
                 ("job", "stage", "series", "stat"))
    arg = _gauge("titan_stage_memory_max_rank", "Per pipeline stage, the rank with the most memory",
                 ("job", "stage", "series"))
    for series, column in _SERIES.items():
        vals = np.asarray(memory[column], float)[order]
        if np.isnan(vals).all():
            continue
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            ok = ~np.isnan(vals[lo:hi])
            if not ok.any():
                continue
            v, at = vals[lo:hi][ok], rank[lo:hi][ok]
            i = int(np.argmax(v))
            labels = {"job": job, "stage": str(stage[lo]), "series": series}
            for stat, x in (("min", v.min()), ("median", np.median(v)), ("max", v[i])):
                mem.set(float(x), tags={**labels, "stat": stat})
            arg.set(int(at[i]), tags=labels)
