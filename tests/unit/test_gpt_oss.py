"""gpt-oss against transformers' ``GptOssForCausalLM``, its MXFP4 dequantisation and the released
``config.json`` files (no Ray, no process): logits and expert choices of a tiny random model
(sinks, sliding windows, YaRN with ``truncate`` false, clamped SwiGLU experts with biases),
negative controls, MXFP4 import, import -> train loop -> export bit for bit, the flavors' sizes
against the model card, bad ``config.json`` values refused."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from ray_titan.checkpoint import HFCheckpointError, check_hf_checkpoint
from ray_titan.models.decoder import count_parameters
from ray_titan.models.deepseek_v2.model import Router
from ray_titan.models.gpt_oss import activated_parameters
from ray_titan.models.gpt_oss.mxfp4 import dequantize_mxfp4
from ray_titan.models.registry import build_model, get_model_args, get_spec
from ray_titan.models.rope import inv_frequencies
from tests.support.hf_models import (
    export_equals_source,
    load_ray_titan,
    make_hf_model,
    random_tokens,
    train_one_dropped_step,
)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``(directory, transformers model)`` of the tiny gpt-oss (tests/support/hf_models.py): 3
    layers sliding (window 16) / full / sliding, 8 experts top-2, fp32, weights std 0.3."""
    path = tmp_path_factory.mktemp("gpt_oss")
    return path, make_hf_model("gpt_oss", path)


def _eager_sdpa(q, k, v, attn_mask=None, enable_gqa=False, **_):
    """transformers' eager attention arithmetic (``eager_attention_forward``: matmul, scale,
    additive mask, max subtracted, softmax, matmul) for SDPA's arguments, to measure the floor."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5 + attn_mask
    s = s - s.max(dim=-1, keepdim=True).values
    return torch.matmul(s.softmax(dim=-1), v)


def test_logits_and_experts_match_transformers(tiny, monkeypatch):
    """300 tokens (a window of 16 matters), fp32, weights std 0.3: the logits equal
    transformers' (eager: its only exact path) within 1e-4 or 3× the floor, the floor being
    this model with its SDPA-with-sink attention computed eagerly instead; the same two experts
    for every token in all three layers. Negative controls on the same weights: without sinks,
    or with full attention in every layer, the logits differ."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    path, ref = tiny
    model, spec, args = load_ray_titan(path)
    assert spec.name == "gpt_oss" and args.rope_scaling is not None and not args.rope_scaling.truncate
    tokens = random_tokens()
    hf_routes: list[torch.Tensor] = []
    rt_routes: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda mod, i, out: hf_routes.append(out[2].sort(dim=-1).values))
             for m in ref.modules() if isinstance(m, GptOssTopKRouter)]
    hooks += [m.register_forward_hook(lambda mod, i, out: rt_routes.append(out[1].sort(dim=-1).values))
              for m in model.modules() if isinstance(m, Router)]
    with torch.no_grad():
        want = ref(tokens).logits
        got = model(tokens)
    for h in hooks:
        h.remove()
    with torch.no_grad(), monkeypatch.context() as m:
        m.setattr(torch.nn.functional, "scaled_dot_product_attention", _eager_sdpa)
        eager = model(tokens)
    diff, floor = (got - want).abs().max().item(), (got - eager).abs().max().item()
    print(f"max |logit difference| = {diff:.2e} (eager floor {floor:.2e}, eager vs transformers "
          f"{(eager - want).abs().max().item():.2e}; logits up to {want.abs().max():.1f})")
    assert want.abs().max() > 3  # large enough that a layout or scaling error shows
    assert diff <= max(1e-4, 3 * floor)
    assert len(hf_routes) == len(rt_routes) == 3
    for a, b in zip(hf_routes, rt_routes):
        assert torch.equal(a, b)
    # The clamp of the experts' SwiGLU is reached (gate or up beyond 7), so it is tested too.
    no_sinks = build_model(spec.name, "", args=args)
    no_sinks.load_state_dict(model.state_dict())
    no_sinks.init_buffers()
    no_window = build_model(spec.name, "", args=dataclasses.replace(args, layer_types=("full_attention",) * 3))
    no_window.load_state_dict(model.state_dict())
    no_window.init_buffers()
    with torch.no_grad():
        for layer in no_sinks.layers.values():
            layer.attention.sinks.fill_(float("-inf"))  # exp(-inf) = 0: no sink in the denominator
        assert (no_sinks(tokens) - want).abs().max() > 1e-2
        assert (no_window(tokens) - want).abs().max() > 1e-2


