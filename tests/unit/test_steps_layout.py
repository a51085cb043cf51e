"""``steps.parquet``'s layout: one row per (step, rank) of the newest attempt, sorted by rank then
step, row groups of whole ranks, so one rank's history is one row group
(ray_titan.metrics.collector.sinks.parquet)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from benchmarks.metrics_scale import synthetic_steps
from ray_titan.metrics.collector.sinks import parquet as sinks
from ray_titan.metrics.collector.sinks.parquet import ParquetSink, _write_atomically
from ray_titan.metrics.reading.steps import rank_row_groups, read_rank_history, read_steps

RANKS, STEPS = 48, 30


def _attempt(t: pa.Table, start: float) -> pa.Table:
    i = t.schema.get_field_index("attempt_start_time")
    return t.set_column(i, "attempt_start_time", pa.array([start] * t.num_rows))


def _parts() -> list[pa.Table]:
    """Steps 1-20 of attempt A (step 20 sent twice), then B replays 16-30 on fewer ranks (an elastic
    resize: ranks 40-47 are gone), so A's rows of 16-20 must all go, those of ranks 40-47 too."""
    a = _attempt(synthetic_steps(RANKS, 20), 100.0)
    b = synthetic_steps(RANKS, 15, first_step=16, seed=1)
    b = _attempt(b.filter(pc.less(b["rank"], 40)), 200.0)
    return [a.slice(0, a.num_rows // 2), a.slice(a.num_rows // 2), a.slice(a.num_rows - RANKS), b]


def _expected(parts: list[pa.Table]) -> dict[tuple[int, int], tuple[float, int]]:
    """(step, rank) → (step time, attempt), by the rule in plain Python."""
    rows = [r for t in parts for r in t.select(["step", "rank", "attempt_start_time", "step_time_s"]).to_pylist()]
    starts = sorted({r["attempt_start_time"] for r in rows})
    newest = {}
    for r in rows:
        newest[r["step"]] = max(newest.get(r["step"], 0.0), r["attempt_start_time"])
    return {(r["step"], r["rank"]): (r["step_time_s"], starts.index(r["attempt_start_time"]))
            for r in rows if r["attempt_start_time"] == newest[r["step"]]}


@pytest.mark.parametrize("spill", [False, True], ids=["in-memory", "spilled"])
def test_steps_parquet_is_one_row_per_step_and_rank_in_rank_blocks(tmp_path, monkeypatch, spill):
    monkeypatch.setattr(sinks, "ROW_GROUP_ROWS", 5 * STEPS)  # 5 ranks per row group
    if spill:  # the streamed consolidation: every part split into several bucket files
        monkeypatch.setattr(sinks, "_BUCKET_ROWS", 12 * STEPS)
    parts = _parts()
    sink = ParquetSink(tmp_path / "metrics")
    for i, t in enumerate(parts):
        _write_atomically(t, sink.parts / f"part-{i:05d}.parquet")
    sink.close()
    path = sink.steps_path
    assert not (tmp_path / "metrics" / "parts").exists()

    t = pq.read_table(path)
    cols = (t[c].to_pylist() for c in ("step", "rank", "step_time_s", "attempt"))
    got = {(s, r): (x, a) for s, r, x, a in zip(*cols)}
    assert got == _expected(parts) and t.num_rows == len(got)
    # On disk: by rank, then step; each row group holds whole ranks, in increasing blocks.
    assert list(zip(t["rank"].to_pylist(), t["step"].to_pylist())) == sorted((r, s) for s, r in got)
    meta = pq.ParquetFile(path).metadata
    col = meta.schema.names.index("rank")
    bounds = [(meta.row_group(i).column(col).statistics.min, meta.row_group(i).column(col).statistics.max)
              for i in range(meta.num_row_groups)]
    assert all(hi < lo2 for (_, hi), (lo2, _) in zip(bounds, bounds[1:])) and meta.num_row_groups == RANKS // 5 + 1
    # One rank's history: one row group read; the same rows as filtering the whole table.
    assert rank_row_groups(meta, 42) == [8]
    hist = read_rank_history(tmp_path, 42, columns=["step", "step_time_s"])
    assert hist.column_names == ["step", "step_time_s"]
    assert hist["step"].to_pylist() == list(range(1, 16))  # rank 42 left with the resize
    assert hist["step_time_s"].to_pylist() == [got[(s, 42)][0] for s in range(1, 16)]
    # read_steps keeps its order (step, then rank) for the readers that rely on it.
    assert list(zip(*(read_steps(tmp_path)[c].to_pylist() for c in ("step", "rank")))) == sorted(got)


def test_rank_history_of_an_unfinished_run_reads_the_parts(tmp_path):
    sink = ParquetSink(tmp_path / "metrics")
    for i, t in enumerate(_parts()):
        _write_atomically(t, sink.parts / f"part-{i:05d}.parquet")
    hist = read_rank_history(tmp_path, 3)
    assert hist["step"].to_pylist() == list(range(1, 31)) and set(hist["rank"].to_pylist()) == {3}
    assert hist["attempt"].to_pylist() == [0] * 15 + [1] * 15


@pytest.mark.parametrize("spill", [False, True], ids=["in-memory", "spilled"])
def test_ranks_only_a_replaced_attempt_had_leave_no_gap(tmp_path, monkeypatch, spill):
    """An elastic shrink replays steps 1-3 on ranks 5-9: ranks 0-4 vanish, and the rank block
    that held ranks 3-5 starts at a rank with no rows left."""
    monkeypatch.setattr(sinks, "ROW_GROUP_ROWS", 3 * 3)
    if spill:
        monkeypatch.setattr(sinks, "_BUCKET_ROWS", 10)
    a = _attempt(synthetic_steps(10, 3), 100.0)
    b = _attempt(a.filter(pc.greater_equal(a["rank"], 5)), 200.0)
    sink = ParquetSink(tmp_path / "metrics")
    for i, t in enumerate([a, b]):
        _write_atomically(t, sink.parts / f"part-{i:05d}.parquet")
    sink.close()
    t = pq.read_table(sink.steps_path)
    kept = sorted(zip(t["rank"].to_pylist(), t["step"].to_pylist()))
    assert kept == [(r, s) for r in range(5, 10) for s in (1, 2, 3)]
    assert t.num_rows == 15 and set(t["attempt"].to_pylist()) == {1}
