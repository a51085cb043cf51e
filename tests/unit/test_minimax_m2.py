"""MiniMax-M2 (``minimax_m2``) against transformers' ``MiniMaxM2ForCausalLM`` and the released
``config.json`` (no Ray, no process): logits and expert choices of a tiny random model through the
public import path, import -> train loop -> export bit for bit, the flavor's sizes against the
model card, tensor parallel refused before any worker starts, bad ``config.json`` values refused."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from ray_titan.models.decoder import count_parameters
from ray_titan.models.deepseek_v2.model import Router, activated_parameters
from ray_titan.models.registry import build_model, get_model_args, get_spec
from tests.support import hf_models as hf

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``(directory, transformers model)`` of the tiny MiniMax-M2 (tests/support/hf_models.py): 3
    MoE layers, heads of 32 with 16 rotated, q/k norms over all heads, 8 experts top-2 with a random
    correction bias."""
    path = tmp_path_factory.mktemp("minimax_m2")
    return path, hf.make_hf_model("minimax_m2", path)


def test_logits_and_experts_match_transformers(tiny):
    """300 tokens, fp32, weights std 0.3: logits within 1e-4 of transformers' and the same two
    experts for every token in the three MoE layers. Negative control on the same weights: the
    whole head rotated changes the logits, and so does a zero correction bias."""
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter

    path, ref = tiny
    model, spec, args = hf.load_ray_titan(path)
    assert (spec.name, args.moe_layers, args.rotary_dim, args.n_routed_experts) == ("minimax_m2", [0, 1, 2], 16, 8)
    tokens = hf.random_tokens()
    want, hf_routes = hf.expert_choices(ref, MiniMaxM2TopKRouter, tokens, 2)
    got, rt_routes = hf.expert_choices(model, Router, tokens, 1)
    print(f"max |logit difference| = {(got - want).abs().max().item():.2e} (logits up to {want.abs().max():.1f})")
    assert want.abs().max() > 3
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert len(hf_routes) == len(rt_routes) == 3
    for a, b in zip(hf_routes, rt_routes):
        assert torch.equal(a, b)
    whole = build_model(spec.name, "", args=dataclasses.replace(args, rotary_dim=args.head_dim))
    whole.load_state_dict(model.state_dict())
    whole.init_buffers()
    unbiased = build_model(spec.name, "", args=args)
    unbiased.load_state_dict({k: v if not k.endswith("expert_bias") else torch.zeros_like(v)
                              for k, v in model.state_dict().items()})
    unbiased.init_buffers()
    with torch.no_grad():
        assert (whole.eval()(tokens) - want).abs().max() > 1e-2
        assert (unbiased.eval()(tokens) - want).abs().max() > 1e-2


def test_import_train_export_is_bitwise(tiny, tmp_path):
    """Imported by the train loop, saved by a run whose only update is dropped, exported: the same
    tensors bit for bit under Mixtral's names (``block_sparse_moe.experts.E.w1``), a config.json
    transformers reads back with the original's logits."""
    src, _ = tiny
    # Auxiliary-loss-free balancing moves the correction bias after every step, a dropped one too.
    cfg, run_dir = hf.train_one_dropped_step(src, tmp_path, "--model.bias_update_rate=0")
    assert cfg.model.name == "minimax_m2"
    exported, config = hf.export_equals_source(run_dir, src, tmp_path / "export")
    assert {"model.layers.2.block_sparse_moe.e_score_correction_bias", "model.layers.0.self_attn.q_norm.weight",
            "model.layers.1.block_sparse_moe.experts.7.w2.weight"} <= exported.keys()
    assert (config["model_type"], config["num_local_experts"], config["rotary_dim"]) == ("minimax_m2", 8, 16)


# The architecture fields of the released config.json (huggingface.co/MiniMaxAI/MiniMax-M2/blob/main/config.json).
HUB_CONFIG = {
    "architectures": ["MiniMaxM2ForCausalLM"], "attn_type_list": [1] * 62, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 3072, "intermediate_size": 1536, "max_position_embeddings": 196608, "model_type": "minimax_m2",
    "num_attention_heads": 48, "num_experts_per_tok": 8, "num_hidden_layers": 62, "num_key_value_heads": 8,
    "num_local_experts": 256, "qk_norm_type": "per_layer", "rms_norm_eps": 1e-06, "rope_theta": 5000000,
    "rotary_dim": 64, "router_aux_loss_coef": 0.001, "scoring_func": "sigmoid", "shared_intermediate_size": 0,
    "tie_word_embeddings": False, "use_qk_norm": True, "use_routing_bias": True, "vocab_size": 200064}


def test_flavor_is_the_model_card():
    """The flavor is what the released config.json describes and has the card's "230 billion total
    parameters with 10 billion active": 228.69 B total (within 1 %), 10.42 B activated as DeepSeek
    counts (no input embedding), truncated to the card's 10."""
    spec = get_spec("minimax_m2")
    args = get_model_args("minimax_m2", "230B-A10B")
    spec.hf.check_config(HUB_CONFIG)
    assert spec.hf.differences(args, spec.hf.args_from_hf(HUB_CONFIG)) == []
    with torch.device("meta"):
        model = build_model("minimax_m2", "230B-A10B")
    assert abs(count_parameters(model) / 1e9 / 230 - 1) < 0.01
    assert math.floor(activated_parameters(model) / 1e9) == 10


def test_tensor_parallel_is_refused_before_any_worker():
    """Its q/k norms span all heads, which tensor parallel would split: the pre-flight refuses tp > 1."""
    from ray_titan.config import load_config
    from ray_titan.config.schema import ConfigError
    from ray_titan.preflight.checks import validate_job

    cfg = load_config(None, ["--model.name=minimax_m2", "--model.flavor=debug", "--parallelism.tp=2",
                             "--parallelism.pp=1", "--parallelism.dp_shard=1"])
    with pytest.raises(ConfigError, match=r"parallelism\.tp = 2 .*minimax_m2.*q/k RMSNorms span all heads"):
        validate_job(cfg)


@pytest.mark.parametrize("change, message", [
    ({"qk_norm_type": "per_head"}, r"qk_norm_type = 'per_head' is not supported; valid: 'per_layer'"),
    ({"rotary_dim": 15}, r"rotary_dim = 15 is not valid; valid: an even number up to head_dim = 32"),
    ({"attn_type_list": [1, 0, 1]}, r"attn_type_list = \[1, 0, 1\] is not supported"),
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok = 9 exceeds num_local_experts = 8"),
    ({"num_local_experts": 16}, r"num_local_experts = 16 but .*model\.safetensors holds 8 routed experts"),
])
def test_bad_config_json_is_refused_naming_the_field(tiny, tmp_path, change, message):
    hf.assert_config_refused(tiny[0], tmp_path, change, message)
