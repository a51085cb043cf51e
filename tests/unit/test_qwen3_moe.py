"""Qwen3-MoE against transformers' ``Qwen3MoeForCausalLM`` and the released ``config.json`` files
(no Ray, no process): logits and expert choices of a tiny random model, the pooled balance loss
and its gradient, import -> train loop -> export bit for bit, the flavors' sizes against the
model cards, bad ``config.json`` values refused."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from ray_titan.models.decoder import count_parameters
from ray_titan.models.deepseek_v2.model import Router
from ray_titan.models.qwen3_moe import activated_parameters
from ray_titan.models.registry import build_model, get_model_args, get_spec
from tests.support.hf_models import (
    VOCAB,
    assert_config_refused,
    expert_choices,
    export_equals_source,
    load_ray_titan,
    make_hf_model,
    random_tokens,
    train_one_dropped_step,
)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``(directory, transformers model)`` of the tiny Qwen3-MoE (tests/support/hf_models.py):
    3 layers, the middle one dense, 8 experts top-2 with normalised weights."""
    path = tmp_path_factory.mktemp("qwen3_moe")
    return path, make_hf_model("qwen3_moe", path)


def _choices(model, router_cls, tokens):
    return expert_choices(model, router_cls, tokens, 1 if router_cls is Router else 2)


def test_logits_and_experts_match_transformers(tiny):
    """300 tokens, fp32, weights std 0.3: logits within 1e-4 of transformers' and the same two
    experts for every token in both MoE layers (0 and 2; layer 1 dense). Negative control on the
    same weights: without the top-k renormalisation the logits differ."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    path, ref = tiny
    model, spec, args = load_ray_titan(path)
    assert (spec.name, args.moe_layers, args.head_dim, args.norm_topk_prob) == ("qwen3_moe", [0, 2], 32, True)
    tokens = random_tokens()
    want, hf_routes = _choices(ref, Qwen3MoeTopKRouter, tokens)
    got, rt_routes = _choices(model, Router, tokens)
    print(f"max |logit difference| = {(got - want).abs().max().item():.2e} (logits up to {want.abs().max():.1f})")
    assert want.abs().max() > 3  # large enough that a layout or scaling error shows
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert len(hf_routes) == len(rt_routes) == 2
    for a, b in zip(hf_routes, rt_routes):
        assert torch.equal(a, b)
    unnormalised = build_model(spec.name, "", args=dataclasses.replace(args, norm_topk_prob=False))
    unnormalised.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (unnormalised(tokens) - want).abs().max() > 1e-2


def test_balance_loss_and_its_gradient_match_transformers(tiny):
    """The balance loss of a training forward is transformers' ``load_balancing_loss_func`` over
    both MoE layers' router logits pooled (``MoeCausalLMOutputWithPast.aux_loss``) times
    ``router_aux_loss_coef``, and the gradient it injects into each router's weight is the
    gradient of ``router_aux_loss_coef × aux_loss`` in transformers. Control: the mean of the
    per-layer Switch losses (the pooling undone) is a different value."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    path, ref = tiny
    model, _, args = load_ray_titan(path)
    model.train()
    tokens = torch.randint(0, VOCAB, (2, 150), generator=torch.Generator().manual_seed(3))
    coef = ref.config.router_aux_loss_coef
    assert args.aux_loss_coeff == coef == 0.001
    out = ref(tokens, output_router_logits=True)
    want = out.aux_loss
    (coef * want).backward()
    logits = model(tokens)
    (logits * 0).sum().backward()  # only the balance loss sends gradient to the routers
    got = sum(m.aux_loss_sum for m in model.moe_modules().values()) / coef
    print(f"balance loss: ray_titan {got.item():.8f}, transformers {want.item():.8f}")
    torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=0)
    for i in args.moe_layers:
        hf_grad = ref.model.layers[i].mlp.gate.weight.grad
        assert hf_grad.abs().max() > 0
        torch.testing.assert_close(model.layers[str(i)].moe.router.weight.grad, hf_grad, rtol=1e-5, atol=1e-9)
    per_layer = torch.stack([load_balancing_loss_func((g,), args.n_routed_experts, args.n_activated_experts)
                             for g in out.router_logits]).mean()
    assert abs(per_layer - want) > 1e-4


