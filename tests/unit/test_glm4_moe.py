"""GLM-4.5 (``glm4_moe``) against transformers' ``Glm4MoeForCausalLM`` and the released
``config.json`` files (no Ray, no process): logits and expert choices of a tiny random model
through the public import path, import -> train loop -> export bit for bit, the flavors' sizes
against the model cards, bad ``config.json`` values refused."""

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
    """``(directory, transformers model)`` of the tiny GLM-4.5 (tests/support/hf_models.py): 3
    layers, the first dense, heads of 32 with 16 rotated, q/k/v biases and q/k norms, 8 experts in
    2 groups (top-2) with a random correction bias, one shared expert."""
    path = tmp_path_factory.mktemp("glm4_moe")
    return path, hf.make_hf_model("glm4_moe", path)


def test_logits_and_experts_match_transformers(tiny):
    """300 tokens, fp32, weights std 0.3: logits within 1e-4 of transformers' and the same two
    experts for every token in both MoE layers. Negative controls on the same weights: the whole
    head rotated (no partial rotary) or no q/k biases changes the logits."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    path, ref = tiny
    model, spec, args = hf.load_ray_titan(path)
    assert (spec.name, args.moe_layers, args.rotary_dim, args.qk_norm, args.attention_bias, args.n_group) == (
        "glm4_moe", [1, 2], 16, True, True, 2)
    tokens = hf.random_tokens()
    want, hf_routes = hf.expert_choices(ref, Glm4MoeTopkRouter, tokens, 2)
    got, rt_routes = hf.expert_choices(model, Router, tokens, 1)
    print(f"max |logit difference| = {(got - want).abs().max().item():.2e} (logits up to {want.abs().max():.1f})")
    assert want.abs().max() > 3  # large enough that a layout or scaling error shows
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert len(hf_routes) == len(rt_routes) == 2
    for a, b in zip(hf_routes, rt_routes):
        assert torch.equal(a, b)
    whole = build_model(spec.name, "", args=dataclasses.replace(args, partial_rotary_factor=1.0))
    whole.load_state_dict(model.state_dict())
    whole.init_buffers()
    state = {k: v for k, v in model.state_dict().items() if not k.endswith((".wq.bias", ".wk.bias", ".wv.bias"))}
    unbiased = build_model(spec.name, "", args=dataclasses.replace(args, attention_bias=False))
    unbiased.load_state_dict(state)
    unbiased.init_buffers()
    with torch.no_grad():
        assert (whole.eval()(tokens) - want).abs().max() > 1e-2
        assert (unbiased.eval()(tokens) - want).abs().max() > 1e-2


def test_import_train_export_is_bitwise(tiny, tmp_path):
    """The tiny model imported by the train loop (in this process), saved by a run whose only
    update is dropped, exported: the same tensors bit for bit under the same names (the correction
    bias in the weights, one tensor per expert), a config.json transformers reads back to the same
    architecture, and the export's logits in transformers equal the original's."""
    src, _ = tiny
    # Auxiliary-loss-free balancing moves the correction bias after every step, a dropped one too.
    cfg, run_dir = hf.train_one_dropped_step(src, tmp_path, "--model.bias_update_rate=0")
    assert cfg.model.name == "glm4_moe"
    exported, config = hf.export_equals_source(run_dir, src, tmp_path / "export")
    assert {"model.layers.2.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.shared_experts.up_proj.weight",
            "model.layers.0.self_attn.q_proj.bias"} <= exported.keys()
    assert (config["model_type"], config["n_routed_experts"], config["first_k_dense_replace"]) == ("glm4_moe", 8, 1)


# The architecture fields of the released config.json files (huggingface.co/zai-org/<name>/blob/main/config.json).
_GLM = {"architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "head_dim": 128,
        "hidden_act": "silu", "max_position_embeddings": 131072, "model_type": "glm4_moe", "n_group": 1,
        "norm_topk_prob": True, "num_attention_heads": 96, "num_experts_per_tok": 8, "num_key_value_heads": 8,
        "num_nextn_predict_layers": 1, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_scaling": None,
        "rope_theta": 1000000, "tie_word_embeddings": False, "topk_group": 1, "vocab_size": 151552,
        "n_shared_experts": 1}
HUB_CONFIGS = {
    "355B-A32B": {**_GLM, "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536,
                  "n_routed_experts": 160, "first_k_dense_replace": 3, "num_hidden_layers": 92,
                  "routed_scaling_factor": 2.5, "use_qk_norm": True},
    "106B-A12B": {**_GLM, "hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408,
                  "n_routed_experts": 128, "first_k_dense_replace": 1, "num_hidden_layers": 46,
                  "routed_scaling_factor": 1.0, "use_qk_norm": False},
}


@pytest.mark.parametrize("flavor, total, activated", [("355B-A32B", 355, 32), ("106B-A12B", 106, 12)])
def test_flavor_is_the_model_card(flavor, total, activated):
    """The flavor is what the released config.json describes (the adapter's ``differences``) and,
    on the meta device, has the card's counts: "355B total parameters and 32B active" (GLM-4.5),
    "106B total and 12B active" (Air). Activated as DeepSeek counts (no input embedding), truncated
    to the card's billions (32.86, 12.80); the totals within 1 % (352.80: the card's 355B sits
    between it and 356.8 with the multi-token-prediction layer, which the flavor builds only under
    ``model.mtp_layers = 1``; Air's 106.85)."""
    spec = get_spec("glm4_moe")
    args = get_model_args("glm4_moe", flavor)
    spec.hf.check_config(HUB_CONFIGS[flavor])  # every number of a released file is in range
    assert spec.hf.differences(args, spec.hf.args_from_hf(HUB_CONFIGS[flavor])) == []
    with torch.device("meta"):
        model = build_model("glm4_moe", flavor)
    assert abs(count_parameters(model) / 1e9 / total - 1) < 0.01
    assert math.floor(activated_parameters(model) / 1e9) == activated


def test_flops_count_the_activated_parameters():
    """The FLOPs count the activated parameters (routed top-k, shared expert, dense layers), not
    all experts, and an MTP depth as DeepSeek-V3's; the memory planner's block formula tells the
    dense layers from the MoE ones, and counts the MTP depth's block (layer ``n_layers``) as MoE."""
    from ray_titan.metrics.flops import model_flops_per_token

    args = get_model_args("glm4_moe", "106B-A12B")
    with torch.device("meta"):
        n_active = activated_parameters(build_model("glm4_moe", "106B-A12B"))
    assert model_flops_per_token(args, 4096) == 6 * n_active + 12 * args.n_layers * args.n_heads * args.head_dim * 4096
    # An MTP depth (model.mtp_layers = 1): its block's activated parameters and the head once more, one more layer.
    mtp = dataclasses.replace(args, n_mtp_layers=1)
    with torch.device("meta"):
        n_mtp = activated_parameters(build_model("glm4_moe", "", args=mtp)) + args.vocab_size * args.dim
    assert n_mtp > n_active + args.vocab_size * args.dim
    attention = 12 * (args.n_layers + 1) * args.n_heads * args.head_dim * 4096
    assert model_flops_per_token(mtp, 4096) == 6 * n_mtp + attention
    spec, debug = get_spec("glm4_moe"), get_model_args("glm4_moe", "debug")
    dense, moe, depth = (spec.block_activations(debug, layer, 2, 64, "cpu", 1.0, 1) for layer in (0, 1, 4))
    assert dense.experts_none == 0 < moe.experts_none == depth.experts_none  # the MTP depth's block is MoE


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": None, "partial_rotary_factor": 0.3},
     r"partial_rotary_factor = 0\.3 rotates 9 of the head's 32 dimensions"),
    ({"n_group": 3}, r"n_routed_experts = 8 is not divisible by n_group = 3"),
    ({"use_qk_norm": "yes"}, r"use_qk_norm = 'yes' is not valid; valid: true or false"),
    ({"first_k_dense_replace": 4}, r"first_k_dense_replace = 4 exceeds num_hidden_layers = 3"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                          "original_max_position_embeddings": 32768}},
     r"rope_parameters\.rope_type = 'yarn' is not supported for this model; valid: \['default'\]"),
])
def test_bad_config_json_is_refused_naming_the_field(tiny, tmp_path, change, message):
    hf.assert_config_refused(tiny[0], tmp_path, change, message)


