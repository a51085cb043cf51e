"""The three entry points run the same driver; a bad config fails before Ray starts (no Ray)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

ENTRY_POINTS = {
    "ray-titan": [shutil.which("ray-titan") or "ray-titan", "train"],
    "python -m ray_titan": [sys.executable, "-m", "ray_titan", "train"],
    "jobs/train.py": [sys.executable, str(REPO / "jobs" / "train.py")],
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_config_error_exits_2_with_the_message_before_ray(entry, tmp_path):
    out = subprocess.run(
        [*ENTRY_POINTS[entry], "--config", str(REPO / "configs" / "debug_llama.toml"),
         "--training.global_batch_size=10"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert ("ray-titan: config error: training.global_batch_size = 10 is not divisible by "
            "parallelism.microbatches × parallelism.dp_shard = 4 × 2 = 8") in out.stderr
    assert "Started a local Ray instance" not in out.stdout + out.stderr
    assert not (tmp_path / "outputs").exists()  # no run directory either


def test_help_lists_train(tmp_path):
    out = subprocess.run([*ENTRY_POINTS["ray-titan"][:1], "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "train" in out.stdout
