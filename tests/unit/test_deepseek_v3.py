"""DeepSeek-V3 and Kimi K2 against transformers' ``DeepseekV3ForCausalLM`` and the released
``config.json`` files (no Ray, no process): logits and expert choices of a tiny random model, the
correction bias and the sigmoid group routing each shown to matter, the multi-token-prediction
layer's tensors refused where config.json declares none, FP8 files refused, the flavors' sizes
against the model cards."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from ray_titan.checkpoint import HFCheckpointError, check_hf_checkpoint
from ray_titan.models.decoder import count_parameters
from ray_titan.models.deepseek_v2 import activated_parameters
from ray_titan.models.registry import build_model, get_model_args, spec_for_hf
from ray_titan.models.routing import ROUTERS
from tests.support.hf_models import VOCAB, expert_choices, load_ray_titan, make_hf_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    """``(directory, transformers model)`` of the tiny DeepSeek-V3 (tests/support/hf_models.py)."""
    path = tmp_path_factory.mktemp("deepseek_v3")
    return path, make_hf_model("deepseek_v3", path)


def _choices(model, router_cls, tokens):
    return expert_choices(model, router_cls, tokens, 2 if router_cls.__name__.endswith("TopkRouter") else 1)


def test_logits_and_experts_match_transformers(v3):
    """300 tokens, fp32, weights std 0.3: logits within 1e-4 of transformers' and the same two
    experts for every token in both MoE layers. Negative controls on the same weights: without
    the correction bias, with V2's softmax scores, or with every group allowed, other experts are
    chosen; with V2's weights (no scaling after the normalisation) the logits differ."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from ray_titan.models.deepseek_v2.model import Router

    path, ref = v3
    model, spec, args = load_ray_titan(path)
    assert (spec.name, args.topk_method, args.score_func, args.n_group, args.topk_group, args.q_lora_rank) == (
        "deepseek_v3", "noaux_tc", "sigmoid", 4, 2, 24)
    bias = ref.model.layers[2].mlp.gate.e_score_correction_bias
    assert bias.abs().max() > 0 and torch.equal(model.layers["2"].moe.router.expert_bias, bias)
    tokens = torch.randint(0, VOCAB, (1, 300), generator=torch.Generator().manual_seed(11))
    want, hf_routes = _choices(ref, DeepseekV3TopkRouter, tokens)
    got, rt_routes = _choices(model, Router, tokens)
    assert want.abs().max() > 3  # large enough that a layout or scaling error shows
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert len(hf_routes) == len(rt_routes) == 2
    for a, b in zip(hf_routes, rt_routes):
        assert torch.equal(a, b)
    for change in ({"zero_bias": True}, {"score_func": "softmax"}, {"topk_group": 4}):
        other = build_model(spec.name, "", args=dataclasses.replace(args, **{k: v for k, v in change.items()
                                                                              if k != "zero_bias"}))
        other.load_state_dict(model.state_dict())
        if "zero_bias" in change:
            for moe in other.moe_modules().values():
                moe.router.expert_bias.zero_()
        _, routes = _choices(other.eval(), Router, tokens)
        assert not all(torch.equal(a, b) for a, b in zip(routes, rt_routes)), change
    v2_weights = build_model(spec.name, "", args=dataclasses.replace(args, route_scale=1.0))
    v2_weights.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (v2_weights(tokens) - want).abs().max() > 1e-2