def test_mtp_layer_is_imported_when_config_json_declares_it(tiny, tmp_path):
    """The released files carry the MTP layer as layer ``num_hidden_layers`` (transformers ignores
    ``model.layers.92.*``): with ``num_nextn_predict_layers = 1`` the depth is imported (its block
    and ``eh_proj`` as the files hold them), a job without MTP (``model.mtp_layers = 0``: the
    model built without the depth) reads the rest as before and skips it; a depth with tensors
    missing is refused naming one; with ``num_nextn_predict_layers = 0`` its tensors are refused
    as unexpected."""
    import json

    from safetensors.torch import load_file, save_file

    from ray_titan.checkpoint import HFCheckpointError, check_hf_checkpoint, load_hf_weights

    src, _ = tiny
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(tmp_path / "model.safetensors")
    g = torch.Generator().manual_seed(5)
    depth = {k.replace("layers.2.", "layers.3."): v + 0.01 * torch.randn(v.shape, generator=g)
             for k, v in tensors.items() if k.startswith("model.layers.2.")}  # an MoE block
    depth |= {f"model.layers.3.{n}.weight": torch.randn(64, generator=g)
              for n in ("enorm", "hnorm", "shared_head.norm")}
    depth["model.layers.3.eh_proj.weight"] = torch.randn(64, 128, generator=g)
    save_file(tensors | depth, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1  # transformers' default, written by save_pretrained
    model, spec, args = hf.load_ray_titan(tmp_path)
    assert args.n_mtp_layers == 1
    assert torch.equal(model.layers["3"].eh_proj.weight, depth["model.layers.3.eh_proj.weight"])
    bias = depth["model.layers.3.mlp.gate.e_score_correction_bias"]
    assert torch.equal(model.layers["3"].moe.router.expert_bias, bias)
    without = build_model(spec.name, "", args=dataclasses.replace(args, n_mtp_layers=0))
    load_hf_weights(without, str(tmp_path), spec, dataclasses.replace(args, n_mtp_layers=0))
    reference, _, _ = hf.load_ray_titan(src)
    assert without.state_dict().keys() == reference.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(without.state_dict().values(), reference.state_dict().values()))
    save_file(tensors | {"model.layers.3.eh_proj.weight": depth["model.layers.3.eh_proj.weight"]},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFCheckpointError, match=r"missing tensor\(s\) model.layers.3.enorm.weight"):
        check_hf_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(HFCheckpointError, match=r"unexpected tensor\(s\) model.layers.3.eh_proj.weight"):
        check_hf_checkpoint(str(tmp_path))
