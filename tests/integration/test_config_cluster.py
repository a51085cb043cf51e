"""Settings checked against a running cluster and in the workers' processes."""

from __future__ import annotations

import pytest

import ray_titan.driver as driver
from ray_titan.config import ConfigError
from tests.unit.test_config import _cfg


def test_cpu_request_larger_than_the_cluster_is_refused_before_workers(ray_cluster, tmp_path):
    with pytest.raises(ConfigError, match=r"ray.cpus_per_worker = 1 × 4 workers = 4 CPUs, but the cluster has 2"):
        driver.train(_cfg("--ray.cpus_per_worker=1.0", f"--job.dump_folder={tmp_path}"))
    assert list(tmp_path.iterdir()) == []  # not even a run directory


def test_worker_niceness_applies_to_every_thread(tmp_path):
    # In a child process: niceness, once raised, cannot be lowered back without CAP_SYS_NICE.
    code = """
import os, threading, time
from ray_titan.trainer.ray_worker import set_process_niceness
stop = threading.Event()
t = threading.Thread(target=stop.wait); t.start()
before = os.getpriority(os.PRIO_PROCESS, t.native_id)
assert set_process_niceness(before + 3)
print(before, os.getpriority(os.PRIO_PROCESS, 0), os.getpriority(os.PRIO_PROCESS, t.native_id))
stop.set(); t.join()
"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    before, main, thread = map(int, out.stdout.split())
    assert main == thread == min(before + 3, 19)