def test_balance_loss_is_the_same_under_activation_checkpointing():
    """Full activation checkpointing recomputes each block in backward: the balance loss, the
    routers' gradients and the per-expert counts are the plain run's (the recomputation records
    nothing), and no block keeps routing statistics after the step."""
    from ray_titan.parallel.ac import apply_ac

    base = build_model("qwen3_moe", "debug")
    base.init_weights(0)
    x = torch.randint(0, 258, (2, 64), generator=torch.Generator().manual_seed(1))
    runs = []
    for ac in (False, True):
        model = build_model("qwen3_moe", "debug")
        model.load_state_dict(base.state_dict())
        model.init_buffers()
        if ac:
            apply_ac(model, "full")
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        moes = model.moe_modules().values()
        assert all(m.balance_stats is None for m in moes)
        runs.append((sum(m.aux_loss_sum for m in moes), [m.router.weight.grad for m in moes],
                     [m.router.tokens_per_expert.clone() for m in moes]))
    (aux, grads, counts), (aux_ac, grads_ac, counts_ac) = runs
    assert aux > 0 and torch.equal(aux, aux_ac)
    assert all(torch.equal(a, b) for a, b in zip(counts, counts_ac))
    for a, b in zip(grads, grads_ac):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_import_train_export_is_bitwise(tiny, tmp_path):
    """The tiny model imported by the train loop (in this process), saved by a run whose only
    update is dropped, exported: the same tensors bit for bit under the same names (one per
    expert, as transformers' save_pretrained and the released files hold them), a config.json
    transformers reads back to the same architecture, and the export's logits in transformers
    equal ray_titan's. The run reports the balance loss and per-expert loads of both MoE layers."""
    src, ref = tiny
    cfg, run_dir = train_one_dropped_step(src, tmp_path)
    assert cfg.model.name == "qwen3_moe"
    out = tmp_path / "export"
    exported, config = export_equals_source(run_dir, src, out)
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in exported
    assert (config["model_type"], config["num_experts"], config["mlp_only_layers"]) == ("qwen3_moe", 8, [1])
    tokens = random_tokens(64, seed=2)
    with torch.no_grad():
        torch.testing.assert_close(load_ray_titan(out)[0](tokens), ref(tokens).logits, rtol=0, atol=1e-4)


# The architecture fields of the released config.json files (huggingface.co/Qwen/<name>/blob/main/config.json).
HUB_CONFIGS = {
    "30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
        "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
        "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
        "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
        "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
        "use_sliding_window": False, "vocab_size": 151936},
    "235B-A22B": {
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 94, "mlp_only_layers": [],
        "model_type": "qwen3_moe", "moe_intermediate_size": 1536, "norm_topk_prob": True, "num_attention_heads": 64,
        "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 94, "num_key_value_heads": 4,
        "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
        "use_sliding_window": False, "vocab_size": 151936},
}


@pytest.mark.parametrize("flavor, total, activated", [("30B-A3B", "30.5", "3.3"), ("235B-A22B", "235", "22")])
def test_flavor_is_the_model_card(flavor, total, activated):
    """The flavor is what the released config.json describes (the adapter's ``differences``) and,
    on the meta device, has the card's "30.5B in total and 3.3B activated" (235B / 22B): the
    counts truncated to the card's digits (30.53 B / 3.35 B; 235.09 B / 22.19 B, the embedding
    counted as activated, as the cards do: without it 3.04 B would not read 3.3B)."""
    spec = get_spec("qwen3_moe")
    args = get_model_args("qwen3_moe", flavor)
    spec.hf.check_config(HUB_CONFIGS[flavor])  # every number of a released file is in range
    assert spec.hf.differences(args, spec.hf.args_from_hf(HUB_CONFIGS[flavor])) == []
    assert (args.n_routed_experts, args.n_activated_experts, args.n_shared_experts, len(args.moe_layers)) == (
        128, 8, 0, args.n_layers)
    with torch.device("meta"):
        model = build_model("qwen3_moe", flavor)

    def card(n: int, digits: str) -> str:
        decimals = len(digits.partition(".")[2])
        return f"{math.floor(n / 1e9 * 10**decimals) / 10**decimals:.{decimals}f}"

    assert card(count_parameters(model), total) == total
    assert card(activated_parameters(model), activated) == activated


