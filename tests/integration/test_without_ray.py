"""ray_titan where Ray is not installed, as on a GPU node as it ships (issue 39): every shipped config
trains through the launcher, and the commands such a node needs (``config show --validate``,
``memory plan``, ``dry-run``, ``export``, ``report``) run, in processes where ``import ray`` fails and
every attempt at it is logged (``tests/support/no_ray.py``); ``ray-titan train`` names the launcher.

One process runs every config on one rank, then the commands (one interpreter start for all);
one torchrun launch runs an MoE config on the main job's mesh (pp=2 × dp_shard=2, ep=2)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pyarrow.compute as pc
import pytest

from ray_titan.metrics.reading.steps import read_steps
from tests.conftest import REPO
from tests.support.hf_models import SEQ, corpus_lines
from tests.support.no_ray import no_ray_env, ray_imports, split_runs

pytestmark = pytest.mark.compat  # CI's compatibility job reruns it where Ray is truly absent

CONFIGS = sorted(REPO.glob("configs/*.toml"))
STEPS = 2
COMMON = [f"--training.steps={STEPS}", "--metrics.log_freq=1", "--memory.breakdown_step=0"]
ONE_RANK = ["--parallelism.pp=1", "--parallelism.dp_shard=1", "--parallelism.ep=1", "--training.global_batch_size=4"]
MOE = str(REPO / "configs" / "debug_deepseek.toml")  # memory.allocator = "auto": Ray's jemalloc where Ray is


def _launch_argv(config, tmp, corpus_cache, hf_models) -> list[str]:
    extra = []
    if config.stem == "finetune_hf":  # a tiny Hugging Face Llama and text of the tests' own (nothing downloaded)
        data = tmp / "text.jsonl"
        data.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus_lines()))
        extra = [f"--checkpoint.initial_load_hf={hf_models[0] / 'llama'}", f"--data.path={data}",
                 f"--training.seq_len={SEQ}"]
    return ["--config", str(config), *ONE_RANK, *COMMON, f"--job.dump_folder={tmp / 'dump' / config.stem}",
            f"--data.cache_dir={corpus_cache}", *extra]


@pytest.fixture(scope="module")
def no_ray(tmp_path_factory, corpus_cache, hf_models):
    """Every shipped config through the launcher on one rank, then the commands, in one process
    without Ray: ``(env, tmp, {name: (exit code, stdout, stderr)})``."""
    tmp = tmp_path_factory.mktemp("no_ray")
    env = no_ray_env(tmp)
    moe_run = f"glob:{tmp / 'dump' / 'debug_deepseek' / 'debug_deepseek-*'}"
    spec = {c.stem: ["launch", _launch_argv(c, tmp, corpus_cache, hf_models)] for c in CONFIGS} | {
        "train": ["cli", ["train", "--config", MOE, "--training.steps=7"]],
        "validate": ["cli", ["config", "show", MOE, "--validate"]],
        "memory plan": ["cli", ["memory", "plan", "--config", MOE]],
        "dry-run": ["cli", ["dry-run", "--config", MOE, "--steps", "1"]],
        "export": ["cli", ["export", moe_run, "--to", "hf", str(tmp / "exported")]],
        "report": ["cli", ["report", moe_run, "--out", str(tmp / "report")]],
    }
    (tmp / "spec.json").write_text(json.dumps(list(spec.values())))
    out = subprocess.run([sys.executable, "-m", "tests.support.no_ray", str(tmp / "spec.json")], capture_output=True,
                         text=True, env=env, cwd=REPO, timeout=900)
    runs = [(code, o, e) for (code, o), (_, e) in zip(split_runs(out.stdout), split_runs(out.stderr), strict=True)]
    assert out.returncode == 0 and len(runs) == len(spec), out.stdout[-2000:] + out.stderr[-3000:]
    return env, tmp, dict(zip(spec, runs, strict=True))


@pytest.mark.parametrize("config", [c.stem for c in CONFIGS])
def test_every_shipped_config_trains_through_the_launcher_without_ray(no_ray, config):
    _, tmp, runs = no_ray
    code, stdout, stderr = runs[config]
    assert code == 0, stdout[-2000:] + stderr[-3000:]
    assert f"step {STEPS}/{STEPS} | loss" in stdout  # the console's step lines
    (run_dir,) = (tmp / "dump" / config).glob("*-*")
    steps = read_steps(run_dir)
    assert sorted(steps["step"].to_pylist()) == list(range(1, STEPS + 1))
    assert all(math.isfinite(x) for x in pc.drop_null(steps["step_loss"]).to_pylist())
    if config == "finetune_hf":  # checkpoint.last_save_hf: the model back in Hugging Face's format
        assert (run_dir / "hf" / "config.json").is_file()


def test_the_commands_a_gpu_node_needs_run_without_ray(no_ray):
    _, tmp, runs = no_ray
    for name in ("validate", "memory plan", "dry-run", "export", "report"):
        code, stdout, stderr = runs[name]
        assert code == 0, (name, stdout[-2000:] + stderr[-3000:])
    assert "[memory]" in runs["validate"][1] and "largest peak" in runs["memory plan"][1]
    assert (tmp / "exported" / "config.json").is_file() and (tmp / "report" / "loss.png").is_file()


def test_train_without_ray_exits_2_naming_the_launcher(no_ray):
    code, _, stderr = no_ray[2]["train"]
    assert code == 2
    assert stderr.strip().splitlines() == [
        "ray-titan train: Ray is not installed; run this job without Ray with the launcher: torchrun "
        f"--nproc-per-node=4 -m ray_titan.launch --config {MOE} --training.steps=7"]


def test_no_ray_import_is_even_attempted_on_these_paths(no_ray):
    # The launcher imported Ray where it is installed (the collector asked whether it was a
    # restarted actor), and pre-flight did for memory.allocator = "auto".
    assert ray_imports(no_ray[0]) == ""


def test_torchrun_trains_the_moe_job_on_the_main_mesh_without_ray(tmp_path, corpus_cache):
    env = no_ray_env(tmp_path)
    dump = tmp_path / "dump"
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", "-m",
                          "ray_titan.launch", "--config", MOE, *COMMON, "--training.global_batch_size=8",
                          f"--job.dump_folder={dump}", f"--data.cache_dir={corpus_cache}"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    (run_dir,) = dump.glob("debug_deepseek-*")
    steps = read_steps(run_dir)
    assert steps.num_rows == 4 * STEPS and sorted(set(steps["rank"].to_pylist())) == [0, 1, 2, 3]
    assert ray_imports(env) == ""
    # The assembled lines come at the end; rank 2 (the last stage's first) printed its own as it went.
    own, assembled = out.stdout.find("[rank 2] step 1/2 | own loss "), out.stdout.find("\nstep 1/2 | loss ")
    assert -1 < own < assembled and f"[rank 2] step {STEPS}/{STEPS} | own loss " in out.stdout, out.stdout
    assert "[rank 3]" not in out.stdout and "ray_titan: rank 2 prints its own loss" in out.stdout
