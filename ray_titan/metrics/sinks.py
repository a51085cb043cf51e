"""Where assembled metrics go: Parquet (pyarrow), TensorBoard (tensorboardX) and, optionally,
Weights & Biases.

Parquet: rows are appended in parts, ``<run_dir>/metrics/parts/part-NNNNN.parquet``, each written
whole (temporary file, then rename) so a crash loses at most the rows not yet flushed. On close
the parts are consolidated into ``<run_dir>/metrics/steps.parquet``. :func:`read_steps` reads the
consolidated file, or the parts when a crash left no consolidated file.

Layout of ``steps.parquet`` (docs/metrics.md): rows sorted by rank, then step; each row group holds
whole ranks, a block of consecutive ranks of about :data:`ROW_GROUP_ROWS` rows, so the ``rank``
column's min/max statistics let a reader skip every other group. :func:`read_rank_history` reads one
rank's history from the one group that holds it (pyarrow's filter pushdown on ``rank`` does the
same). The consolidation streams: the parts are read one at a time and spilled by rank block into
at most :data:`_MAX_BUCKETS` Arrow IPC files, then each is sorted and written, so its memory is a
part plus a bucket, not the table.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

__all__ = [
    "ROW_GROUP_ROWS", "STEP_SCHEMA", "VERDICT_CODES", "ParquetSink", "TensorBoardSink", "WandbSink",
    "expert_load_scalars", "read_rank_history", "read_steps", "step_scalars", "wandb_settings",
]

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
        # Validation (null at steps without an evaluation):
        ("val_loss", _F), ("val_tokens", _I), ("val_time_s", _F), ("step_val_loss", _F),
        # Loss masks (supervised fine-tuning): the labels counted in ``loss`` (null: all of ``tokens``).
        ("loss_tokens", _I),
        # Mixtures (data.sources): label tokens from each source, this rank's and the step's.
        ("source_tokens", pa.list_(_I)), ("step_source_tokens", pa.list_(_I)),
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
resize).
``val_loss``, ``val_tokens``, ``val_time_s``: at steps that evaluated (``[validation]``), the rank's
validation loss (last-stage ranks; nats per counted token), its counted validation tokens and the
evaluation's seconds (outside ``step_time_s``); ``step_val_loss``: the step's validation loss,
token-weighted over the last stage's data-parallel ranks (its perplexity is ``exp`` of it).
``loss_tokens``: under loss masks, the labels counted in the rank's ``loss``. ``source_tokens``
and ``step_source_tokens``: with a mixture, the label tokens taken from each source (in the order
of ``data.sources``) in the rank's slice and in the whole step (null without a mixture)."""


class ParquetSink:
    """Appends rows (dicts with :data:`STEP_SCHEMA`'s keys) and flushes them as Parquet parts."""

    def __init__(self, metrics_dir: str | Path):
        self.dir = Path(metrics_dir)
        self.parts = self.dir / "parts"
        self.parts.mkdir(parents=True, exist_ok=True)
        self._tables: list[pa.Table] = []
        # Continue after the highest existing part, so a restarted writer never overwrites one.
        existing = [int(p.stem.split("-")[1]) for p in self.parts.glob("part-*.parquet")]
        self._n = max(existing, default=-1) + 1
        self.closed_path: Path | None = None

    def add(self, rows: list[dict[str, Any]]) -> None:
        """Queue rows for the next part (held in memory until :meth:`flush`)."""
        if rows:
            self._tables.append(pa.Table.from_pylist(rows, schema=STEP_SCHEMA))

    def add_table(self, table: pa.Table) -> None:
        """Queue a table of :data:`STEP_SCHEMA` for the next part (a step assembled in columns)."""
        self._tables.append(table)

    def unflushed_steps(self) -> list[int]:
        """The steps of the queued rows, sorted."""
        return sorted({s for t in self._tables for s in t["step"].to_pylist()})

    def flush(self) -> None:
        """Write the queued rows as the next part file (atomically) and forget them. On a write
        error (a full disk) the partial file is removed, the rows are kept for the next flush, and
        ``OSError`` is raised naming the file and the cause."""
        if not self._tables:
            return
        table = pa.concat_tables(self._tables)
        path = self.parts / f"part-{self._n:05d}.parquet"
        _write_atomically(table, path)
        self._n += 1
        self._tables = []

    def close(self) -> Path:
        """Flush, write ``steps.parquet`` from all parts (one row per step and rank,
        :func:`latest_rows`; sorted by rank and step, one row group per block of ranks: module
        docstring) and remove the parts. Calling it again returns the same path and changes
        nothing. Raises ``OSError`` naming the file when it cannot be written (the parts stay)."""
        if self.closed_path is not None:
            return self.closed_path
        self.flush()
        out = self.dir / "steps.parquet"
        consolidate(sorted(self.parts.glob("part-*.parquet")), out)  # the parts stay if this fails
        for p in list(self.parts.glob("part-*.parquet")) + list(self.parts.glob("*.tmp")):
            p.unlink()
        try:
            self.parts.rmdir()
        except OSError:  # something else was put there; the consolidated file is complete anyway
            pass
        self.closed_path = out
        return out


