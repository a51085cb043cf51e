"""The memory plan of the 2026 MoE families' large flavors on realistic meshes: every rank is
planned, and the ranks' parameter shards add up to the flavor's parameters (experts split over
ep × dp_shard / ep, the rest over dp_shard), each with AdamW's two moments."""

from __future__ import annotations

import pytest
import torch

from ray_titan.config import load_config
from ray_titan.models.decoder import count_parameters
from ray_titan.models.registry import build_model
from ray_titan.preflight.memory_plan import memory_plan


@pytest.mark.parametrize("name, flavor, vocab, pp, dp_shard, ep", [
    ("qwen3_moe", "235B-A22B", 151_936, 4, 16, 16),
    ("gpt_oss", "120B", 201_088, 2, 8, 8),
    ("deepseek_v3", "671B", 129_280, 16, 32, 32),
])
def test_large_moe_flavor_is_planned_on_every_rank(name, flavor, vocab, pp, dp_shard, ep):
    cfg = load_config(None, [
        f"--model.name={name}", f"--model.flavor={flavor}", f"--parallelism.pp={pp}",
        f"--parallelism.dp_shard={dp_shard}", f"--parallelism.ep={ep}", "--training.seq_len=4096",
        f"--training.global_batch_size={2 * pp * dp_shard}", f"--parallelism.microbatches={2 * pp}",
        "--training.mixed_precision=bf16", "--activation_checkpoint.mode=full"])
    plan = memory_plan(cfg, "80GiB", vocab_size=vocab, levers=False)
    with torch.device("meta"):
        total = count_parameters(build_model(name, flavor))
    assert sorted(r.rank for r in plan.ranks) == list(range(pp * dp_shard))
    assert sum(r.parameters for r in plan.ranks) == pytest.approx(4 * total, rel=1e-4)  # fp32 master weights
    for r in plan.ranks:
        assert r.optimizer_state == {"AdamW": 2 * r.parameters}
        assert r.peak > r.parameters + r.optimizer_state["AdamW"] + r.activations
        by_mode = r.activations_by_ac_mode  # one microbatch: full checkpointing keeps the least
        assert by_mode["none"] > by_mode["selective_op"] > by_mode["full"] > 0
