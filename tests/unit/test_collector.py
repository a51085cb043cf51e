"""The metrics collector as a plain object (no Ray): assembly, errors, sinks, crash safety."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute
import pytest

from ray_titan.metrics.collector.collector import MetricsCollector
from ray_titan.metrics.fields import MEMORY_FIELDS
from ray_titan.metrics.packing import MOE_PAD, pack_reports
from ray_titan.metrics.reading.steps import read_steps
from ray_titan.metrics.worker.memory import host_memory, sample_memory
from ray_titan.metrics.worker.report import StepReport
from ray_titan.parallel.dims import ParallelDims


def _report(step, rank, dims, loss=None, tokens=256, step_time=0.5, rss=100 << 20):
    mem = dict.fromkeys(MEMORY_FIELDS)
    mem.update(host_rss_bytes=rss + rank, host_peak_rss_bytes=rss + rank + 1)
    return StepReport(
        step=step, rank=rank, coords=dims.coords(rank), is_last_stage=dims.is_last_stage_rank(rank),
        loss=loss, tokens=tokens, step_time_s=step_time, data_time_s=0.01, fwd_bwd_time_s=0.3,
        optim_time_s=0.1, grad_norm=1.5, lr=1e-3, memory=mem, gc_pause_s=0.0, time=1000.0 + step,
    ).to_dict()


def _collector(tmp_path, dims, steps=10, **kw):
    return MetricsCollector(str(tmp_path), dims.world_size, dims.last_stage_ranks(), steps, **kw)


def test_loss_is_the_token_weighted_mean_of_the_last_stage(tmp_path):
    dims = ParallelDims(pp=2, dp_shard=2)
    c = _collector(tmp_path, dims, steps=1, log_freq=1)
    # Ranks report in any order and in separate batches.
    c.report([_report(1, 3, dims, loss=3.0, tokens=300, step_time=0.6)])
    c.report([_report(1, 0, dims)])
    c.report([_report(1, 2, dims, loss=2.0, tokens=100)])
    assert c.tally.assembled == 0  # rank 1 has not reported
    c.report([_report(1, 1, dims)])
    summary = c.finish()
    assert summary["errors"] == []
    assert summary["final_loss"] == pytest.approx((2.0 * 100 + 3.0 * 300) / 400)
    t = read_steps(tmp_path)
    assert t.num_rows == 4 and t["rank"].to_pylist() == [0, 1, 2, 3]
    assert t["loss"].to_pylist() == [None, None, 2.0, 3.0]
    assert t["pp"].to_pylist() == [0, 0, 1, 1] and t["dp_shard"].to_pylist() == [0, 1, 0, 1]
    assert set(t["step_loss_max"].to_pylist()) == {3.0}
    assert t["step_tokens_per_s"].to_pylist() == pytest.approx([400 / 0.6] * 4)
    line = summary["lines"][0]
    assert "loss   2.7500" in line and "r0:100 r1:100 r2:100 r3:100" in line


def test_missing_or_misplaced_loss_is_an_error_not_a_gap(tmp_path):
    dims = ParallelDims(pp=2, dp_shard=1)
    c = _collector(tmp_path, dims, steps=3)
    c.report([_report(1, 0, dims), _report(1, 1, dims, loss=None)])  # last stage without loss
    c.report([_report(2, 0, dims, loss=1.0), _report(2, 1, dims, loss=2.0)])  # placeholder on stage 0
    c.report([_report(3, 0, dims)])  # rank 1 never reports step 3
    summary = c.finish()
    errors = summary["errors"]
    assert summary["final_loss"] == 2.0  # the newest assembled step; step 3 never completed
    assert "step 1: last-stage rank 1 reported no loss" in errors
    assert "step 2: rank 0 is not on the last stage but reported a loss" in errors
    assert "step 3: no report from rank(s) [1]" in errors
    t = read_steps(tmp_path)
    assert t.filter(t["step"].to_numpy() == 2)["step_loss"].to_pylist() == [2.0, 2.0]


def test_every_step_recorded_whatever_log_freq(tmp_path):
    dims = ParallelDims(pp=1, dp_shard=2)
    c = _collector(tmp_path, dims, steps=25, log_freq=1000, flush_every_steps=7)
    for step in range(1, 26):
        c.report([_report(step, r, dims, loss=1.0) for r in range(2)])
    summary = c.finish()
    assert [ln.split("|")[0].split()[1] for ln in summary["lines"] if ln.startswith("step")] == ["1/25", "25/25"]
    t = read_steps(tmp_path)
    assert t.num_rows == 50 and sorted(set(t["step"].to_pylist())) == list(range(1, 26))


def test_flushed_parts_survive_a_crash(tmp_path):
    dims = ParallelDims(pp=1, dp_shard=1)
    c = _collector(tmp_path, dims, steps=100, flush_every_steps=10)
    for step in range(1, 26):
        c.report([_report(step, 0, dims, loss=1.0)])
    # No finish(): the collector died. Every flushed step is readable, the tail (21..25) is lost.
    t = read_steps(tmp_path)
    assert t["step"].to_pylist() == list(range(1, 21))
    assert not (tmp_path / "metrics" / "steps.parquet").exists()


def test_memory_sample_reads_proc():
    rss, peak = host_memory()
    assert 10 << 20 < rss <= peak
    import torch

    s = sample_memory(torch.device("cpu"))
    assert set(s) == set(MEMORY_FIELDS)
    assert s["host_rss_bytes"] > 0 and s["device_allocated_bytes"] is None
    before = host_memory()[0]
    block = bytearray(64 << 20)
    block[:: 4096] = b"x" * len(block[:: 4096])  # touch every page
    assert host_memory()[0] - before > 48 << 20
    del block


def test_memory_sampler_reads_rss_every_step_and_slow_fields_per_interval(monkeypatch):
    import torch

    import ray_titan.metrics.worker.memory as memory

    reads = []
    monkeypatch.setattr(memory, "host_heap", lambda: (reads.append(1), (len(reads), 7))[1])
    slow = memory.MemorySampler(torch.device("cpu"), slow_interval_s=3600)
    first = slow.sample()
    block = bytearray(64 << 20)
    block[:: 4096] = b"x" * len(block[:: 4096])
    second = slow.sample()
    # RSS is read afresh (the held /proc fd is re-read), malloc's figures carried from the first read.
    assert second["host_rss_bytes"] - first["host_rss_bytes"] > 48 << 20
    assert second["host_peak_rss_bytes"] >= second["host_rss_bytes"]
    assert len(reads) == 1 and second["host_heap_in_use_bytes"] == first["host_heap_in_use_bytes"] == 1
    assert second["host_available_bytes"] == first["host_available_bytes"]
    every = memory.MemorySampler(torch.device("cpu"))  # the default pairs every RSS with malloc's figures
    assert [every.sample()["host_heap_in_use_bytes"] for _ in range(2)] == [2, 3]
    slow.close(), every.close()
    del block


def test_finish_is_idempotent_and_parts_never_overwritten(tmp_path):
    dims = ParallelDims(pp=1, dp_shard=1)
    parts = tmp_path / "metrics" / "parts"
    parts.mkdir(parents=True)
    (parts / "part-00003.parquet.tmp").write_bytes(b"torn write from a crash")
    c = _collector(tmp_path, dims, steps=4, flush_every_steps=2)
    for step in range(1, 5):
        c.report([_report(step, 0, dims, loss=float(step))])
    assert sorted(p.name for p in parts.glob("*.parquet")) == ["part-00000.parquet", "part-00001.parquet"]
    first = c.finish()
    again = c.finish()
    assert first["final_loss"] == again["final_loss"] == 4.0
    assert read_steps(tmp_path)["step"].to_pylist() == [1, 2, 3, 4]
    assert not parts.exists()


def test_errors_are_bounded(tmp_path):
    from ray_titan.metrics.collector.errors import ErrorLog

    dims = ParallelDims(pp=2, dp_shard=1)
    c = _collector(tmp_path, dims, steps=3000, flush_every_steps=1000)
    for step in range(1, 1201):
        c.report([_report(step, 0, dims), _report(step, 1, dims)])  # the last stage never has a loss
    summary = c.finish()
    assert c.errors.total == 1200 and len(summary["errors"]) == ErrorLog.MAX + 1


def test_final_loss_is_never_stale(tmp_path):
    dims = ParallelDims(pp=1, dp_shard=1)
    c = _collector(tmp_path, dims, steps=2)
    c.report([_report(1, 0, dims, loss=3.0), _report(2, 0, dims, loss=None)])
    summary = c.finish()
    assert summary["final_loss"] is None and "step 2: last-stage rank 0 reported no loss" in summary["errors"]


def _attempt(rep, start):
    rep["attempt_start_time"] = start
    return rep


def test_replayed_steps_replace_the_lost_ones_and_the_restart_is_marked(tmp_path):
    dims = ParallelDims(pp=1, dp_shard=2)
    c = _collector(tmp_path, dims, steps=6, flush_every_steps=1)
    def skipped(rep, skip):
        rep["skipped_update"] = skip
        return rep

    for step in (1, 2, 3):  # step 3's update skipped in the first attempt, applied in the replay
        c.report([skipped(_attempt(_report(step, r, dims, loss=1.0), 100.0), step == 3) for r in range(2)])
    c.report([_attempt(_report(4, 0, dims, loss=9.0), 100.0)])  # rank 1 died during step 4
    # The restarted group resumes from the checkpoint of step 2 and replays 3 and 4.
    for step in (3, 4, 5, 6):
        answer = c.report([skipped(_attempt(_report(step, r, dims, loss=2.0), 200.0), step == 5) for r in range(2)])
    c.report([_attempt(_report(2, 0, dims, loss=1.0), 100.0)])  # resent from the checkpoint: known
    assert answer["durable"] == {100.0: 3, 200.0: 6}
    summary = c.finish()
    assert summary["errors"] == [] and summary["restarts"] == 1 and summary["final_loss"] == 2.0
    # Each step counts once, as its newest attempt ran it (RunResult.skipped_steps, steps_run).
    assert summary["skipped_steps"] == 1 and summary["steps_run"] == 6
    t = read_steps(tmp_path)
    rows = list(zip(t["step"].to_pylist(), t["rank"].to_pylist(), t["attempt"].to_pylist(), t["loss"].to_pylist()))
    assert rows == [(s, r, int(s >= 3), 1.0 if s < 3 else 2.0) for s in range(1, 7) for r in range(2)]
    # The reader is the [test] extra's (the project writes with tensorboardX): where it is absent
    # (an environment of the runtime dependencies only) the checks above ran, this one skips.
    tb = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                             reason="tensorboard (the [test] extra's event-file reader) is not installed")
    acc = tb.EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()  # the restart purged step 3 of the first attempt
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [
        (1, 1.0), (2, 1.0), (3, 2.0), (4, 2.0), (5, 2.0), (6, 2.0)]


def test_restarted_collector_resumes_from_its_flushed_parts(tmp_path, monkeypatch):
    from ray_titan.metrics.collector import resume

    dims = ParallelDims(pp=1, dp_shard=1)
    c = _collector(tmp_path, dims, steps=6, flush_every_steps=2, log_freq=1)
    for step in (1, 2, 3):
        first = c.report([_report(step, 0, dims, loss=float(step))])
    assert first["durable"] == {0.0: 2}
    shown = c.poll()
    assert [line.split("|")[0].strip() for line in shown["lines"] if line.startswith("step")] == \
        ["step 1/6", "step 2/6", "step 3/6"] and "warming_up at step 1" in shown["lines"][1]
    del c  # killed: step 3 was assembled but not flushed
    monkeypatch.setattr(resume, "reconstructed", lambda: True)  # Ray restarted the actor
    again = _collector(tmp_path, dims, steps=6, flush_every_steps=2, log_freq=1)
    assert again.incarnation != first["incarnation"] and again.tally.last_step == 2 and again.tally.final_loss == 2.0
    answer = again.report([_report(s, 0, dims, loss=float(s)) for s in (1, 2, 3, 4, 5, 6)])  # the worker resends
    assert answer["durable"] == {0.0: 6}  # 6 assembled and flushed; 1 and 2 were ignored
    # The console goes on where it was: step 3 is not shown again, the verdict does not warm up again.
    lines = again.poll(shown_step=shown["latest"]["step"])["lines"]
    assert lines[0].startswith("ray_titan: metrics collector restarted; 2 steps were on disk")
    assert [line.split("|")[0].strip() for line in lines[1:]] == ["step 4/6", "step 5/6", "step 6/6"]
    summary = again.finish()
    assert summary["errors"] == [] and summary["final_loss"] == 6.0
    assert read_steps(tmp_path)["step"].to_pylist() == [1, 2, 3, 4, 5, 6]






def test_per_step_bookkeeping_stays_as_small_as_the_unflushed_steps(tmp_path):
    dims = ParallelDims(pp=1, dp_shard=2)
    c = _collector(tmp_path, dims, steps=2000, flush_every_steps=10, enable_tensorboard=False)
    for step in range(1, 2001):
        answer = c.report([_report(step, 0, dims, loss=1.0), _report(step, 1, dims, loss=1.0)])
    assert answer["durable"] == {0.0: 2000}
    assert c.durable.pending() == 0 and c.intake.pending() == 0
    # A late resend of a long-flushed step is still recognised and ignored.
    c.report([_report(7, 0, dims, loss=9.0), _report(7, 1, dims, loss=9.0)])
    assert c.finish()["errors"] == []
    t = read_steps(tmp_path)
    assert t.num_rows == 4000 and set(t.filter(pa.compute.equal(t["step"], 7))["loss"].to_pylist()) == {1.0}


def test_tensor_parallel_ranks_count_their_loss_and_tokens_once(tmp_path):
    # pp=2 × dp_shard=2 × tp=2: ranks 4..7 hold the last stage; (4, 5) and (6, 7) are tp pairs
    # of one DP rank each, holding the same loss and batch.
    dims = ParallelDims(pp=2, dp_shard=2, tp=2)
    assert dims.last_stage_ranks() == [4, 5, 6, 7]
    c = _collector(tmp_path, dims, steps=1, log_freq=1)
    losses = {4: (2.0, 100), 5: (2.0, 100), 6: (3.0, 300), 7: (3.0, 300)}
    c.report([_report(1, r, dims, *losses.get(r, (None, 256))) for r in range(8)])
    summary = c.finish()
    assert summary["errors"] == []
    assert summary["final_loss"] == pytest.approx((2.0 * 100 + 3.0 * 300) / 400)
    t = read_steps(tmp_path)
    assert t["step_tokens"].to_pylist() == [400] * 8  # not 800: each DP rank's batch once
    assert t["tp"].to_pylist() == [0, 1] * 4 and t["dp_shard"].to_pylist() == [0, 0, 1, 1] * 2


def _moe_report(step, rank, dims, **kw):
    rep = _report(step, rank, dims, loss=2.0 + rank / 100 if dims.is_last_stage_rank(rank) else None, **kw)
    rep.update(aux_loss=0.01 * rank, moe_layers=[2 * rep["coords"]["pp"], 2 * rep["coords"]["pp"] + 1],
               expert_load=[[rank + step, 3], [1, 2 * rank]], source_tokens=[rank, 5],
               val_loss=1.5 if step == 2 and dims.is_last_stage_rank(rank) else None,
               val_tokens=7 if step == 2 else None, node=f"n{rank // 4}", world_size=dims.world_size)
    rep["memory"] = dict(rep["memory"], device_allocated_bytes=(rank + 1) << 20,
                         device_peak_reserved_bytes=(rank + 2) << 20)
    return rep


def test_a_groups_reports_in_columns_make_the_same_rows_as_one_call_per_rank(tmp_path):
    """What a metrics aggregator forwards (a group's reports packed in columns) is assembled into
    exactly the rows the ranks' own calls make: MoE load, mixtures, validation, device fields."""
    from ray_titan.metrics.packing import pack_reports

    dims = ParallelDims(pp=2, dp_shard=4)
    per_rank, packed = _collector(tmp_path / "a", dims, steps=3), _collector(tmp_path / "b", dims, steps=3)
    for step in range(1, 4):
        reps = [_moe_report(step, r, dims) for r in range(8)]
        for rep in reps:
            per_rank.report([rep])
        for group in (reps[4:], reps[:4]):  # groups arrive in any order
            packed.report(pack_reports(group))
    assert per_rank.finish()["errors"] == [] and packed.finish()["errors"] == []
    a, b = read_steps(tmp_path / "a"), read_steps(tmp_path / "b")
    assert a.num_rows == 24 and a.equals(b)
    assert a["expert_load"][0].as_py() == [[1, 3], [1, 0]] and a["step_val_loss"].to_pylist()[8] == 1.5


def test_stages_holding_different_numbers_of_moe_layers_keep_their_load(tmp_path):
    """The MoE job's pipeline: stage 0 holds one MoE layer, stage 1 two. Blocks of different
    shapes (one call packing ranks of both stages, as an aggregator does, and each rank's own call)
    are padded, not dropped, and the padding is neither written nor counted."""
    dims = ParallelDims(pp=2, dp_shard=2)
    c = _collector(tmp_path, dims, steps=1)
    reps = []
    for r in range(4):
        rep = _moe_report(1, r, dims)
        first = rep["coords"]["pp"] == 0
        rep.update(moe_layers=[1] if first else [2, 3], expert_load=[[r, 1]] if first else [[r, 2], [3, r]])
        reps.append(rep)
    mixed = pack_reports([reps[0], reps[2]])["moe"]
    assert mixed is not None and mixed[0].tolist() == [[1, MOE_PAD], [2, 3]]
    c.report([reps[0], reps[2]])
    c.report([reps[1]])
    c.report([reps[3]])
    assert c.finish()["errors"] == []
    t = read_steps(tmp_path)
    assert t["moe_layers"].to_pylist() == [[1], [1], [2, 3], [2, 3]]
    assert t["expert_load"].to_pylist() == [[[0, 1]], [[1, 1]], [[2, 2], [3, 2]], [[3, 2], [3, 3]]]


@pytest.mark.parametrize("chunk_rows", [4096, 3])
def test_steps_of_one_flush_keep_their_own_moe_shapes_and_missing_figures(tmp_path, chunk_rows):
    """The rows of a flush are built in one go over its steps, or over chunks of them
    (``ray_titan.metrics.collector.sinks.step_table``; ``chunk_rows`` = 3 splits the 8 rows unevenly):
    steps whose MoE reports pack into blocks, ragged ones (expert counts differ between layers)
    and dense ones keep their own layers and load; a NaN loss stays NaN while a step without a
    loss has null, and a group size reported at one step only is in that step's rows only."""
    dims = ParallelDims(pp=1, dp_shard=2)
    c = _collector(tmp_path, dims, steps=4, flush_every_steps=10)
    c.parquet.rows.chunk_rows = chunk_rows
    for step in range(1, 5):
        reps = [_report(step, r, dims, loss=[1.0, float("nan"), None, 2.0][step - 1]) for r in range(2)]
        if step == 1:  # blocks: two layers of two experts
            for r, rep in enumerate(reps):
                rep.update(moe_layers=[0, 1], expert_load=[[r, 1], [2, r]], world_size=2)
        if step == 2:  # ragged: the layers count 2 and 3 experts
            for r, rep in enumerate(reps):
                rep.update(moe_layers=[0, 1], expert_load=[[r, 1], [2, r, 4]])
        c.report(reps)
    errors = c.finish()["errors"]
    assert errors == ["step 3: last-stage rank 0 reported no loss", "step 3: last-stage rank 1 reported no loss"]
    t = read_steps(tmp_path).sort_by([("step", "ascending"), ("rank", "ascending")])
    assert t["moe_layers"].to_pylist() == [[0, 1]] * 4 + [[]] * 4
    assert t["expert_load"].to_pylist() == [[[0, 1], [2, 0]], [[1, 1], [2, 1]], [[0, 1], [2, 0, 4]],
                                            [[1, 1], [2, 1, 4]]] + [[]] * 4
    loss = t["step_loss"].to_pylist()
    assert loss[:2] == [1.0, 1.0] and all(x != x for x in loss[2:4]) and loss[4:6] == [None, None]
    assert t["world_size"].to_pylist() == [2, 2] + [None] * 6


def test_beyond_16_ranks_the_console_and_the_sinks_summarise(tmp_path, monkeypatch):
    """32 ranks (pp=2 × dp_shard=16), rank 7 leaking: the console line gives min / median / max of
    memory with the extreme ranks, the verdict counts naming the growing rank and a per-stage
    maximum; verdict changes of many ranks are counted, the growing one named; TensorBoard gets
    per-rank series beyond ``series_max_ranks`` only for the growing rank, and stage summaries."""
    dims = ParallelDims(pp=2, dp_shard=16)
    leak = {"window": 8, "threshold_mib_per_step": 0.1, "host_threshold_mib_per_step": 0.1, "warmup_max_steps": 8}
    from ray_titan.metrics.collector.sinks.tensorboard import TensorBoardSink

    logged: dict[int, dict[str, float]] = {}
    monkeypatch.setattr(TensorBoardSink, "add_scalars",
                        lambda self, step, values: logged.setdefault(step, {}).update(values))
    c = _collector(tmp_path, dims, steps=20, log_freq=20, leak=leak, series_max_ranks=4)
    for step in range(1, 21):
        c.report([_report(step, r, dims, loss=1.0 if dims.is_last_stage_rank(r) else None,
                          rss=(100 << 20) + (step * 4 << 20 if r == 7 else 0)) for r in range(32)])
    lines = c.finish()["lines"]
    last = next(ln for ln in lines if ln.startswith("step 20/20"))
    assert "32 ranks" in last and f"max {100 + 80:.0f} (r7)" in last and "min 100 (r0)" in last
    assert "memory 31 stable, 0 warming_up, 1 growing (r7)" in last
    assert "by stage: pp0 180 (r7), pp1 100 (r31)" in last
    assert "r0:100" not in last  # no per-rank list
    assert "memory: 32 rank(s) now warming_up at step 1" in lines
    assert sum("growing" in ln and ln.startswith("memory: rank 7 (pp=0, dp_shard=7)") for ln in lines) == 1
    tags = logged[20]
    assert {t.split("/")[1] for t in tags if t.startswith("memory/rank") and "/" in t[7:]} == {"rank7"}
    assert tags["memory/ranks_growing"] == 1 and tags["memory/pp0/host_rss_max_mib"] == pytest.approx(180)
    assert tags["memory/all/host_rss_median_mib"] == pytest.approx(100)


def test_the_completeness_check_names_missing_rows_and_counts_steps_in_batches(tmp_path):
    """``steps.parquet`` read back in batches (16K ranks × 10k steps is 164M rows): a step with a
    rank missing, a step with no row at all, a smaller elastic group, skipped updates, restarts."""
    import pyarrow.parquet as pq

    from ray_titan.metrics.collector.completeness import check_complete

    rows = [(s, r) for s in (1, 2, 4) for r in range(4) if (s, r) != (2, 1)] + [(5, r) for r in range(2)]
    path = tmp_path / "steps.parquet"
    pq.write_table(pa.table({
        "step": [s for s, _ in rows], "rank": [r for _, r in rows],
        "skipped_update": [s == 4 for s, _ in rows], "attempt": [int(s >= 4) for s, _ in rows],
        "world_size": [2 if s == 5 else 4 for s, _ in rows]}), path, row_group_size=3)
    found = check_complete(path, world_size=4, first_step=None)
    assert found.errors() == ["step 2: the metrics table has no row for rank(s) [1]",
                              "step 3: the metrics table has no row for rank(s) [0, 1, 2, 3]"]
    assert (found.steps_run, found.skipped_steps, found.restarts) == (4, 1, 1)


def test_any_job_name_is_a_label_value_rays_gauges_take(monkeypatch):
    """Ray's gauges encode label values as ASCII: a ``job.name`` of ``café`` stopped the whole
    Prometheus export. :func:`label_value` makes any name ASCII (accents dropped, other
    characters escaped, so names stay apart) and the export passes every label through it: Ray's
    real gauges take the run's job label here (a gauge records in-process; no cluster starts)."""
    import numpy as np

    from ray_titan.metrics.collector import ray_metrics

    pytest.importorskip("ray", reason="Ray's gauges (the compatibility job's venv without Ray has none)")
    monkeypatch.setattr(ray_metrics, "_last_memory", [float("-inf")])  # the memory gauges are set too
    ray_metrics._export("café-20261127-120000", 1, {"loss": 2.0}, np.array([0, 1]), np.array([0, 1]),
                        {"device_allocated_bytes": np.array([np.nan, np.nan]), "host_rss_bytes": np.array([1e9, 2e9])})
    assert ray_metrics.label_value("café-20261127-120000") == "cafe-20261127-120000"
    assert ray_metrics.label_value("日本") == "\\u65e5\\u672c" != ray_metrics.label_value("本日")
    assert ray_metrics.label_value("a plain-job_1") == "a plain-job_1"


def test_steps_missing_before_the_first_recorded_are_errors_naming_them(tmp_path):
    """Issue 44, finding 2: reports of steps 1-2 lost (a collector killed before flushing them)
    and steps 3-4 on disk: the completeness check began at step 3, so rc 0 and "done". A run that
    started at step 1 now counts from there, naming each step and its ranks."""
    dims = ParallelDims(dp_shard=2)
    c = _collector(tmp_path, dims, steps=4, first_step=1, enable_tensorboard=False)
    for step in (3, 4):
        c.report([_report(step, r, dims, loss=1.0 if dims.is_last_stage_rank(r) else None) for r in range(2)])
    errors = c.finish()["errors"]
    assert errors == ["step 1: the metrics table has no row for rank(s) [0, 1]",
                      "step 2: the metrics table has no row for rank(s) [0, 1]"], errors
    resumed = _collector(tmp_path / "resumed", dims, steps=4, enable_tensorboard=False)  # first step unknown
    resumed.report([_report(3, r, dims, loss=1.0 if dims.is_last_stage_rank(r) else None) for r in range(2)])
    assert resumed.finish()["errors"] == []