ROW_GROUP_ROWS = 1 << 17
"""Rows per row group of ``steps.parquet`` (about): a group holds ``max(1, ROW_GROUP_ROWS // steps)``
whole ranks, so one rank's history is one group however many ranks the run has. Smaller groups
read less per rank but grow the footer (one entry per column per group) read by every reader."""

_BUCKET_ROWS = 1 << 21  # rows held in memory at once while consolidating (~1 GB in Arrow)
_MAX_BUCKETS = 256  # spill files open at once while consolidating


def consolidate(parts: list[Path], out: Path) -> int:
    """Write the rows of ``parts`` (Parquet files with :data:`STEP_SCHEMA`) to ``out``: one row
    per (step, rank) (:func:`latest_rows`), sorted by rank then step, one row group per block of
    ranks (module docstring), atomically (temporary file, then rename). Memory stays about one
    part plus :data:`_BUCKET_ROWS` rows: two passes over the parts, the first reading three
    columns. Returns the rows written; raises ``OSError`` naming ``out`` on a write error."""
    # Pass 1 (three columns, a part at a time): each step's newest attempt, the attempts, the ranks.
    starts, ranks, newest_parts = np.zeros(0), np.zeros(0, np.int64), []
    for f in parts:
        key = pq.read_table(f, columns=["step", "rank", "attempt_start_time"])
        starts = np.union1d(starts, key["attempt_start_time"].to_numpy())
        ranks = np.union1d(ranks, key["rank"].to_numpy())
        newest_parts.append(key.group_by("step").aggregate([("attempt_start_time", "max")]))
    newest = (pa.concat_tables(newest_parts).group_by("step").aggregate([("attempt_start_time_max", "max")])
              .rename_columns({"attempt_start_time_max_max": "attempt_start_time_max"}) if newest_parts else None)
    n_steps = max(newest.num_rows if newest is not None else 0, 1)
    per_group = max(1, ROW_GROUP_ROWS // n_steps)
    group_first = ranks[::per_group]  # first rank of each row group
    n_buckets = min(_MAX_BUCKETS, max(1, math.ceil(len(ranks) * n_steps / _BUCKET_ROWS)))
    groups_per_bucket = math.ceil(max(len(group_first), 1) / n_buckets)
    bucket_first = group_first[::groups_per_bucket]

    tmp = out.with_suffix(".tmp")
    rows = 0
    try:
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=".consolidate-") as spill, \
                pq.ParquetWriter(tmp, STEP_SCHEMA) as writer:
            if len(bucket_first) <= 1:  # small enough to hold: no spill files
                buckets = [pa.concat_tables([pq.read_table(f, schema=STEP_SCHEMA) for f in parts])
                           if parts else STEP_SCHEMA.empty_table()]
            else:
                buckets = _spill(parts, bucket_first, Path(spill))
            for bucket in buckets:
                t = _latest(bucket, starts, newest, keys=("rank", "step"))
                del bucket
                # Each group's first row (a group's first rank may have no rows left: start at 0).
                b = np.searchsorted(t["rank"].to_numpy(), group_first)
                bounds: list[int] = np.unique(np.r_[0, b[(b > 0) & (b < t.num_rows)]]).tolist() if t.num_rows else []
                for lo, hi in zip(bounds, [*bounds[1:], t.num_rows]):
                    writer.write_table(t.slice(lo, hi - lo), row_group_size=max(hi - lo, 1))
                rows += t.num_rows
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        cause = os.strerror(e.errno) if e.errno else str(e)
        raise OSError(e.errno, f"cannot write {out}: {cause}") from None
    return rows


