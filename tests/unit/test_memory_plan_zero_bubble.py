"""The memory plan of the zero-bubble schedules (ray_titan.preflight.plan_ranks._zero_bubble_peak):
what an input-gradient step keeps until its weight-gradient step, counted from torch's own
action order, and what a weight-gradient step of a checkpointed block holds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ray_titan.config import load_config
from ray_titan.models.llama.args import FLAVORS
from ray_titan.models.llama.costs import llama_block_activations
from ray_titan.parallel.schedules import local_stages, rank_actions
from ray_titan.preflight.memory_plan import memory_plan
from ray_titan.preflight.plan_activations import _StageActivations
from ray_titan.preflight.plan_ranks import _zero_bubble_peak
from ray_titan.preflight.plan_states import _StageParams


def test_held_input_gradients_follow_torchs_order_of_the_zbv_cooldown():
    # ZBV, pp = 4, 8 microbatches, last pp rank (stages 3 and 4): torch's order ends
    # 4F7 4I4 4W4 3I4 4I5 3I5 4I6 3I6 4I7 3I7 3W4 ...: at 3W4's start the I steps of
    # microbatches 4-7 on stage 3 and 5-7 on stage 4 wait for their W, 7 in all.
    actions = rank_actions("ZBVZeroBubble", 4, 2, 8, 3)
    tail = actions[actions.index(("I", 4, 4)) - 1:actions.index(("W", 3, 4)) + 1]
    assert [f"{s}{k}{m}" for k, s, m in tail] == ["4F7", "4I4", "4W4", "3I4", "4I5", "3I5", "4I6", "3I6", "4I7",
                                                  "3I7", "3W4"]
    stages = local_stages("v", 4, 2, 3)
    held = 1000.0  # bytes one I step keeps; nothing else has a size
    acts = {s: _StageActivations(kept=0.0, experts=0.0, transient=0.0, pipe=0.0, held=held) for s in stages}
    job = SimpleNamespace(cfg=SimpleNamespace(parallelism=SimpleNamespace(pipeline_schedule="ZBVZeroBubble",
                                                                          microbatches=8)),
                          dims=SimpleNamespace(pp=4, stages_per_rank=2, dp_shard=1, fsdp_shard=1))
    moment = _zero_bubble_peak(job, 3, stages, acts, {s: _StageParams() for s in stages}, 0.0)  # type: ignore[arg-type]
    assert moment.transient == 7 * held


def test_zbv_weight_step_of_a_checkpointed_block_holds_its_recomputations():
    # pp = 2: pp rank 1 holds stages 1 and 2 (layers 1 and 2 of the debug Llama); layer 2 is
    # checkpointed (selective layer, every 2nd). Its W step runs one autograd.grad per parameter
    # group (9 parameter tensors), each recomputing the block: (9 - 3) recomputations kept plus
    # the one in progress. The peak: a W of stage 2 with both stages' 2 microbatches in flight.
    cfg = load_config(None, [
        "--model.name=llama", "--model.flavor=debug", "--parallelism.pp=2", "--parallelism.dp_shard=1",
        "--parallelism.pipeline_schedule=ZBVZeroBubble", "--parallelism.stages_per_rank=2",
        "--parallelism.microbatches=4", "--training.seq_len=256", "--training.global_batch_size=8",
        "--training.mixed_precision=fp32", "--activation_checkpoint.mode=selective",
        "--activation_checkpoint.selective_option=layer", "--activation_checkpoint.layer_freq=2"])
    rank = memory_plan(cfg, device="cuda", levers=False, vocab_size=258).ranks[1]
    assert rank.stages == [1, 2]
    tokens = 2 * 256
    blk = llama_block_activations(FLAVORS["debug"], 2, 4, 256, "cuda", 1.0, 1)
    recompute = (blk.none - blk.input) * tokens
    assert rank.in_flight == {1: 2, 2: 2}
    assert rank.transient == pytest.approx(7 * recompute, rel=1e-6)
    assert rank.categories()["temporaries"] >= 7 * recompute


def test_fsdp_without_pp_peaks_at_a_recomputed_block_beside_the_reduce_scatter_of_the_next():
    # pp = 1, dp_shard = 2, 2 microbatches, selective layer AC (layers 0 and 2 checkpointed). In
    # the second microbatch's backward, layer 3's backward is first (nothing reduced yet); at
    # layer 2's recomputation layer 3 has been reduce-scattered: its buffers (fp32: 4 + 4 bytes
    # per element of the block) beside layer 2's recomputation and backward, layers 0 and 1 kept.
    cfg = load_config(None, [
        "--model.name=llama", "--model.flavor=debug", "--parallelism.pp=1", "--parallelism.dp_shard=2",
        "--parallelism.microbatches=2", "--training.seq_len=256", "--training.global_batch_size=8",
        "--training.mixed_precision=fp32", "--activation_checkpoint.mode=selective",
        "--activation_checkpoint.selective_option=layer", "--activation_checkpoint.layer_freq=2"])
    rank = memory_plan(cfg, device="cuda", levers=False, vocab_size=258).ranks[0]
    args, tokens = FLAVORS["debug"], 2 * 256
    blk = llama_block_activations(args, 2, 4, 256, "cuda", 1.0, 1)
    rows = {"wq": args.n_heads * args.head_dim, "wk": args.n_kv_heads * args.head_dim,
            "wv": args.n_kv_heads * args.head_dim, "wo": args.dim, "w1": args.ffn_hidden_dim,
            "w3": args.ffn_hidden_dim, "w2": args.dim}
    cols = {"wq": args.dim, "wk": args.dim, "wv": args.dim, "wo": args.n_heads * args.head_dim,
            "w1": args.dim, "w3": args.dim, "w2": args.ffn_hidden_dim}
    # FSDP2 pads each parameter's rows to a multiple of the 2 shards; two norm weights of d.
    block_elements = sum(2 * -(-rows[k] // 2) * cols[k] for k in rows) + 2 * 2 * -(-args.dim // 2)
    kept = (2 * blk.input + blk.none + 8) * tokens  # layers 0 and 2: inputs; layer 1 whole; the token ids
    assert rank.activations - rank.activations_freed_at_peak == pytest.approx(kept, rel=1e-6)
    assert rank.transient == pytest.approx((blk.none - blk.input + blk.backward) * tokens + 8 * block_elements,
                                           rel=1e-6)


def test_a_tied_heads_last_stage_counts_its_copy_of_the_embedding():
    """With a tied head under PP the last stage (not the first) holds its own ``output``, a copy
    of the embedding (``build_stage_module``); the plan left it out, so Llama 3.2-1B's last rank
    on pp=2 × dp_shard=4 × tp=2 read −25 % against the simulated peak (parameters, gradients and
    optimizer state each one vocab × dim matrix short). Planned elements = the stage module's."""
    import torch

    from ray_titan.models.registry import build_model
    from ray_titan.parallel.pipeline import build_stage_module
    from ray_titan.preflight.plan_states import _stage_params

    with torch.device("meta"):
        whole = build_model("qwen3", "debug")
    assert whole.tied
    for first, last, layers in ((True, False, [0, 1]), (False, True, [2, 3])):
        stage = build_stage_module(whole, layers, first, last)
        planned = _stage_params(whole, layers, first, last, dp=1, ep=1, tp=1, bf16=False)
        assert planned.full == sum(p.numel() for p in stage.parameters()), (first, last)
