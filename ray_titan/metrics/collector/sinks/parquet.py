"""Parquet: every rank's row of every step, ``<run_dir>/metrics/steps.parquet``
(:data:`~ray_titan.metrics.schema.STEP_SCHEMA`).

Rows are appended in parts, ``<run_dir>/metrics/parts/part-NNNNN.parquet``, each written whole
(temporary file, then rename) so a crash loses at most the rows not yet flushed. On close the
parts are consolidated into ``steps.parquet``; ``ray_titan.metrics.reading.steps.read_steps`` reads
the consolidated file, or the parts when a crash left no consolidated file.

Layout of ``steps.parquet`` (docs/metrics.md): rows sorted by rank, then step; each row group holds
whole ranks, a block of consecutive ranks of about :data:`ROW_GROUP_ROWS` rows, so the ``rank``
column's min/max statistics let a reader skip every other group
(``ray_titan.metrics.reading.steps.read_rank_history`` reads one rank's history from the one group
that holds it). The consolidation streams: the parts are read one at a time and spilled by rank
block into at most :data:`_MAX_BUCKETS` Arrow IPC files, then each is sorted and written, so its
memory is a part plus a bucket, not the table.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ray_titan.metrics.collector.sinks.base import Sink, StepRecord
from ray_titan.metrics.collector.sinks.step_table import StepTableBuffer
from ray_titan.metrics.schema import STEP_SCHEMA

__all__ = ["ROW_GROUP_ROWS", "ParquetSink", "consolidate", "latest_rows", "read_raw_parts"]


class ParquetSink(Sink):
    """The steps' rows, held in columns (:class:`~ray_titan.metrics.collector.sinks.step_table.StepTableBuffer`)
    and written as a Parquet part at each :meth:`flush`; :meth:`close` consolidates the parts into
    ``steps.parquet`` (:attr:`steps_path`)."""

    def __init__(self, metrics_dir: str | Path):
        self.dir = Path(metrics_dir)
        self.parts = self.dir / "parts"
        self.parts.mkdir(parents=True, exist_ok=True)
        self.rows = StepTableBuffer()  # assembled steps until the next flush
        self._tables: list[pa.Table] = []
        # Continue after the highest existing part, so a restarted writer never overwrites one.
        existing = [int(p.stem.split("-")[1]) for p in self.parts.glob("part-*.parquet")]
        self._n = max(existing, default=-1) + 1
        self.steps_path: Path | None = None

    def log(self, record: StepRecord) -> None:
        """Hold the step's rows for the next part."""
        self.rows.add(record.table)

    def unflushed_steps(self) -> list[int]:
        """The steps of the rows queued for a part, sorted."""
        return sorted({s for t in self._tables for s in t["step"].to_pylist()})

    def flush(self) -> None:
        """Write the held rows as the next part file (atomically) and forget them. On a write
        error (a full disk) the partial file is removed, the rows are kept for the next flush, and
        ``OSError`` is raised naming the file and the cause."""
        table = self.rows.take()
        if table is not None:
            self._tables.append(table)
        if not self._tables:
            return
        table = pa.concat_tables(self._tables)
        path = self.parts / f"part-{self._n:05d}.parquet"
        _write_atomically(table, path)
        self._n += 1
        self._tables = []

    def close(self) -> None:
        """Flush, write ``steps.parquet`` from all parts (one row per step and rank,
        :func:`latest_rows`; sorted by rank and step, one row group per block of ranks: module
        docstring), keep its path in :attr:`steps_path` and remove the parts. Calling it again
        changes nothing. Raises ``OSError`` naming the file when it cannot be written (the parts
        stay)."""
        if self.steps_path is not None:
            return
        self.flush()
        out = self.dir / "steps.parquet"
        consolidate(sorted(self.parts.glob("part-*.parquet")), out)  # the parts stay if this fails
        for p in list(self.parts.glob("part-*.parquet")) + list(self.parts.glob("*.tmp")):
            p.unlink()
        try:
            self.parts.rmdir()
        except OSError:  # something else was put there; the consolidated file is complete anyway
            pass
        self.steps_path = out


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