def _spill(parts: list[Path], bucket_first: np.ndarray, spill: Path):
    """Split every part's rows by rank bucket into one Arrow IPC file per bucket, then yield each
    bucket's table in rank order (pass 2 of :func:`consolidate`)."""
    paths = [spill / f"bucket-{i:05d}.arrow" for i in range(len(bucket_first))]
    writers = [pa.ipc.new_file(p, STEP_SCHEMA) for p in paths]
    try:
        for f in parts:
            t = pq.read_table(f, schema=STEP_SCHEMA)
            b = np.searchsorted(bucket_first, t["rank"].to_numpy(), side="right") - 1
            order = np.argsort(b, kind="stable")
            t, b = t.take(pa.array(order)), b[order]
            edges = np.searchsorted(b, np.arange(len(bucket_first) + 1))
            for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
                if hi > lo:
                    writers[i].write_table(t.slice(lo, hi - lo))
    finally:
        for w in writers:
            w.close()
    for p in paths:
        with pa.memory_map(str(p)) as source:
            yield pa.ipc.open_file(source).read_all()
        p.unlink()


def _write_atomically(table: pa.Table, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)  # a partial file only takes the space the next try needs
        cause = os.strerror(e.errno) if e.errno else str(e)
        raise OSError(e.errno, f"cannot write {path}: {cause}") from None


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
    starts = np.unique(table["attempt_start_time"].to_numpy())
    newest = table.select(["step", "attempt_start_time"]).group_by("step").aggregate([("attempt_start_time", "max")])
    return _latest(table, starts, newest)


def _latest(table: pa.Table, starts: np.ndarray, newest: pa.Table | None,
            keys: tuple[str, str] = ("step", "rank")) -> pa.Table:
    """:func:`latest_rows` of some of a table's rows, given the whole table's sorted attempt start
    times and each step's newest (``step``, ``attempt_start_time_max``), sorted by ``keys``:
    vectorised, so a consolidation can apply it a bucket of ranks at a time."""
    if table.num_rows == 0 or newest is None:
        return table
    start = table["attempt_start_time"].to_numpy()
    steps = newest["step"].to_numpy()
    order = np.argsort(steps)
    at = order[np.searchsorted(steps, table["step"].to_numpy(), sorter=order)]
    keep = np.flatnonzero(start == newest["attempt_start_time_max"].to_numpy()[at])
    table = table.take(pa.array(keep))
    table = table.set_column(table.schema.get_field_index("attempt"), "attempt",
                             pa.array(np.searchsorted(starts, start[keep]), pa.int64()))
    table = table.sort_by([(k, "ascending") for k in keys])
    # Resent duplicates (same attempt) are adjacent now: keep the first of each (step, rank).
    step, rank = table["step"].to_numpy(), table["rank"].to_numpy()
    first = np.ones(table.num_rows, bool)
    first[1:] = (step[1:] != step[:-1]) | (rank[1:] != rank[:-1])
    return table if first.all() else table.filter(pa.array(first))


def read_steps(run_dir: str | Path, columns: list[str] | None = None) -> pa.Table:
    """The per-step, per-rank metrics of a run: ``steps.parquet``, or the flushed parts if the
    run ended before consolidating them (one row per step and rank: :func:`latest_rows`), sorted
    by step then rank (the file itself is by rank then step: module docstring); ``columns``: only
    these (default all; those the file has, for a file from before some column existed). An empty
    table (with the schema) if neither exists. ``run_dir`` may be a
    URI (:mod:`ray_titan.storage`); local and remote run directories are read the same way.
    Reads the whole table: one rank's history is :func:`read_rank_history`."""
    from ray_titan import storage

    fs, path = storage.resolve(storage.join(run_dir, "metrics"))
    if fs.get_file_info(f"{path}/steps.parquet").type == pafs.FileType.File:
        t = _read_row_groups(fs, f"{path}/steps.parquet", columns)
        if {"step", "rank"} <= set(t.column_names):
            t = t.sort_by([("step", "ascending"), ("rank", "ascending")])
        return t
    files = sorted(i.path for i in fs.get_file_info(pafs.FileSelector(f"{path}/parts", allow_not_found=True))
                   if i.base_name.startswith("part-") and i.base_name.endswith(".parquet"))
    if not files:
        t = STEP_SCHEMA.empty_table()
    else:
        t = latest_rows(pa.concat_tables([pq.read_table(f, schema=STEP_SCHEMA, filesystem=fs) for f in files]))
    return t if columns is None else t.select(columns)