def test_clamped_swiglu_is_transformers_gate():
    """The experts' activation is ``GptOssExperts._apply_gate`` of the interleaved gate/up
    columns, clamps included (values well beyond ``limit``)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from ray_titan.models.deepseek_v2.model import clamped_swiglu

    experts = GptOssExperts(GptOssConfig(hidden_size=8, intermediate_size=16, num_local_experts=2))
    gate_up = 6 * torch.randn(50, 32, generator=torch.Generator().manual_seed(0))
    assert gate_up.abs().max() > 14
    want = experts._apply_gate(gate_up)
    torch.testing.assert_close(clamped_swiglu(gate_up[:, ::2], gate_up[:, 1::2]), want, rtol=0, atol=0)


def test_yarn_without_truncation_is_transformers():
    """gpt-oss's rope (YaRN, ``truncate`` false: a fractional correction range) gives
    transformers' frequencies and cos/sin factor bit for bit, and differs from the truncated one."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    a = get_model_args("gpt_oss", "20B")
    got, factor = inv_frequencies(a.head_dim, a.rope_theta, a.rope_scaling)
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](GptOssConfig())
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert factor == want_factor
    assert a.rope_scaling is not None
    truncated, _ = inv_frequencies(a.head_dim, a.rope_theta, dataclasses.replace(a.rope_scaling, truncate=True))
    assert not torch.equal(truncated, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantisation_is_transformers(dtype):
    """Random packed bytes and scales (every FP4 code, scales 2^-20 to 2^20):
    :func:`dequantize_mxfp4` equals transformers' ``convert_moe_packed_tensors`` bit for bit."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 24, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(127 - 20, 127 + 21, (3, 24, 4), generator=g, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    got = dequantize_mxfp4(blocks, scales).to(dtype)
    assert got.shape == want.shape == (3, 128, 24)
    assert torch.equal(got, want)


def test_mxfp4_checkpoint_imports_as_its_dequantised_weights(tiny, tmp_path):
    """The tiny model's files with the experts' ``gate_up_proj`` / ``down_proj`` replaced by
    random MXFP4 ``*_blocks`` / ``*_scales`` (as the released files hold them, with
    ``quantization_config.quant_method = "mxfp4"``) import as transformers dequantises them;
    a scale byte of 255 is refused at import naming the packed tensor and the expert; a packed
    tensor of the wrong shape is refused naming it."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src, _ = tiny
    tensors = load_file(src / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    want = {}
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, n_in, n_out = tensors.pop(key).shape
        blocks = torch.randint(0, 256, (e, n_out, n_in // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(120, 130, (e, n_out, n_in // 32), generator=g, dtype=torch.uint8)
        tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
        want[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    packed = tmp_path / "packed"
    shutil.copytree(src, packed)
    save_file(tensors, packed / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (packed / "config.json").write_text(json.dumps(config))
    model, _, _ = load_ray_titan(packed)
    for i in range(3):
        ex = model.layers[str(i)].moe.experts
        gate_up = want[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        assert torch.equal(ex.w1, gate_up[..., ::2].transpose(1, 2))
        assert torch.equal(ex.w3, gate_up[..., 1::2].transpose(1, 2))
        assert torch.equal(ex.w2, want[f"model.layers.{i}.mlp.experts.down_proj"].transpose(1, 2))
    # A scale byte of 255 (NaN in the MX spec): refused at import, traced to the packed tensor.
    scales = tensors["model.layers.1.mlp.experts.down_proj_scales"]
    tensors["model.layers.1.mlp.experts.down_proj_scales"] = scales.clone().index_fill_(0, torch.tensor([6]), 255)
    save_file(tensors, packed / "model.safetensors")
    check_hf_checkpoint(str(packed))  # headers only
    down = r"model\.layers\.1\.mlp\.experts\.down_proj"
    with pytest.raises(HFCheckpointError, match=rf"{packed}/model\.safetensors: tensor {down}_blocks / {down}_scales, "
                                                r"MXFP4, hold NaN or infinite values once dequantised .*\(row 6 "):
        load_ray_titan(packed)
    tensors["model.layers.1.mlp.experts.down_proj_scales"] = scales
    tensors["model.layers.0.mlp.experts.down_proj_scales"] = tensors["model.layers.0.mlp.experts.down_proj_scales"][:4]
    save_file(tensors, packed / "model.safetensors")
    with pytest.raises(HFCheckpointError, match=r"MXFP4 tensors model\.layers\.0\.mlp\.experts\.down_proj_blocks"):
        check_hf_checkpoint(str(packed))


def test_import_train_export_is_bitwise(tiny, tmp_path):
    """The tiny model imported by the train loop (in this process), saved by a run whose only
    update is dropped, exported: the same tensors bit for bit under the same names (the fused
    ``gate_up_proj`` re-interleaved), a config.json transformers reads back to the same model,
    whose logits equal the original's."""
    src, _ = tiny
    cfg, run_dir = train_one_dropped_step(src, tmp_path)
    assert cfg.model.name == "gpt_oss"
    _, config = export_equals_source(run_dir, src, tmp_path / "export")
    assert (config["model_type"], config["sliding_window"], config["rope_scaling"]["truncate"]) == (
        "gpt_oss", 16, False)


# The architecture fields of the released config.json files (huggingface.co/openai/<name>/blob/main/config.json).
_HUB_COMMON = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "experts_per_token": 4,
    "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "intermediate_size": 2880, "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_key_value_heads": 8, "quantization_config": {
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "vocab_size": 201088,
}
HUB_CONFIGS = {
    "20B": {**_HUB_COMMON, "num_hidden_layers": 24, "num_local_experts": 32,
            "layer_types": ["sliding_attention", "full_attention"] * 12},
    "120B": {**_HUB_COMMON, "num_hidden_layers": 36, "num_local_experts": 128,
             "layer_types": ["sliding_attention", "full_attention"] * 18},
}


@pytest.mark.parametrize("flavor, total, active", [("20B", 20.91e9, 3.61e9), ("120B", 116.83e9, 5.13e9)])
def test_flavor_is_the_model_card(flavor, total, active):
    """The flavor is what the released config.json describes (the adapter's ``differences``) and,
    on the meta device, has the model card's parameter table: 20.91 B total / 3.61 B active
    (the card: "21B" / "3.6B"), 116.83 B / 5.13 B ("117B" / "5.1B"); active = all but the input
    embedding and the 28 of 32 (124 of 128) experts a token does not use."""
    spec = get_spec("gpt_oss")
    args = get_model_args("gpt_oss", flavor)
    spec.hf.check_config(HUB_CONFIGS[flavor])  # every number in range, MXFP4 accepted
    assert spec.hf.differences(args, spec.hf.args_from_hf(HUB_CONFIGS[flavor])) == []
    with torch.device("meta"):
        model = build_model("gpt_oss", flavor)
    assert count_parameters(model) == pytest.approx(total, abs=0.005e9)
    assert activated_parameters(model) == pytest.approx(active, abs=0.005e9)


@pytest.mark.parametrize("change, message", [
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok = 9 exceeds num_local_experts = 8; valid: 1 to 8"),
    ({"num_local_experts": 4000}, r"num_local_experts = 4000 but .*model\.safetensors holds 8 routed experts"),
    ({"sliding_window": 0}, r"sliding_window = 0 is not valid; valid: an integer from 1 to"),
    ({"layer_types": ["full_attention"]}, r"layer_types = \['full_attention'\] is not valid; valid: a list of "
                                          r"num_hidden_layers = 3 values"),
    ({"swiglu_limit": -1}, r"swiglu_limit = -1 is not valid; valid: a finite number > 0"),
    ({"attention_bias": False}, r"attention_bias = False is not supported; valid: true"),
    ({"quantization_config": {"quant_method": "fp8"}},
     r"quantization_config\.quant_method = 'fp8' is not supported for gpt_oss; valid: 'mxfp4'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.5e5, "factor": 32.0, "truncate": "no",
                          "original_max_position_embeddings": 64}},
     r"rope_parameters\.truncate = 'no' is not valid; valid: true or false"),
])
def test_bad_config_json_is_refused_naming_the_field(tiny, tmp_path, change, message):
    src, _ = tiny
    shutil.copytree(src, tmp_path / "m")
    config = json.loads((src / "config.json").read_text()) | change
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFCheckpointError, match=rf"{tmp_path / 'm'}/config\.json: .*{message}"):
        check_hf_checkpoint(str(tmp_path / "m"))


def test_tensor_parallel_is_refused_before_any_worker():
    from ray_titan.config import load_config
    from ray_titan.config.schema import ConfigError
    from ray_titan.preflight.checks import validate_job

    cfg = load_config(None, ["--model.name=gpt_oss", "--model.flavor=debug", "--parallelism.tp=2",
                             "--parallelism.dp_shard=1", "--parallelism.pp=1", "--ray.num_workers=2"])
    with pytest.raises(ConfigError, match=r"parallelism\.tp = 2 is not supported for gpt_oss/debug"):
        validate_job(cfg, check_data=False)


def test_expert_parallel_shards_the_expert_biases_with_the_weights():
    """On a one-rank ``ep`` mesh (in this process) every expert parameter, the biases included,
    becomes a ``Shard(0)`` DTensor and the layer's output is unchanged, gradients included."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from ray_titan.parallel.expert import apply_expert_parallel

    base = build_model("gpt_oss", "debug")
    base.init_weights(0)
    x = torch.randint(0, 258, (2, 40), generator=torch.Generator().manual_seed(0))
    want = base(x)
    want.square().mean().backward()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with torch.device("meta"):
            model = build_model("gpt_oss", "debug")
        apply_expert_parallel(model, init_device_mesh("cpu", (1,)))
        experts = model.layers["0"].moe.experts
        assert {n for n, _ in experts.named_parameters()} == {"w1", "w2", "w3", "b1", "b2", "b3"}
        for _, p in experts.named_parameters():
            assert isinstance(p, DTensor) and p.placements == (Shard(0),)
        model.to_empty(device="cpu")
        model.init_weights(0)
        got = model(x)
        got.square().mean().backward()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        torch.testing.assert_close(experts.b2.grad.full_tensor(), base.layers["0"].moe.experts.b2.grad,
                                   rtol=1e-5, atol=1e-8)
    finally:
        dist.destroy_process_group()


def test_flops_count_the_active_parameters_and_the_windows():
    """6·N (active, non-embedding) plus 12·H·Q per context token: T for the 12 full layers,
    min(T, 128) for the 12 sliding ones."""
    from ray_titan.metrics.flops import model_flops_per_token

    args = get_model_args("gpt_oss", "20B")
    with torch.device("meta"):
        model = build_model("gpt_oss", "20B")
    hq = args.n_heads * args.head_dim
    assert model_flops_per_token(args, 4096) == 6 * activated_parameters(model) + 12 * hq * (12 * 4096 + 12 * 128)


@pytest.mark.parametrize("layer", [0, 1])
def test_memory_plan_formula_is_what_autograd_saves(layer):
    """The memory planner's block formula (fp32, CPU) within 1% of the bytes autograd saves in
    one block's forward (sliding and full layers alike: the sink mask is (heads, seq + 1) per
    query in both)."""
    from ray_titan.models.gpt_oss.costs import gpt_oss_block_activations

    model = build_model("gpt_oss", "debug")
    model.init_weights(0)
    b, s = 4, 128
    block = model.layers[str(layer)]
    x = torch.randn(b, s, model.args.dim, requires_grad=True)
    cos, sin = model.rope_cos[:s], model.rope_sin[:s]
    skip = {p.untyped_storage().data_ptr() for p in block.parameters()}
    skip |= {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, cos, sin)
    planned = gpt_oss_block_activations(model.args, layer, 4, s, "cpu", 1.0, 1).none * b * s
    print(f"layer {layer}: planned {planned:.0f} bytes, autograd saves {sum(seen.values())}")
    assert planned == pytest.approx(sum(seen.values()), rel=0.01)


def test_packed_documents_compute_what_each_document_would_alone():
    """Two documents packed in one sequence (positions restarting at 0): each one's logits are
    those of the document alone, sliding window included (the second is longer than it)."""
    model = build_model("gpt_oss", "debug")
    model.init_weights(0)
    model.init_buffers()
    g = torch.Generator().manual_seed(4)
    a, b = torch.randint(0, 258, (1, 20), generator=g), torch.randint(0, 258, (1, 44), generator=g)
    positions = torch.cat([torch.arange(20), torch.arange(44)])[None]
    with torch.no_grad():
        packed = model(torch.cat([a, b], dim=1), positions)
        torch.testing.assert_close(packed[:, :20], model(a), rtol=0, atol=1e-5)
        torch.testing.assert_close(packed[:, 20:], model(b), rtol=0, atol=1e-5)