def test_rotary_tables_fitted_to_the_job_keep_yarns_frequencies(v3):
    """The trainer's tables cover ``training.seq_len`` positions only (300 here, of config.json's
    2,560): the same rows, bitwise, as the whole YaRN tables (``original_max_position_embeddings``
    sets the frequencies, not the table's length), and the same logits as transformers'. Longer
    than ``max_seq_len`` is refused."""
    from ray_titan.checkpoint import load_hf_weights

    path, ref = v3
    whole, spec, args = load_ray_titan(path)
    fitted = build_model(spec.name, "", args=args, rope_positions=300)
    fitted.init_buffers()  # as the trainer initialises them, after materialising
    load_hf_weights(fitted, str(path), spec, args)
    assert args.max_seq_len == 2560 and args.rope_scaling.kind == "yarn"
    assert fitted.rope_cos.shape == (300, args.qk_rope_head_dim // 2) and fitted.rope_positions == 300
    assert torch.equal(fitted.rope_cos, whole.rope_cos[:300]) and torch.equal(fitted.rope_sin, whole.rope_sin[:300])
    tokens = torch.randint(0, VOCAB, (1, 300), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got, want = fitted.eval()(tokens), ref(tokens).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    with torch.no_grad():
        assert torch.equal(got, whole(tokens))
    with pytest.raises(ValueError, match="1 .. 2560"):
        fitted.fit_rope_tables(2561)


def test_the_trainer_and_the_plan_fit_the_rotary_tables_to_training_seq_len():
    """``build_stages`` (one rank) and the memory plan's model hold tables of ``training.seq_len``
    rows, not the flavor's ``max_seq_len`` (1,024 for the debug flavor)."""
    from ray_titan.config import load_config
    from ray_titan.preflight.plan_job import _job
    from ray_titan.trainer.build import build_stages, parallel_dims

    cfg = load_config("configs/debug_deepseek_v3.toml", ["--parallelism.pp=1", "--parallelism.dp_shard=1",
                                                          "--parallelism.ep=1", "--training.seq_len=96",
                                                          "--training.global_batch_size=2"])
    (stage,) = build_stages(cfg, parallel_dims(cfg), None, 0, 258, torch.device("cpu")).values()
    planned = _job(cfg, "cpu", 1.0, 258).whole
    rope_dim = get_model_args("deepseek_v3", "debug").qk_rope_head_dim
    for model in (stage, planned):
        assert model.rope_cos.shape == model.rope_sin.shape == (96, rope_dim // 2)


def test_noaux_tc_weights_are_normalised_then_scaled():
    """V3's weights: the chosen sigmoid scores summing to 1, times routed_scaling_factor (V2
    scales only when not normalising); the selection uses the bias, the weights do not."""
    args = get_model_args("deepseek_v3", "debug")
    logits = torch.randn(64, args.n_routed_experts, generator=torch.Generator().manual_seed(3))
    bias = torch.zeros(args.n_routed_experts)
    bias[5] = 10.0  # expert 5 wins every token's selection, its weight stays its sigmoid score
    weights, indices, scores = ROUTERS["noaux_tc"](logits, bias, args)
    assert (indices == 5).any(dim=-1).all()
    torch.testing.assert_close(scores, logits.sigmoid())
    torch.testing.assert_close(weights.sum(-1), torch.full((64,), args.route_scale))
    chosen = logits.sigmoid().gather(-1, indices)
    torch.testing.assert_close(weights, args.route_scale * chosen / chosen.sum(-1, keepdim=True))


def test_noaux_tc_with_one_group_chooses_as_the_grouped_rule_and_saves_no_group_ranking():
    """One group (Kimi K2, the 16B flavor): the same experts and weights as ranking the one group
    (the general rule, :func:`_top_k_in_best_groups`), and autograd keeps nothing of ranking the
    group for backward (the ``(tokens, 1, 2)`` indices of each group's two best scores, ...)."""
    from ray_titan.models.routing import _top_k_in_best_groups

    args = dataclasses.replace(get_model_args("deepseek_v3", "debug"), n_group=1, topk_group=1)
    logits = torch.randn(64, args.n_routed_experts, generator=torch.Generator().manual_seed(4), requires_grad=True)
    bias = torch.randn(args.n_routed_experts, generator=torch.Generator().manual_seed(5))
    saved: list[tuple[int, ...]] = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        weights, indices, _ = ROUTERS["noaux_tc"](logits, bias, args)
    assert saved and not any(len(shape) == 3 for shape in saved), saved  # (tokens, groups, ...): none
    select = logits.sigmoid() + bias
    ranked = select.view(64, 1, -1).topk(2, dim=-1).values.sum(dim=-1)
    assert torch.equal(indices, _top_k_in_best_groups(select, ranked, args))
    chosen = logits.sigmoid().gather(-1, indices)
    torch.testing.assert_close(weights, args.route_scale * chosen / chosen.sum(-1, keepdim=True))


def test_mtp_tensors_are_refused_when_config_json_declares_none(v3, tmp_path):
    """A multi-token-prediction depth's tensors (``model.layers.<num_hidden_layers>.*``) in files
    whose config.json says ``num_nextn_predict_layers = 0`` are refused as unexpected tensors
    (their import and export: tests/unit/test_mtp.py)."""
    from safetensors.torch import load_file, save_file

    src, _ = v3
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(tmp_path / "model.safetensors")
    tensors |= {"model.layers.3.eh_proj.weight": torch.randn(64, 128),
                "model.layers.3.self_attn.q_a_proj.weight": torch.randn(24, 64)}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(HFCheckpointError, match=r"unexpected tensor\(s\) model.layers.3.eh_proj.weight"):
        check_hf_checkpoint(str(tmp_path))


def test_non_finite_weights_are_refused_at_import_naming_the_tensor(v3, tmp_path):
    """A NaN in a layer's correction bias (routing would collapse onto the experts it does not
    poison, and the run fail only at its first checkpoint), then an infinity in one expert's
    weight: the headers pass the pre-flight, the import (each rank reads its rows) refuses,
    naming the file, the tensor and the row."""
    from safetensors.torch import load_file, save_file

    src, _ = v3
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.1.mlp.gate.e_score_correction_bias"][3] = float("nan")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    check_hf_checkpoint(str(tmp_path))  # headers only: shapes and dtypes are right
    bias = r"model\.layers\.1\.mlp\.gate\.e_score_correction_bias"
    with pytest.raises(HFCheckpointError, match=rf"{tmp_path}/model\.safetensors: tensor {bias} has NaN or infinite "
                                                r"values \(row 3 of dim 0\)"):
        load_ray_titan(tmp_path)
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.2.mlp.experts.5.up_proj.weight"][2, 1] = float("-inf")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFCheckpointError, match=r"tensor model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight has NaN"):
        load_ray_titan(tmp_path)


def test_fp8_checkpoint_and_v2_routing_are_refused_naming_the_field(v3, tmp_path):
    src, _ = v3
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    for change, message in [
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
         r"quantization_config\.quant_method = 'fp8' is not supported for deepseek_v3; .* convert them to bf16 "
         r"first"),
        ({"topk_method": "greedy"}, r"topk_method = 'greedy' is not supported for deepseek_v3; valid: \['noaux_tc'\]"),
        ({"scoring_func": "softmax"},
         r"scoring_func = 'softmax' is not supported for deepseek_v3; valid: \['sigmoid'\]"),
        ({"n_group": 3}, r"n_routed_experts = 8 is not divisible by n_group = 3"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(HFCheckpointError, match=message):
            check_hf_checkpoint(str(tmp_path))


# The architecture fields of the released config.json files (huggingface.co/<repo>/blob/main/config.json).
V3_CONFIG = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "first_k_dense_replace": 3,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "moe_layer_freq": 1, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "vocab_size": 129280, "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "aux_loss_alpha": 0.001,
    "seq_aux": True, "ep_size": 1,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}
K2_CONFIG = {
    **V3_CONFIG, "model_type": "kimi_k2", "num_attention_heads": 64, "num_key_value_heads": 64,
    "n_routed_experts": 384, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.827, "num_nextn_predict_layers": 0, "vocab_size": 163840,
    "max_position_embeddings": 131072, "rope_theta": 50000.0,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}


@pytest.mark.parametrize("flavor, config, total, activated", [
    # Model cards: DeepSeek-V3 671 B total, 37 B activated (36.6 B counted, the MTP module's
    # 11.5 B + shared parts not included); Kimi K2 1 T total (1.026 T counted), 32 B activated.
    ("671B", V3_CONFIG, 671e9, 37e9),
    ("kimi_k2", K2_CONFIG, 1.026e12, 32e9),
])
def test_flavor_is_the_released_config_json_with_the_model_card_sizes(flavor, config, total, activated):
    spec = spec_for_hf(config["model_type"])  # kimi_k2 is a DeepSeek-V3
    assert spec.name == "deepseek_v3"
    spec.hf.check_config(config)  # every number of a released file is in range
    args = spec.hf.args_from_hf(config)
    assert spec.hf.differences(get_model_args("deepseek_v3", flavor), args) == []
    with torch.device("meta"):  # the cards count the main model, without the MTP depth
        model = build_model("deepseek_v3", "", args=dataclasses.replace(args, n_mtp_layers=0))
        with_mtp = build_model("deepseek_v3", "", args=args)
    assert count_parameters(model) == pytest.approx(total, rel=0.002)
    assert activated_parameters(model) == pytest.approx(activated, rel=0.02)
    if args.n_mtp_layers:  # DeepSeek-V3's card: "14B of the Multi-Token Prediction (MTP) Module weights",
        # which counts its copies of the embedding and the output head
        mtp = count_parameters(with_mtp) - count_parameters(model) + 2 * args.vocab_size * args.dim
        assert mtp == pytest.approx(14e9, rel=0.05)


def test_16b_flavor_has_torchtitans_sizes():
    """torchtitan's deepseek_v3 "16B": DeepSeek-MoE-16B's sizes, 15.7 B total and 2.4 B activated."""
    with torch.device("meta"):
        model = build_model("deepseek_v3", "16B")
    assert round(count_parameters(model) / 1e9, 1) == 15.7
    assert activated_parameters(model) == pytest.approx(2.4e9, rel=0.03)  # 2.45 B counted
