"""The collector as a process of its own: its CPU priority, and a full disk under a real filesystem."""

from __future__ import annotations

import pytest

from ray_titan.metrics.collector.breakdowns import read_breakdowns
from ray_titan.metrics.reading.steps import read_steps
from ray_titan.parallel.dims import ParallelDims
from tests.unit.test_collector import _collector, _report


@pytest.fixture
def small_disk(tmp_path):
    """A 512 KiB tmpfs, to fill up (root only)."""
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_the_collector_lowers_its_own_cpu_priority_by_nice(tmp_path):
    """``metrics.collector_nice``: the actor's process is reniced (checked in a child process so
    the test process keeps its priority); a collector built without it leaves it alone."""
    import os
    import subprocess
    import sys

    if os.nice(0) > 12:
        pytest.skip("this process already runs at nice > 12")
    code = ("import os, sys; from ray_titan.metrics.collector.collector import MetricsCollector; "
            "base = os.nice(0); MetricsCollector(sys.argv[1], 1, [0], 10, nice=int(sys.argv[2])); "
            "print(os.nice(0) - base)")
    for nice in (0, 7):
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / str(nice)), str(nice)],
                             check=True, capture_output=True, text=True).stdout
        assert int(out.split()[-1]) == nice


def test_a_full_disk_loses_no_metric_that_fits_later(small_disk):
    """The disk fills up between flushes: each failed write is reported once with the file and the
    cause, nothing blocks, the rows wait in memory, and once space is back every row is on disk."""
    dims = ParallelDims(pp=1, dp_shard=1)
    c = _collector(small_disk, dims, steps=30, flush_every_steps=5, enable_tensorboard=True)
    for step in range(1, 6):
        c.report([_report(step, 0, dims, loss=2.0)])
    assert read_steps(small_disk)["step"].to_pylist() == [1, 2, 3, 4, 5]
    filler = small_disk / "filler"
    with open(filler, "wb") as f:  # what a checkpoint that does not fit does to the disk
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    for step in range(6, 16):
        rep = _report(step, 0, dims, loss=2.0)
        if step == 7:  # memory.breakdown_step's side file fails too: the step keeps its row
            rep["memory_breakdown"] = {"rank": 0, "step": 7, "parameters_bytes": 1024}
        c.report([rep])
    failures = [e for e in c.errors.messages if "No space left on device" in e]
    assert any(f"cannot write {small_disk / 'metrics' / 'parts'}" in e for e in failures)
    assert any(f"memory breakdown {small_disk / 'metrics'}" in e for e in failures)
    assert len([e for e in failures if "part-" in e]) == 1  # once, not at every flush
    assert read_steps(small_disk)["step"].to_pylist() == [1, 2, 3, 4, 5]  # what was flushed stays readable
    filler.unlink()
    for step in range(16, 31):
        c.report([_report(step, 0, dims, loss=2.0)])
    summary = c.finish()
    assert read_steps(small_disk)["step"].to_pylist() == list(range(1, 31))
    assert summary["final_loss"] == 2.0
    assert read_breakdowns(small_disk)[0]["step"] == 7
