"""The memory plan of a bf16 run without FSDP2 (one rank under ``torch.autocast``): autocast's
bf16 copies of the weights, which its region (the forward) caches and each block's backward frees
with the tensors it saved. On an H200 the 1B shape's full-AC peak, at the end of backward, held
one block's copies, not all of them (benchmarks/results/2026-11-28-gpu-levers-h200.md)."""

from __future__ import annotations

import pytest

from ray_titan.config import load_config, merge_overrides
from ray_titan.models.registry import build_model
from ray_titan.preflight.memory_plan import memory_plan
from tests.conftest import REPO


def _plan(*overrides: str):
    cfg = load_config(REPO / "configs" / "debug_llama.toml", merge_overrides([
        "--parallelism.pp=1", "--parallelism.dp_shard=1", "--model.flavor=3.2-1B", "--training.global_batch_size=4",
        "--training.seq_len=2048", "--training.mixed_precision=bf16", "--activation_checkpoint.mode=full"],
        list(overrides)))
    return memory_plan(cfg, device="cuda", levers=False).ranks[0]


@pytest.fixture(scope="module")
def elements():
    """Parameters of the 1B shape's first block and of the whole model (byte vocabulary)."""
    import torch

    with torch.device("meta"):
        model = build_model("llama", "3.2-1B", vocab_size=258)
    return (sum(p.numel() for p in model.layers["0"].parameters()), sum(p.numel() for p in model.parameters()))


def test_a_lone_microbatchs_backward_ends_with_one_blocks_bf16_weights(elements):
    block, whole = elements
    one = _plan("--parallelism.microbatches=1")
    assert one.peak_grads == one.gradients > 0  # the peak is the backward's end, every gradient made
    assert one.fsdp_unsharded_params == 2 * block
    # With two microbatches the peak is the second one's backward start: its forward just cached
    # every weight's copy.
    two = _plan("--parallelism.microbatches=2")
    assert two.fsdp_unsharded_params == 2 * whole
    # The 1B shape's measured peak on an H200 (16,039 MiB under full AC) within the plan's 10 %
    # (the plan said 17,780 MiB before, 1.11 ×).
    assert abs(one.peak / 2**20 / 16_039 - 1) < 0.10
