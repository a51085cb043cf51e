"""``ray-titan report RUN_DIR``: PNG plots and the per-rank summary table (no Ray)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute
import pytest

from ray_titan.cli import main
from ray_titan.metrics.collector.collector import MetricsCollector
from ray_titan.parallel.dims import ParallelDims
from tests.unit.test_leak import MiB, _rep


def _run_dir(tmp_path, steps=80):
    dims = ParallelDims(pp=2, dp_shard=2)
    c = MetricsCollector(str(tmp_path), 4, dims.last_stage_ranks(), steps, enable_tensorboard=False)
    for step in range(1, steps + 1):
        reps = [_rep(step, r, dims, 500 * MiB + (2 * step * MiB if r == 1 else 0)) for r in range(4)]
        for r, rep in enumerate(reps):  # rank r's metrics path: (r + 1) % of its 0.1 s steps
            rep["metrics_time_s"] = None if step == 1 else 0.001 * (r + 1)
        c.report(reps)
    c.finish()
    return tmp_path


def test_report_writes_plots_and_prints_each_ranks_verdict(tmp_path, capsys):
    run_dir = _run_dir(tmp_path)
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    for name in ("loss.png", "memory.png"):
        png = run_dir / "report" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
        assert f"wrote {png}" in out
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["rank", "coords", "verdict"]
    by_rank = {line.split()[0]: line for line in lines[1:5]}
    assert "pp=0, dp_shard=1  growing  +2.000" in by_rank["1"]
    assert all("stable" in by_rank[r] for r in ("0", "2", "3"))
    assert by_rank["0"].split()[-3:-1] == ["16", "0.000"]  # GC every 5 of 80 steps, 0 s in these reports
    assert [by_rank[r].split()[-1] for r in "0123"] == ["1.00", "2.00", "3.00", "4.00"]


def test_report_of_a_directory_without_metrics_is_an_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no metrics" in capsys.readouterr().err


def test_report_of_a_read_only_run_directory_says_so_and_writes_with_out(tmp_path, capsys):
    import subprocess

    run_dir = _run_dir(tmp_path / "run", steps=10)
    if subprocess.run(["mount", "--bind", "-o", "ro", str(run_dir), str(run_dir)], capture_output=True).returncode:
        pytest.skip("a read-only bind mount needs root")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(run_dir)], check=True)
        assert main(["report", str(run_dir)]) == 2
        assert f"ray-titan report: cannot write {run_dir / 'report'}: Read-only file system; write the plots " \
               "elsewhere with --out DIR" in capsys.readouterr().err
        assert main(["report", str(run_dir), "--out", str(tmp_path / "plots")]) == 0
        assert (tmp_path / "plots" / "loss.png").is_file()
    finally:
        subprocess.run(["umount", str(run_dir)], check=True)


def test_report_of_16k_ranks_draws_heatmaps_and_names_the_planted_outliers(tmp_path, capsys):
    """The benchmark's synthetic table (real schema, 16 stages × 128 × 8 ranks, earlier stages
    holding more memory): only the planted ranks are named, in the table and beside the heatmaps."""
    from benchmarks.metrics_scale import write_synthetic_run
    from ray_titan.metrics.reading.run_summary import PER_RANK_LIMIT, outlier_ranks
    from ray_titan.metrics.reading.steps import read_steps

    memory, slow = (3, 9000, 16383), (4242,)
    write_synthetic_run(tmp_path, 16384, 12, steps_per_part=6, memory_outliers=memory, time_outliers=slow)
    named = {(o["rank"], o["what"]) for o in outlier_ranks(read_steps(tmp_path))}
    assert named == {(r, "memory") for r in memory} | {(r, "step time") for r in slow}
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in ("loss.png", "memory.png", "step_time.png"):
        png = tmp_path / "report" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in out
    lines = out.splitlines()
    assert lines[0].split()[-1] == "outlier" and len(lines) < PER_RANK_LIMIT + 10  # not one line per rank
    shown = {int(line.split()[0]) for line in lines[1:] if line.split()[0].isdigit()}
    assert shown == {*memory, *slow}
    assert "(16380 of 16384 ranks not shown" in out
    assert (tmp_path / "report" / "ranks.csv").read_text().count("\n") == 16385  # a header and every rank


def test_a_run_result_reads_its_steps_only_when_asked_and_its_losses_from_rank_0s_rows(tmp_path):
    """The driver's RunResult of a large run holds no table: ``losses()`` reads rank 0's row group
    (the same losses as the whole table's), ``steps`` the whole table on first access."""
    from benchmarks.metrics_scale import write_synthetic_run
    from ray_titan.driver.result import RunResult
    from ray_titan.metrics.reading.steps import read_steps

    write_synthetic_run(tmp_path, 1024, 6, steps_per_part=3)
    whole = read_steps(tmp_path)
    r = RunResult(run_dir=tmp_path, steps=None, final_loss=None)
    expected = whole.filter(pa.compute.equal(whole["rank"], 0)).sort_by("step")["step_loss"].to_pylist()
    assert r.losses() == expected and len(expected) == 6 and "_steps" in r.__dict__ and r.__dict__["_steps"] is None
    assert "1024" not in repr(r) and r.steps.num_rows == 1024 * 6 and r.__dict__["_steps"] is not None