def test_memory_plan_and_flops_see_the_moe_layers():
    """The FLOPs count the activated parameters (not all experts), and the memory planner's block
    formula tells the dense layer from the MoE ones."""
    from ray_titan.metrics.flops import model_flops_per_token
    from ray_titan.models.qwen3_moe.costs import qwen3_moe_block_activations

    args = get_model_args("qwen3_moe", "30B-A3B")
    flops = model_flops_per_token(args, 4096)
    with torch.device("meta"):
        model = build_model("qwen3_moe", "30B-A3B")
    n_active = activated_parameters(model) - args.vocab_size * args.dim  # the embedding lookup costs none
    assert flops == 6 * n_active + 12 * args.n_layers * args.n_heads * args.head_dim * 4096
    debug = get_model_args("qwen3_moe", "debug")
    dense, moe = (qwen3_moe_block_activations(debug, layer, 2, 64, "cpu", 1.0, 1) for layer in (0, 1))
    assert dense.experts_none == 0 < moe.experts_none


@pytest.mark.parametrize("change, message", [
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok = 9 exceeds num_local_experts = 8; valid: 1 to 8"),
    ({"num_local_experts": 1e9}, r"num_local_experts = 1000000000\.0 is not valid; valid: an integer from 1 to 4096"),
    ({"num_local_experts": None}, r"config\.json has no 'num_experts'"),
    ({"num_local_experts": 4000, "num_experts_per_tok": 2},
     r"num_local_experts = 4000 but .*model\.safetensors holds 8 routed experts"),
    ({"mlp_only_layers": [3]}, r"mlp_only_layers = \[3\] is not valid; valid: a list of layer indices from 0 to 2"),
    ({"decoder_sparse_step": 0}, r"decoder_sparse_step = 0 is not valid; valid: an integer from 1 to 256"),
    ({"norm_topk_prob": "yes"}, r"norm_topk_prob = 'yes' is not valid; valid: true or false"),
    ({"use_sliding_window": True}, r"use_sliding_window = True is not supported; valid: False"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                          "original_max_position_embeddings": 32768}},
     r"rope_parameters\.rope_type = 'yarn' is not supported for this model; valid: \['default'\]"),
])
def test_bad_config_json_is_refused_naming_the_field(tiny, tmp_path, change, message):
    assert_config_refused(tiny[0], tmp_path, change, message)


def test_the_hub_name_num_experts_is_read(tiny):
    """The released files say ``num_experts``; transformers 5 writes ``num_local_experts``: both."""
    src, _ = tiny
    config = json.loads((src / "config.json").read_text())
    adapter = get_spec("qwen3_moe").hf
    hub = {k: v for k, v in config.items() if k != "num_local_experts"} | {"num_experts": 8}
    assert adapter.args_from_hf(hub) == adapter.args_from_hf(config)
    assert np.array_equal(adapter.args_from_hf(hub).moe_layers, [0, 2])


def test_the_balance_loss_leaves_the_fsdp_wrapped_models_output_a_fresh_tensor():
    """Qwen3-MoE adds its pooled balance loss at the model's end (``_AddAuxLoss``): its output,
    the FSDP2 root's, was a view of the logits, and FSDP2 warned on every run ("returned a view
    tensor"). It is not a view now. (That the balance loss's gradient is transformers': the test
    above, through the same ``_AddAuxLoss``.)"""
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ray_titan.parallel.fsdp import apply_fsdp

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = build_model("qwen3_moe", "debug")
        model.init_weights(0)
        apply_fsdp(model, init_device_mesh("cpu", (1,)), True)
        x = torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(0))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out = model(x)
        assert out._base is None
        assert not [w for w in seen if "returned a view tensor" in str(w.message)]
        out.float().logsumexp(-1).mean().backward()
        router = model.get_parameter("layers.1.moe.router.weight")
        assert router.grad is not None and router.grad.full_tensor().abs().sum() > 0
    finally:
        dist.destroy_process_group()