def _read_row_groups(fs: pafs.FileSystem, path: str, columns: list[str] | None) -> pa.Table:
    """``columns`` of a Parquet file, a batch at a time into one chunk per column: a file of
    many small row groups (one row each) read whole took ~13 times its size (40,000 groups of a
    455 MB file: 5.4 GB, 103 s; read so: 2.3 GB, 25 s, nearly all of it pyarrow's own footer)."""
    with fs.open_input_file(path) as f:
        pf = pq.ParquetFile(f)
        names = pf.schema_arrow.names
        cols = None if columns is None else [c for c in columns if c in names]
        schema = pf.schema_arrow if cols is None else pa.schema([pf.schema_arrow.field(c) for c in cols])
        return pa.Table.from_batches(pf.iter_batches(batch_size=1 << 16, columns=cols), schema=schema).combine_chunks()


def read_rank_history(run_dir: str | Path, rank: int, columns: list[str] | None = None) -> pa.Table:
    """One rank's rows (``columns``, default all), sorted by step. From ``steps.parquet`` it reads
    the footer and only the row groups whose ``rank`` statistics can hold ``rank`` (one group in a
    file written by :class:`ParquetSink`); from the parts of an unfinished run, all of them.
    An empty table if the run has no rows for that rank. ``run_dir`` may be a URI."""
    from ray_titan import storage

    fs, path = storage.resolve(storage.join(run_dir, "metrics"))
    if fs.get_file_info(f"{path}/steps.parquet").type != pafs.FileType.File:
        t = read_steps(run_dir)
        t = t.filter(pc.equal(t["rank"], rank))
        return t if columns is None else t.select(columns)
    with fs.open_input_file(f"{path}/steps.parquet") as f:
        pf = pq.ParquetFile(f)
        t = pf.read_row_groups(rank_row_groups(pf.metadata, rank), columns=None if columns is None else
                               list(dict.fromkeys([*columns, "rank", "step"])))
    t = t.filter(pc.equal(t["rank"], rank)).sort_by("step")
    return t if columns is None else t.select(columns)


def rank_row_groups(meta: pq.FileMetaData, rank: int) -> list[int]:
    """The row groups of a Parquet file whose ``rank`` column statistics (min, max) include
    ``rank``; a group without statistics is included (it may hold it)."""
    col = meta.schema.names.index("rank")
    out = []
    for i in range(meta.num_row_groups):
        st = meta.row_group(i).column(col).statistics
        if st is None or not st.has_min_max or st.min <= rank <= st.max:
            out.append(i)
    return out


VERDICT_CODES = {"warming_up": 0, "stable": 1, "growing": 2}
"""How a memory verdict is plotted as a TensorBoard scalar (``memory/rank{r}/verdict``)."""


