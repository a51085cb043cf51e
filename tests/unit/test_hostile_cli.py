"""Hostile input to the commands (issue 44: findings 3, 5, 8, 10): mesh-sized work is bounded,
every command's bad input is one line and exit 2, malformed run files are named, not traced."""

from __future__ import annotations

import json
import time

import pytest

from ray_titan import memory_planner
from ray_titan.config import load_config
from ray_titan.memory_planner import LISTED_RANKS, MemoryPlan, memory_plan

_BIG = ["--parallelism.pp=2", "--training.global_batch_size={gbs}", "--parallelism.microbatches=2"]


def _mesh(dp_shard: int) -> list[str]:
    return [o.format(gbs=2 * dp_shard) for o in _BIG] + [f"--parallelism.dp_shard={dp_shard}"]


def test_a_plan_over_the_listed_ranks_is_one_record_per_pipeline_rank_with_the_same_figures(monkeypatch):
    # 4,096 ranks: before, 4,096 records; 2^20 ranks took 6 GB and ~50 s before any output.
    cfg = load_config(None, _mesh(2048))
    plan = memory_plan(cfg, levers=False)
    assert [(r.rank, r.through) for r in plan.ranks] == [(0, 2047), (2048, 4095)]
    monkeypatch.setattr(memory_planner, "LISTED_RANKS", 4096)
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


@pytest.mark.parametrize("family", ["llama", "qwen3", "deepseek_v2", "deepseek_v3", "qwen3_moe", "gpt_oss"])
def test_memory_plan_of_a_hugging_face_job_plans_the_checkpoints_family(family, tmp_path, capsys):
    # Before: the command left model.name = "llama": AttributeError (rc 1) for the MoE families.
    from tests.support.hf_models import hf_config

    hf_config(family).save_pretrained(tmp_path)  # config.json is all the plan reads
    capsys.readouterr()  # transformers' own warnings
    rc, out, err = _cli(capsys, "memory", "plan", f"--checkpoint.initial_load_hf={tmp_path}")
    assert (rc, err) == (0, "") and out.startswith(f"memory plan: {family}/hf,")
    from ray_titan.checkpoint.huggingface import resolve_hf_job

    cfg = resolve_hf_job(load_config(None, [f"--checkpoint.initial_load_hf={tmp_path}"]))
    assert resolve_hf_job(cfg) == cfg  # the plan resolves again what the driver resolved
