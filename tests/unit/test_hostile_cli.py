"""Hostile input to the commands (issue 44: findings 3, 5, 8, 10): mesh-sized work is bounded,
every command's bad input is one line and exit 2, malformed run files are named, not traced."""

from __future__ import annotations

import json
import time

import pytest

from ray_titan.config import load_config
from ray_titan.models.registry import FAMILIES
from ray_titan.preflight import plan_ranks
from ray_titan.preflight.memory_plan import LISTED_RANKS, MemoryPlan, memory_plan

_BIG = ["--parallelism.pp=2", "--training.global_batch_size={gbs}", "--parallelism.microbatches=2"]


def _mesh(dp_shard: int) -> list[str]:
    return [o.format(gbs=2 * dp_shard) for o in _BIG] + [f"--parallelism.dp_shard={dp_shard}"]


def test_a_plan_over_the_listed_ranks_is_one_record_per_pipeline_rank_with_the_same_figures(monkeypatch):
    # 4,096 ranks: before, 4,096 records; 2^20 ranks took 6 GB and ~50 s before any output.
    cfg = load_config(None, _mesh(2048))
    plan = memory_plan(cfg, levers=False)
    assert [(r.rank, r.through) for r in plan.ranks] == [(0, 2047), (2048, 4095)]
    monkeypatch.setattr(plan_ranks, "LISTED_RANKS", 4096)  # the module that reads the bound
    every = memory_plan(cfg, levers=False)
    assert len(every.ranks) == 4096
    for r in every.ranks:
        span = plan.for_rank(r.rank)
        assert span is not None and span.peak == r.peak and span.categories() == r.categories()
    assert plan.for_rank(4096) is None and plan.max_peak == every.max_peak
    assert "0-2047" in plan.format() and "2048-4095" in plan.format()
    assert MemoryPlan.from_dict(json.loads(json.dumps(plan.to_dict()))).for_rank(3000).through == 4095
    monkeypatch.undo()
    start = time.perf_counter()
    huge = memory_plan(load_config(None, _mesh(2**20)), device_memory="80GiB")  # levers re-plan too
    assert time.perf_counter() - start < 20 and len(huge.ranks) == 2 < LISTED_RANKS
    assert len(json.dumps(huge.to_dict())) < 100_000


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``ray-titan ARGV`` in this process: (exit status, stdout, stderr)."""
    from ray_titan.cli import main

    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse's own refusals
        rc = e.code if isinstance(e.code, int) else 2
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("family", FAMILIES)
def test_memory_plan_of_a_hugging_face_job_plans_the_checkpoints_family(family, tmp_path, capsys):
    # Before: the command left model.name = "llama": AttributeError (rc 1) for the MoE families.
    from tests.support.hf_models import hf_config

    hf_config(family).save_pretrained(tmp_path)  # config.json is all the plan reads
    capsys.readouterr()  # transformers' own warnings
    rc, out, err = _cli(capsys, "memory", "plan", f"--checkpoint.initial_load_hf={tmp_path}")
    assert (rc, err) == (0, "") and out.startswith(f"memory plan: {family}/hf,")
    from ray_titan.checkpoint import resolve_hf_job

    cfg = resolve_hf_job(load_config(None, [f"--checkpoint.initial_load_hf={tmp_path}"]))
    assert resolve_hf_job(cfg) == cfg  # the plan resolves again what the driver resolved


def _refused(capsys, *argv: str) -> str:
    """Run ``ray-titan ARGV``; assert exit status 2 and one line on stderr; return it."""
    rc, _, err = _cli(capsys, *argv)
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, (rc, err)
    return err


@pytest.mark.parametrize(("flag", "message"), [
    ("--device-memory=1e400GB", "'1e400GB' is not a size of memory"),  # before: OverflowError traceback
    ("--device-memory=0", "'0' is not a size of memory"),  # before: accepted
    ("--routing-imbalance=inf", "routing imbalance = inf: a finite number >= 1"),
    ("--routing-imbalance=nan", "routing imbalance = nan"),  # before: NaN passed the < 1 check
    ("--vocab-size=-5", "vocab size = -5: a positive number"),
    ("--vocab-size=0", "vocab size = 0"),  # before: ignored
    ("--margin=nan", "margin = nan"),
    ("--vocab-size=abc", "argument --vocab-size: invalid int value"),  # argparse's, on one line
    ("--json=/nonexistent/plan.json", "--json /nonexistent/plan.json: cannot write it"),
])
def test_memory_plan_refuses_bad_flags_on_one_line(flag, message, capsys):
    err = _refused(capsys, "memory", "plan", flag)
    assert err.startswith("ray-titan memory plan: ") and message in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--steps=0"], "steps = 0: simulate at least 1"),  # before: exit 0, nothing simulated
    (["--steps=-3"], "steps = -3"),
    (["--rank=99"], "rank 99 is not on the mesh of 4 ranks; valid: 0 to 3"),  # before: exit 1
    (["--ranks=all", "--rank=1"], "--ranks all simulates one rank per role; it takes no --rank"),  # before: ignored
])
def test_dry_run_refuses_bad_input_before_anything_runs(argv, message, capsys):
    # No simulation starts: a unit test may start no process (tests/unit/conftest.py).
    err = _refused(capsys, "dry-run", *argv)
    assert err.startswith("ray-titan dry-run: ") and message in err


def test_a_dry_run_rank_past_its_time_limit_is_a_dry_run_error(monkeypatch):
    import subprocess

    from ray_titan import dry_run as dr
    from ray_titan.dry_run import shim

    def slow(cmd, **kw):
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])

    monkeypatch.setattr(shim, "build_shim", lambda: None)
    monkeypatch.setattr(dr.subprocess, "run", slow)
    with pytest.raises(dr.DryRunError, match=r"rank 1: the simulation ran past its time limit of 600 s"):
        dr.dry_run(None, [], [1])  # before: subprocess.TimeoutExpired through the API


@pytest.mark.parametrize(("argv", "message"), [
    (["export", "x", "--to", "hf", "y", "--max-shard-size=nan"], "ray-titan export: --max-shard-size nan: give a"),
    (["export", "x", "--to", "hf", "y", "--storage-timeout=inf"], "ray-titan export: --storage-timeout inf"),
    (["config", "docs", "--output=/nonexistent/c.md"], "ray-titan config docs: --output /nonexistent/c.md: cannot"),
    (["config", "show", "--training.steps=-1"], "ray-titan config show: config error: "),
    (["report", "r", "--bogus=1"], "ray-titan report: unexpected arguments ['--bogus=1']"),
])
def test_every_command_refuses_bad_input_on_one_line(argv, message, capsys):
    assert message in _refused(capsys, *argv)


def test_an_override_with_a_space_in_its_value_is_an_override(capsys):
    # Before: argparse took "--job.name=a b" for config show's X.toml ("config file not found").
    rc, out, err = _cli(capsys, "config", "show", "--job.name=a b")
    assert (rc, err) == (0, "") and 'name = "a b"' in out


def _steps_table(n: int):
    import pyarrow as pa

    from ray_titan.metrics.schema import STEP_SCHEMA

    cols = {f.name: pa.array([i % 3 for i in range(n)], f.type) if pa.types.is_integer(f.type) else
            pa.array([1.0] * n, f.type) if pa.types.is_floating(f.type) else pa.nulls(n, f.type)
            for f in STEP_SCHEMA}
    return pa.table(cols, schema=STEP_SCHEMA)


def _bad_run(tmp_path, case: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    metrics = tmp_path / "metrics"
    metrics.mkdir()
    steps = metrics / "steps.parquet"
    if case == "empty":
        steps.write_bytes(b"")
    elif case == "not parquet":
        steps.write_text("step,rank\n1,0\n")
    elif case == "truncated":
        pq.write_table(_steps_table(50), steps)
        steps.write_bytes(steps.read_bytes()[:-100])
    elif case == "wrong schema":
        pq.write_table(pa.table({"a": [1, 2]}), steps)
    elif case == "wrong type":
        pq.write_table(_steps_table(4).set_column(0, "step", pa.array(["x"] * 4)), steps)
    elif case == "steps.parquet loop":
        steps.symlink_to(steps)
    elif case == "parts loop":  # no steps.parquet: an unfinished run's parts are read
        (metrics / "parts").symlink_to(metrics / "parts")
    else:  # a good table beside a damaged file
        pq.write_table(_steps_table(4), steps)
    if case == "memory_plan.json":
        (tmp_path / "memory_plan.json").write_text('{"ranks": [')
    elif case == "memory_plan.json schema":
        (tmp_path / "memory_plan.json").write_text('{"ranks": [{"rank": 0, "peak": "big"}]}')
    elif case == "breakdowns":
        (metrics / "memory_breakdown.jsonl").write_text('{"rank": 0, "peak_bytes"\n')


@pytest.mark.parametrize(("case", "message"), [
    ("empty", "Parquet file size is 0 bytes"), ("not parquet", "not a table this ray_titan wrote"),
    ("truncated", "magic bytes not found"), ("wrong schema", "have no 'step' column"),
    ("wrong type", "column 'step' is string, not int64"),
    ("steps.parquet loop", "is a symbolic link that leads nowhere"),
    ("parts loop", "cannot read the metrics in"), ("memory_plan.json", "memory_plan.json or"),
    ("memory_plan.json schema", "ValueError: invalid literal for int"), ("breakdowns", "JSONDecodeError"),
])
def test_report_of_a_damaged_run_names_the_file(case, message, tmp_path, capsys):
    # Before: a traceback, or (loops) "no metrics" and "cannot write …/report" for a file it could not read.
    _bad_run(tmp_path, case)
    err = _refused(capsys, "report", str(tmp_path))
    assert err.startswith("ray-titan report: ") and str(tmp_path) in err and message in err, err
    assert not (tmp_path / "report").exists()  # refused before writing


def test_report_reads_a_file_of_one_row_per_row_group_a_batch_at_a_time(tmp_path):
    # Before: read whole, one chunk per row group per column: 40,000 groups of a 455 MB file took
    # 5.4 GB and 103 s; now 2.3 GB (pyarrow's own footer) and 25 s.
    import pyarrow.parquet as pq

    from ray_titan.metrics.reading.steps import read_steps

    (tmp_path / "metrics").mkdir()
    pq.write_table(_steps_table(300), tmp_path / "metrics" / "steps.parquet", row_group_size=1)
    t = read_steps(tmp_path, columns=["step", "rank", "no_such_column"])
    assert t.num_rows == 300 and t.column_names == ["step", "rank"] and t["step"].num_chunks == 1


def test_concurrent_storage_probes_leave_no_directory(tmp_path):
    # Before: a probe that created a directory another probe was using could not remove it (22
    # of 30 trials of 6 threads left one).
    import threading

    from ray_titan.storage import check_writable

    for trial in range(10):
        root = tmp_path / str(trial)
        root.mkdir()
        threads = [threading.Thread(target=check_writable, args=(root / "a" / "b" / "c", 5)) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert list(root.iterdir()) == []


def test_a_memory_plan_that_fails_is_not_told_as_does_not_fit(monkeypatch, capsys):
    """``memory plan``'s exit status 1 means "does not fit": a plan that fails (issue 44, finding 5's
    AttributeError was read as that) exits 3, one line naming the error."""
    from ray_titan.preflight import memory_plan as memory_planner

    def broken(*args, **kwargs):
        raise AttributeError("'Llama' object has no attribute 'moe'")

    monkeypatch.setattr(memory_planner, "memory_plan", broken)
    rc, _, err = _cli(capsys, "memory", "plan")
    assert rc == 3 and err.startswith("ray-titan memory plan: failed: AttributeError") and len(err.splitlines()) == 1
