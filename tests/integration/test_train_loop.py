"""The train loop without Ray: one process, and torchrun ranks (parity with one process). The
entry points run as a user runs them (``python -m ray_titan.launch``, ``torchrun``); the other
meshes fork torchrun's ranks from the session's forkserver (``tests/support/ranks.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from ray_titan.metrics.reading.steps import read_steps
from ray_titan.metrics.worker.report import read_rank_reports
from tests.conftest import REPO
from tests.support.ranks import launch

STEPS = 6


def _launch(tmp_path, corpus_cache, nproc: int, *overrides: str, entry_point: bool = True):
    dump = tmp_path / f"n{nproc}-{abs(hash(overrides))}"
    launcher = ([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"] if nproc > 1
                else [sys.executable])
    argv = ["--config", str(REPO / "configs" / "debug_llama.toml"), f"--training.steps={STEPS}",
            f"--job.dump_folder={dump}", f"--data.cache_dir={corpus_cache}", "--metrics.log_freq=1",
            "--memory.breakdown_step=0", *overrides]
    if entry_point:
        out = subprocess.run([*launcher, "-m", "ray_titan.launch", *argv], capture_output=True, text=True,
                             timeout=300, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    else:
        out = launch(argv, nproc, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    (run_dir,) = dump.glob("debug_llama-*")
    steps = read_steps(run_dir)
    rank0 = steps.filter(pa.compute.equal(steps["rank"], 0)).sort_by("step")
    return out.stdout, np.array(rank0["step_loss"].to_pylist()), steps


@pytest.fixture(scope="module")
def single(tmp_path_factory, corpus_cache):
    return _launch(tmp_path_factory.mktemp("single"), corpus_cache, 1, "--parallelism.pp=1", "--parallelism.dp_shard=1")


def test_single_process_prints_and_records_every_step(single):
    stdout, losses, steps = single
    assert steps.num_rows == STEPS and len(losses) == STEPS
    assert f"step {STEPS}/{STEPS} | loss" in stdout
    assert losses[0] == pytest.approx(np.log(258), abs=0.1)
    # Each step carries the previous step's own metrics cost; the first has none to carry.
    cost = steps.sort_by("step")["metrics_time_s"].to_pylist()
    assert cost[0] is None and all(0 < c < 0.5 for c in cost[1:])


@pytest.mark.parametrize(
    ("nproc", "overrides"),
    [
        (2, ("--parallelism.pp=1", "--parallelism.dp_shard=2")),  # FSDP2 + gradient accumulation
        (2, ("--parallelism.pp=2", "--parallelism.dp_shard=1", "--parallelism.pipeline_schedule=GPipe")),
        # FSDP2 CPUOffloadPolicy: shards, gradients and the optimizer step on the host.
        (2, ("--parallelism.pp=1", "--parallelism.dp_shard=2", "--memory.cpu_offload=true")),
        # The main job's own mesh (the config's pp=2 × dp_shard=2, 1F1B) through torchrun: CI's
        # compatibility job runs it on the lowest and newest torch.
        pytest.param(4, (), marks=pytest.mark.compat),
    ],
    ids=["dp_shard2", "pp2_gpipe", "dp_shard2_cpu_offload", "main_job_mesh"],
)
def test_torchrun_ranks_match_one_process(tmp_path, corpus_cache, single, nproc, overrides):
    # torchrun itself for the first mesh and the main job's; the other meshes' ranks forked
    # (tests/support/ranks.py)
    torchrun = overrides in (("--parallelism.pp=1", "--parallelism.dp_shard=2"), ())
    _, losses, steps = _launch(tmp_path, corpus_cache, nproc, *overrides, entry_point=torchrun)
    np.testing.assert_allclose(losses, single[1], rtol=1e-4)
    assert steps.num_rows == nproc * STEPS


def test_an_oom_inside_a_pipeline_stage_forward_reaches_the_oom_path(tmp_path, corpus_cache):
    """pp=2 × dp_shard=2 under the launcher (4 forked ranks): a MemoryError raised inside a block's
    forward on rank 2 (pp=1) at step 3 arrives wrapped in the pipeline schedule's RuntimeError,
    and must still become RankOutOfMemoryError naming the rank, its stage and the step, with a
    snapshot, after the rank's reports of steps 1 and 2."""
    config = tmp_path / "oom.toml"
    config.write_text((REPO / "configs" / "debug_llama.toml").read_text() + (
        '\n[[callbacks]]\ntarget = "ray_titan.callbacks:InjectOOM"\n'
        'kwargs = { rank = 2, step = 3, where = "forward", host = true }\n'))
    dump = tmp_path / "dump"
    out = launch(["--config", str(config), "--parallelism.pp=2", "--parallelism.dp_shard=2", "--training.steps=4",
                  f"--job.dump_folder={dump}", f"--data.cache_dir={corpus_cache}", "--memory.breakdown_step=0"],
                 4, cwd=tmp_path, timeout=240)
    assert out.returncodes[2] == 1, out.stderr[-3000:]
    (run_dir,) = dump.glob("debug_llama-*") or [None]
    assert run_dir is not None, (out.returncodes, out.stderr[-3000:])
    snapshot = run_dir / "memory" / "rank2-oom-step3.json"
    assert ("RankOutOfMemoryError: rank 2 (pp=1, dp_shard=0) ran out of memory at step 3 in the forward of "
            "pipeline stage 1: peak host RSS ") in out.stderr, out.stderr[-3000:]
    assert f"memory snapshot: {snapshot}" in out.stderr
    assert json.loads(snapshot.read_text())["error"].startswith("simulated allocation failure")
    assert [r["step"] for r in read_rank_reports(run_dir, 2)] == [1, 2]
