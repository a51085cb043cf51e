"""Where assembled metrics go: Parquet (pyarrow) and TensorBoard (tensorboardX).

Parquet: rows are appended in parts, ``<run_dir>/metrics/parts/part-NNNNN.parquet``, each written
whole (temporary file, then rename) so a crash loses at most the rows not yet flushed. On close
the parts are consolidated into ``<run_dir>/metrics/steps.parquet``. :func:`read_steps` reads the
consolidated file, or the parts when a crash left no consolidated file.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

__all__ = ["STEP_SCHEMA", "VERDICT_CODES", "ParquetSink", "TensorBoardSink", "read_steps"]

_I, _F, _B = pa.int64(), pa.float64(), pa.bool_()
STEP_SCHEMA = pa.schema(
    [
        ("step", _I), ("rank", _I), ("pp", _I), ("dp_replicate", _I), ("dp_shard", _I), ("tp", _I), ("ep", _I),
        ("is_last_stage", _B),
        ("loss", _F), ("tokens", _I), ("step_time_s", _F), ("data_time_s", _F),
        ("fwd_bwd_time_s", _F), ("optim_time_s", _F), ("grad_norm", _F), ("lr", _F),
        ("gc_pause_s", _F), ("time", _F), ("metrics_time_s", _F),
        ("host_rss_bytes", _I), ("host_peak_rss_bytes", _I),
        ("host_heap_in_use_bytes", _I), ("host_heap_free_bytes", _I),
        ("host_available_bytes", _I),
        ("device_allocated_bytes", _I), ("device_active_bytes", _I), ("device_reserved_bytes", _I),
        ("device_peak_active_bytes", _I), ("device_peak_reserved_bytes", _I),
        ("device_alloc_retries", _I), ("device_ooms", _I), ("device_capacity_bytes", _I),
        # MoE (null / empty for dense models): this rank's balance loss, its MoE layers and, per
        # layer, the tokens (× top-k) its router sent to each expert in the step.
        ("aux_loss", _F), ("moe_layers", pa.list_(_I)), ("expert_load", pa.list_(pa.list_(_I))),
        ("gc_generation", _I),
        # The rank's memory verdict at this step (ray_titan.metrics.leak):
        ("memory_verdict", pa.string()), ("memory_slope_mib_per_step", _F), ("memory_oom_step", _I),
        # Step-level figures, the same on every row of a step:
        ("step_loss", _F), ("step_loss_max", _F), ("step_tokens", _I), ("step_tokens_per_s", _F),
        # Fault tolerance:
        ("skipped_update", _B), ("attempt", _I), ("attempt_start_time", _F), ("pid", _I),
        # Placement: the rank's node, and its worker group's size (elastic runs resize).
        ("node", pa.string()), ("world_size", _I),
    ]
)
"""One row per step per rank. ``pp``, ``dp_shard``, ``ep``, ``dp_replicate``, ``tp``: the rank's
coordinates on the mesh axes (0 on an axis the run does not have). ``loss`` is the rank's own
(null off the last stage); ``step_loss`` is the step's loss: token-weighted mean over the last
stage's DP ranks (the tp ranks of one group hold the same loss, counted once).
``gc_generation``: the generation of the synchronized GC run at this step (null: none ran).
``metrics_time_s``: seconds the rank spent in the previous step on its memory sample and report
(the metrics path's own cost; null at an attempt's first step).
``memory_verdict``: ``warming_up`` / ``stable`` / ``growing``; ``memory_slope_mib_per_step``: the
Theil–Sen rate; ``memory_oom_step``: the step at which the rank would run out of memory at that
rate (null unless growing with a known capacity).
``skipped_update``: the step's update was dropped (non-finite loss or gradient norm, under
``training.on_nonfinite = "skip"``). ``attempt``: 0 for the first worker group, 1 for the first
restart, ...; ``attempt_start_time`` (Unix seconds) identifies it. Steps replayed after a restart
replace the lost attempt's rows, so each (step, rank) appears once, and a step's rows are all of one
attempt. ``pid``: the worker process. ``node``: the node it ran on (Ray's node id, or the host
name without Ray); ``world_size``: the ranks of its worker group (an elastic run's changes at a
resize)."""


class ParquetSink:
    """Appends rows (dicts with :data:`STEP_SCHEMA`'s keys) and flushes them as Parquet parts."""

    def __init__(self, metrics_dir: str | Path):
        self.dir = Path(metrics_dir)
        self.parts = self.dir / "parts"
        self.parts.mkdir(parents=True, exist_ok=True)
        self._rows: list[dict[str, Any]] = []
        # Continue after the highest existing part, so a restarted writer never overwrites one.
        existing = [int(p.stem.split("-")[1]) for p in self.parts.glob("part-*.parquet")]
        self._n = max(existing, default=-1) + 1
        self.closed_path: Path | None = None

    def add(self, rows: list[dict[str, Any]]) -> None:
        """Queue rows for the next part (held in memory until :meth:`flush`)."""
        self._rows.extend(rows)

    def flush(self) -> None:
        """Write the queued rows as the next part file (atomically) and forget them."""
        if not self._rows:
            return
        table = pa.Table.from_pylist(self._rows, schema=STEP_SCHEMA)
        path = self.parts / f"part-{self._n:05d}.parquet"
        tmp = path.with_suffix(".tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, path)
        self._n += 1
        self._rows = []

    def close(self) -> Path:
        """Flush, write ``steps.parquet`` from all parts (sorted by step, rank) and remove the
        parts. Calling it again returns the same path and changes nothing."""
        if self.closed_path is not None:
            return self.closed_path
        self.flush()
        table = _read_parts(self.parts)
        out = self.dir / "steps.parquet"
        tmp = out.with_suffix(".tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, out)
        for p in list(self.parts.glob("part-*.parquet")) + list(self.parts.glob("*.tmp")):
            p.unlink()
        try:
            self.parts.rmdir()
        except OSError:  # something else was put there; the consolidated file is complete anyway
            pass
        self.closed_path = out
        return out


def read_raw_parts(parts: Path) -> pa.Table:
    """Every row of the flushed parts as written: replayed steps and resent duplicates included."""
    files = sorted(parts.glob("part-*.parquet"))
    if not files:
        return STEP_SCHEMA.empty_table()
    return pa.concat_tables([pq.read_table(f, schema=STEP_SCHEMA) for f in files])


def latest_rows(table: pa.Table) -> pa.Table:
    """One row per (step, rank): the one from the newest attempt (replayed steps replace the
    lost ones; resent duplicates collapse), with ``attempt`` numbered 0, 1, ... by start time;
    sorted by step and rank. A step keeps only its newest attempt's rows: after an elastic
    resize the lost attempt's rows of ranks the new worker group lacks go too."""
    if table.num_rows == 0:
        return table
    starts = sorted(set(table["attempt_start_time"].to_pylist()))
    table = table.set_column(
        table.schema.get_field_index("attempt"), "attempt",
        pa.array([starts.index(t) for t in table["attempt_start_time"].to_pylist()], pa.int64()),
    )
    table = table.sort_by([("step", "ascending"), ("rank", "ascending"), ("attempt", "descending")])
    keys = list(zip(table["step"].to_pylist(), table["rank"].to_pylist()))
    attempts = table["attempt"].to_pylist()
    newest: dict[int, int] = {}
    for (step, _), a in zip(keys, attempts):
        newest[step] = max(newest.get(step, a), a)
    first = [i for i, k in enumerate(keys) if (i == 0 or keys[i - 1] != k) and attempts[i] == newest[k[0]]]
    return table.take(pa.array(first, pa.int64()))


def _read_parts(parts: Path) -> pa.Table:
    return latest_rows(read_raw_parts(parts))


def read_steps(run_dir: str | Path) -> pa.Table:
    """The per-step, per-rank metrics of a run: ``steps.parquet``, or the flushed parts if the
    run ended before consolidating them. An empty table (with the schema) if neither exists.
    ``run_dir`` may be a URI (:mod:`ray_titan.storage`)."""
    from ray_titan import storage

    if storage.is_remote(run_dir):
        fs, path = storage.resolve(storage.join(run_dir, "metrics"))
        if storage.exists(storage.join(run_dir, "metrics", "steps.parquet")):
            return pq.read_table(f"{path}/steps.parquet", filesystem=fs)
        files = sorted(i.path for i in fs.get_file_info(pafs.FileSelector(f"{path}/parts", allow_not_found=True))
                       if i.base_name.startswith("part-") and i.base_name.endswith(".parquet"))
        if not files:
            return STEP_SCHEMA.empty_table()
        table = pa.concat_tables([pq.read_table(f, schema=STEP_SCHEMA, filesystem=fs) for f in files])
        return table.sort_by([("step", "ascending"), ("rank", "ascending")])
    local = storage.local_path(run_dir)
    assert local is not None  # not remote (above)
    metrics = local / "metrics"
    if (metrics / "steps.parquet").exists():
        return pq.read_table(metrics / "steps.parquet")
    if (metrics / "parts").is_dir():
        return _read_parts(metrics / "parts")
    return STEP_SCHEMA.empty_table()


VERDICT_CODES = {"warming_up": 0, "stable": 1, "growing": 2}
"""How a memory verdict is plotted as a TensorBoard scalar (``memory/rank{r}/verdict``)."""


class TensorBoardSink:
    """Scalars to ``<run_dir>/tb`` with tensorboardX: ``loss``, ``loss_max``, ``tokens_per_s``,
    ``lr``, ``grad_norm``, ``step_time_s``, ``memory/rank{r}/<field>`` (MiB),
    ``memory/rank{r}/verdict`` (:data:`VERDICT_CODES`), ``memory/rank{r}/slope_mib_per_step``,
    ``gc/rank{r}/pause_s`` at steps with a GC, text ``memory/verdict`` when a verdict changes,
    text ``mesh/ranks`` (every rank's mesh coordinates, at the first step recorded), and,
    for MoE models, ``moe/aux_loss``, ``moe/layer{L}/load_max_over_mean`` and
    ``moe/layer{L}/expert{e}_share``."""

    def __init__(self, tb_dir: str | Path, purge_step: int | None = None):
        from tensorboardX import SummaryWriter

        self.tb_dir = tb_dir
        # purge_step: TensorBoard drops the events of earlier writers from this step on (replays).
        # A new file name even within the same second (tensorboardX names files by the second).
        suffix = "" if purge_step is None else f".{time.time_ns()}"
        self.writer = SummaryWriter(str(tb_dir), purge_step=purge_step, filename_suffix=suffix, max_queue=1000)

    def add_step(self, step: int, scalars: dict[str, float], rows: list[dict[str, Any]]) -> None:
        values = [(k, v) for k, v in scalars.items() if v is not None]
        for row in rows:
            rank = row["rank"]
            for k in ("host_rss_bytes", "host_peak_rss_bytes", "device_allocated_bytes",
                      "device_reserved_bytes", "device_peak_active_bytes", "device_peak_reserved_bytes"):
                if row.get(k) is not None:
                    values.append((f"memory/rank{rank}/{k.removesuffix('_bytes')}_mib", row[k] / 2**20))
            if row.get("memory_verdict") is not None:
                values.append((f"memory/rank{rank}/verdict", VERDICT_CODES[row["memory_verdict"]]))
            if row.get("memory_slope_mib_per_step") is not None:
                values.append((f"memory/rank{rank}/slope_mib_per_step", row["memory_slope_mib_per_step"]))
            if row.get("gc_generation") is not None:
                values.append((f"gc/rank{rank}/pause_s", row["gc_pause_s"]))
        self._scalars(step, values)

    def _scalars(self, step: int, values: list[tuple[str, float]]) -> None:
        """All of a step's scalars as one event: one Summary with a value per tag, which
        TensorBoard reads as separate series (as TF1's merged summaries). ``add_scalar`` would
        make an event per tag, each pickled through tensorboardX's multiprocessing queue: about
        25 of them per step took most of the collector's CPU time outside Ray."""
        from tensorboardX.proto.summary_pb2 import Summary

        if values:
            summary = Summary(value=[Summary.Value(tag=k, simple_value=float(v)) for k, v in values])
            self.writer.file_writer.add_summary(summary, step)

    def add_text(self, tag: str, text: str, step: int) -> None:
        """A text entry (Markdown) at ``step``, shown in TensorBoard's Text tab."""
        self.writer.add_text(tag, text, step)

    def add_expert_load(self, step: int, load: dict[int, list[int]]) -> None:
        """Per MoE layer: max over mean of the experts' token counts (1 = perfectly balanced) and
        each expert's share of the layer's routed tokens."""
        values = []
        for layer, counts in load.items():
            total = sum(counts)
            if total:
                values.append((f"moe/layer{layer}/load_max_over_mean", max(counts) * len(counts) / total))
                values += [(f"moe/layer{layer}/expert{e}_share", c / total) for e, c in enumerate(counts)]
        self._scalars(step, values)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