def step_scalars(scalars: Mapping[str, float | None], rows: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """A step's scalars by tag, as TensorBoard and W&B get them: ``scalars`` (the step-level
    figures, None left out) and, per rank, its memory (MiB), verdict, slope and GC pause."""
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


def wandb_settings(cfg: Any) -> dict[str, Any] | None:
    """The :class:`WandbSink` arguments of a job (``metrics.wandb``; its config included), or None."""
    m = cfg.metrics
    if not m.wandb:
        return None
    return {"project": m.wandb_project, "name": m.wandb_run_name, "tags": list(m.wandb_tags),
            "config": cfg.model_dump(mode="json")}


class WandbSink:
    """The same scalars as :class:`TensorBoardSink` to a Weights & Biases run, one ``log`` call per
    step, with the job's config. Opened by the collector, the one place that sees every rank.

    The run id is derived from the run directory's name, so a restarted collector continues the
    same W&B run (``resume="allow"``); W&B steps only increase, so steps replayed after a worker
    restart are not logged again there (Parquet has them). Raises ``ImportError`` without the
    ``wandb`` package (the pre-flight checks refuse that first).
    """

    def __init__(self, run_dir: str | Path, project: str, name: str | None, tags: list[str],
                 config: dict[str, Any] | None):
        import wandb

        run_dir = Path(run_dir)
        run_id = "".join(c if c.isalnum() or c in "-_" else "-" for c in run_dir.name)[-64:]
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=name or run_dir.name, tags=tags or None, config=config,
                              dir=str(run_dir), id=run_id, resume="allow", reinit="create_new")
        self.last_step = -1

    def log(self, step: int, values: list[tuple[str, float]]) -> None:
        if step > self.last_step and values:
            self.run.log(dict(values), step=step)
            self.last_step = step

    def close(self) -> None:
        self.run.finish()


class TensorBoardSink:
    """Scalars to ``<run_dir>/tb`` with tensorboardX: ``loss``, ``loss_max``, ``tokens_per_s``,
    ``lr``, ``grad_norm``, ``step_time_s``, ``val/loss`` and ``val/perplexity`` at evaluations,
    ``memory/rank{r}/<field>`` (MiB),
    ``memory/rank{r}/verdict`` (:data:`VERDICT_CODES`), ``memory/rank{r}/slope_mib_per_step``,
    ``gc/rank{r}/pause_s`` at steps with a GC, text ``memory/verdict`` when a verdict changes,
    text ``mesh/ranks`` (every rank's mesh coordinates, at the first step recorded), and,
    for MoE models, ``moe/aux_loss``, ``moe/layer{L}/load_max_over_mean`` and
    ``moe/layer{L}/expert{e}_share``.

    Events are written by the calling thread with tensorboardX's ``EventsWriter`` (TensorBoard's
    event-file format), not by ``SummaryWriter``'s background thread: a failed write (a full disk)
    raises here, with the path, instead of killing that thread and leaving its bounded queue to
    block every later call."""

    def __init__(self, tb_dir: str | Path, purge_step: int | None = None):
        from tensorboardX.event_file_writer import EventsWriter

        self.tb_dir = tb_dir
        Path(tb_dir).mkdir(parents=True, exist_ok=True)
        # A new file name even within the same second (tensorboardX names files by the second).
        suffix = "" if purge_step is None else f".{time.time_ns()}"
        self._events = EventsWriter(os.path.join(str(tb_dir), "events"), suffix)
        if purge_step is not None:  # TensorBoard drops earlier writers' events from this step on (replays)
            from tensorboardX.proto.event_pb2 import Event, SessionLog

            self._events.write_event(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))

    def _write(self, step: int, summary: Any) -> None:
        from tensorboardX.proto.event_pb2 import Event

        self._events.write_event(Event(wall_time=time.time(), step=step, summary=summary))

    def add_scalars(self, step: int, values: list[tuple[str, float]]) -> None:
        """All of a step's scalars as one event: one Summary with a value per tag, which
        TensorBoard reads as separate series (as TF1's merged summaries). ``add_scalar`` would
        make an event per tag: about 25 of them per step, each pickled through tensorboardX's
        multiprocessing queue, took most of the collector's CPU time outside Ray."""
        from tensorboardX.proto.summary_pb2 import Summary

        if values:
            self._write(step, Summary(value=[Summary.Value(tag=k, simple_value=float(v)) for k, v in values]))

    def add_text(self, tag: str, text: str, step: int) -> None:
        """A text entry (Markdown) at ``step``, shown in TensorBoard's Text tab."""
        from tensorboardX.summary import text as text_summary

        self._write(step, text_summary(tag, text))

    def add_expert_load(self, step: int, load: dict[int, list[int]], shares: bool = True) -> None:
        """:func:`expert_load_scalars` at ``step``."""
        self.add_scalars(step, expert_load_scalars(load, shares))

    def flush(self) -> None:
        """Write what is buffered and fsync it. Raises ``OSError`` (a full disk)."""
        self._events.flush()

    def close(self) -> None:
        self._events.close()
