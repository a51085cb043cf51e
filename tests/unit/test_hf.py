"""Model fidelity against transformers, Hugging Face import checks and the flavors (no Ray).

Every family: a tiny random model made with transformers and the same weights loaded into
ray_titan give the same logits (fp32, CPU, 128 tokens, 1e-4) and, for DeepSeek, the same
experts for every token; a wrong q/k layout fails. Bad Hugging Face directories are refused
before any worker starts, naming the file and the problem.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import resource
import shutil
import signal
import struct
import time
import tracemalloc

import pytest
import torch

from ray_titan.checkpoint import HFCheckpointError, check_hf_checkpoint, load_hf_weights, resolve_hf_job
from ray_titan.config import ConfigError, load_config
from ray_titan.models import registry
from ray_titan.models.decoder import count_parameters
from ray_titan.models.registry import build_model, get_model_args
from ray_titan.models.rope import inv_frequencies, softmax_scale_factor
from ray_titan.preflight.checks import validate_job
from tests.support.hf_models import SEQ, VOCAB, corpus_lines, make_hf_model, write_tokenizer

transformers = pytest.importorskip("transformers")

FAMILIES = ("llama", "qwen3", "deepseek_v2")


@pytest.fixture(scope="module")
def hf_dirs(hf_models):
    """family -> (directory, transformers model): the session's tiny models."""
    root, models = hf_models
    return {f: (root / f, models[f]) for f in FAMILIES}


def _load(path, sources=None):
    spec, args = check_hf_checkpoint(str(path))
    model = build_model(spec.name, "", args=args)
    model.init_buffers()
    load_hf_weights(model, str(path), spec, args, sources)
    return model.eval(), spec, args


def _routes(module_cls, model):
    """Forward hooks that record each router call's top-k expert ids, sorted per token."""
    seen: list[torch.Tensor] = []

    def hook(mod, inputs, out):
        indices = out[2] if module_cls.__name__.endswith("TopkRouter") else out[1]
        seen.append(indices.sort(dim=-1).values)

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, module_cls)]
    return seen, handles


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(hf_dirs, family):
    path, ref = hf_dirs[family]
    model, spec, args = _load(path)
    assert spec.name == family
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    routes = {}
    if family == "deepseek_v2":
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

        from ray_titan.models.deepseek_v2.model import Router

        routes["hf"], h1 = _routes(DeepseekV2TopkRouter, ref)
        routes["rt"], h2 = _routes(Router, model)
    with torch.no_grad():
        want, got = ref(tokens).logits, model(tokens)
    assert want.abs().max() > 3  # large enough weights that a layout or scaling error shows
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    if routes:
        for h in h1 + h2:
            h.remove()
        assert len(routes["hf"]) == len(routes["rt"]) == 2  # the two MoE layers
        for a, b in zip(routes["hf"], routes["rt"]):
            assert torch.equal(a, b)  # the same experts for every token
    if args.rope_scaling is not None:  # the scaling is exercised: without it the logits differ
        plain = build_model(spec.name, "", args=dataclasses.replace(args, rope_scaling=None))
        plain.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert (plain(tokens) - want).abs().max() > 1e-2


def test_group_limited_routing_matches_transformers(tmp_path):
    """DeepSeek-V2's group_limited_greedy (16 experts in 4 groups, a token keeps 2, top-3): the
    same logits (300 tokens, fp32, 1e-4) and the same experts for every token as transformers;
    plain greedy routing of the same weights chooses other experts (the groups matter here)."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    from ray_titan.models.deepseek_v2.model import Router

    ref = make_hf_model("deepseek_v2", tmp_path, topk_method="group_limited_greedy", n_routed_experts=16,
                        num_experts_per_tok=3, n_group=4, topk_group=2)
    model, spec, args = _load(tmp_path)
    assert (args.topk_method, args.n_group, args.topk_group, args.n_routed_experts) == (
        "group_limited_greedy", 4, 2, 16)
    tokens = torch.randint(0, VOCAB, (1, 300), generator=torch.Generator().manual_seed(7))
    hf_routes, h1 = _routes(DeepseekV2TopkRouter, ref)
    rt_routes, h2 = _routes(Router, model)
    with torch.no_grad():
        want, got = ref(tokens).logits, model(tokens)
    for h in h1 + h2:
        h.remove()
    assert want.abs().max() > 3
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert len(hf_routes) == len(rt_routes) == 2
    for a, b in zip(hf_routes, rt_routes):
        assert torch.equal(a, b)  # the same experts for every token
    greedy = build_model(spec.name, "", args=dataclasses.replace(args, topk_method="greedy"))
    greedy.load_state_dict(model.state_dict())
    greedy_routes, h3 = _routes(Router, greedy)
    with torch.no_grad():
        greedy(tokens)
    h3[0].remove(), h3[1].remove()
    assert not torch.equal(greedy_routes[0], rt_routes[0])


def test_wrong_rotary_layout_fails(hf_dirs):
    """Negative control: the q/k rows loaded without the rotate_half -> interleaved permutation."""
    path, ref = hf_dirs["llama"]
    spec, args = check_hf_checkpoint(str(path))
    identity = {k: dataclasses.replace(s, rows=None) for k, s in spec.hf.sources(args).items()}
    model, _, _ = _load(path, identity)
    tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert (model(tokens) - ref(tokens).logits).abs().max() > 0.1


def test_bf16_files_load_into_fp32(tmp_path):
    ref = make_hf_model("llama", tmp_path / "bf16", dtype=torch.bfloat16)
    model, _, _ = _load(tmp_path / "bf16")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    want = ref.model.layers[1].mlp.down_proj.weight.to(torch.bfloat16).float()
    assert torch.equal(model.layers["1"].feed_forward.w2.weight, want)


def test_router_scales_only_when_not_normalising():
    """DeepSeek's MoEGate: top-k weights renormalised (norm_topk_prob) or times the routed
    scaling factor, never both."""
    from ray_titan.models.deepseek_v2.model import Router

    base = get_model_args("deepseek_v2", "debug")
    x = torch.randn(16, base.dim)
    out = {}
    for norm in (False, True):
        router = Router(dataclasses.replace(base, norm_topk_prob=norm, route_scale=2.5))
        torch.nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(0))
        out[norm] = router(x)
    weights, indices, scores = out[False]
    torch.testing.assert_close(weights, 2.5 * scores.gather(-1, indices))
    torch.testing.assert_close(out[True][0].sum(-1), torch.ones(16))


# -- flavors against the model cards (meta device) -------------------------------------------------

@pytest.mark.parametrize("family, flavor, billions, dims", [
    # (dim, n_layers, n_heads, n_kv_heads, ffn hidden, head_dim, tied, rope scaling factor)
    ("llama", "3-8B", 8.03, (4096, 32, 32, 8, 14336, 128, False, None)),
    ("llama", "3.1-8B", 8.03, (4096, 32, 32, 8, 14336, 128, False, 8.0)),
    ("llama", "3.1-70B", 70.55, (8192, 80, 64, 8, 28672, 128, False, 8.0)),
    ("llama", "3.2-1B", 1.24, (2048, 16, 32, 8, 8192, 64, True, 32.0)),
    ("llama", "3.2-3B", 3.21, (3072, 28, 24, 8, 8192, 128, True, 32.0)),
    ("qwen3", "0.6B", 0.60, (1024, 28, 16, 8, 3072, 128, True, None)),
    ("qwen3", "1.7B", 1.72, (2048, 28, 16, 8, 6144, 128, True, None)),
    ("qwen3", "4B", 4.02, (2560, 36, 32, 8, 9728, 128, True, None)),
    ("qwen3", "8B", 8.19, (4096, 36, 32, 8, 12288, 128, False, None)),
])
def test_flavors_match_the_model_cards(family, flavor, billions, dims):
    a = get_model_args(family, flavor)
    with torch.device("meta"):
        model = build_model(family, flavor)
    assert round(count_parameters(model) / 1e9, 2) == billions
    factor = a.rope_scaling.factor if a.rope_scaling else None
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.ffn_hidden_dim, a.head_dim, a.tie_word_embeddings,
            factor) == dims
    if family == "qwen3":
        assert (a.qk_norm, a.rope_theta, a.vocab_size) == (True, 1e6, 151_936)


def test_qwen3_non_embedding_counts_match_the_model_cards():
    cards = {"0.6B": 0.44, "1.7B": 1.4, "4B": 3.6, "8B": 6.95}  # "Number of Parameters (Non-Embedding)"
    for flavor, want in cards.items():
        a = get_model_args("qwen3", flavor)
        with torch.device("meta"):
            n = count_parameters(build_model("qwen3", flavor))
        emb = a.vocab_size * a.dim * (1 if a.tie_word_embeddings else 2)
        assert round((n - emb) / 1e9, len(str(want).split(".")[1])) == want, flavor


# The architecture fields of the released config.json files (huggingface.co/<repo>/blob/main/config.json).
HUB_CONFIGS = {
    ("llama", "3.2-1B"): {
        "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
    ("qwen3", "0.6B"): {
        "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000, "rope_scaling": None,
        "hidden_act": "silu", "attention_bias": False, "use_sliding_window": False, "tie_word_embeddings": True},
    ("deepseek_v2", "V2-Lite"): {
        "model_type": "deepseek_v2", "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "num_hidden_layers": 27, "first_k_dense_replace": 1, "num_attention_heads": 16, "num_key_value_heads": 16,
        "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "routed_scaling_factor": 1.0,
        "norm_topk_prob": False, "topk_method": "greedy", "scoring_func": "softmax", "moe_layer_freq": 1,
        "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "vocab_size": 102400, "max_position_embeddings": 163840, "rms_norm_eps": 1e-06,
        "rope_theta": 10000, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                         "original_max_position_embeddings": 4096, "type": "yarn"}},
    ("deepseek_v2", "V2"): {
        "model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 5120,
        "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 60,
        "first_k_dense_replace": 1, "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 160,
        "n_shared_experts": 2, "num_experts_per_tok": 6, "n_group": 8, "topk_group": 3,
        "topk_method": "group_limited_greedy", "routed_scaling_factor": 16.0, "norm_topk_prob": False,
        "scoring_func": "softmax", "seq_aux": True, "aux_loss_alpha": 0.001, "moe_layer_freq": 1,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "vocab_size": 102400, "max_position_embeddings": 163840, "rms_norm_eps": 1e-06,
        "rope_theta": 10000, "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": False, "bos_token_id": 100000, "eos_token_id": 100001, "torch_dtype": "bfloat16",
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                         "original_max_position_embeddings": 4096, "type": "yarn"}},
}


@pytest.mark.parametrize("family, flavor", list(HUB_CONFIGS))
def test_flavor_is_what_the_released_config_json_describes(family, flavor):
    from ray_titan.models.registry import get_spec

    adapter = get_spec(family).hf
    adapter.check_config(HUB_CONFIGS[family, flavor])  # every number of a released file is in range
    assert adapter.differences(get_model_args(family, flavor), adapter.args_from_hf(HUB_CONFIGS[family, flavor])) == []


def test_v2_config_json_imports_with_the_model_card_sizes():
    """DeepSeek-V2's config.json (group_limited_greedy: 160 experts in 8 groups, 3 kept, top-6)
    imports onto the meta device with the model card's 236 B total and 21 B activated parameters."""
    from ray_titan.models.deepseek_v2 import activated_parameters
    from ray_titan.models.registry import get_spec

    args = get_spec("deepseek_v2").hf.args_from_hf(HUB_CONFIGS["deepseek_v2", "V2"])
    assert (args.topk_method, args.n_group, args.topk_group, args.route_scale) == ("group_limited_greedy", 8, 3, 16.0)
    with torch.device("meta"):
        model = build_model("deepseek_v2", "", args=args)
    # The card rounds: 235.7 B and 20.9 B counted.
    assert count_parameters(model) == pytest.approx(236e9, rel=0.005)
    assert activated_parameters(model) == pytest.approx(21e9, rel=0.01)


def test_v2_lite_is_the_released_v2_lite():
    """YaRN at every length: 21 of 32 rotary frequencies differ, the softmax scale is x1.59."""
    a = get_model_args("deepseek_v2", "V2-Lite")
    plain, _ = inv_frequencies(a.qk_rope_head_dim, a.rope_theta, None)
    yarn, cos_factor = inv_frequencies(a.qk_rope_head_dim, a.rope_theta, a.rope_scaling)
    assert int((~torch.isclose(plain, yarn)).sum()) == 21 and cos_factor == 1.0
    assert softmax_scale_factor(a.rope_scaling) == pytest.approx(1.5896, abs=1e-4)
    # The same tables as transformers' own YaRN for V2-Lite's config.json.
    from transformers import DeepseekV2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = DeepseekV2Config(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
        max_position_embeddings=163840, qk_rope_head_dim=64)
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    torch.testing.assert_close(yarn, want, rtol=0, atol=0)
    assert factor == cos_factor


# -- bad input, refused before any worker starts ---------------------------------------------------

@pytest.fixture
def llama_copy(hf_dirs, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(hf_dirs["llama"][0], dst)
    return dst


def _job(tmp_path, src, *overrides):
    data = tmp_path / "data.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus_lines(20)))
    cfg = load_config(None, [f"--checkpoint.initial_load_hf={src}", "--parallelism.pp=1", "--parallelism.dp_shard=1",
                             "--data.source=jsonl", f"--data.path={data}", "--training.seq_len=64", *overrides])
    return resolve_hf_job(cfg)


def _rewrite(path, change):
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("damage, message", [
    ("no_config", r"config\.json does not exist"),
    ("bad_json", r"config\.json is not valid JSON"),
    ("model_type", r"model_type 'gpt2' is not supported; supported: \['deepseek_v2', 'deepseek_v3', 'glm4_moe', "
                   r"'gpt_oss', 'kimi_k2', 'llama', 'minimax_m2', 'qwen3'"),
    ("rope_type", r"rope_scaling\.rope_type = 'longrope' is not supported"),
    ("missing", r"model\.safetensors: missing tensor\(s\) model\.layers\.1\.mlp\.up_proj\.weight"),
    ("shape", r"model\.safetensors: tensor model\.norm\.weight has shape \[63\], config\.json implies \[64\]"),
    ("unexpected", r"model\.safetensors: unexpected tensor\(s\) model\.layers\.9\.mlp\.up_proj\.weight"),
    ("no_weights", r"has neither model\.safetensors\.index\.json nor model\.safetensors"),
])
def test_bad_hf_directory_is_refused(llama_copy, tmp_path, damage, message):
    config = llama_copy / "config.json"
    if damage == "no_config":
        config.unlink()
    elif damage == "bad_json":
        config.write_text("{not json")
    elif damage in ("model_type", "rope_type"):
        c = json.loads(config.read_text())
        if damage == "model_type":
            c["model_type"] = "gpt2"
        else:
            c.pop("rope_parameters", None)
            c["rope_scaling"] = {"rope_type": "longrope", "factor": 2.0}
        config.write_text(json.dumps(c))
    elif damage == "missing":
        _rewrite(llama_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    elif damage == "shape":
        _rewrite(llama_copy, lambda t: t.update({"model.norm.weight": torch.ones(63)}))
    elif damage == "unexpected":
        _rewrite(llama_copy, lambda t: t.update({"model.layers.9.mlp.up_proj.weight": torch.ones(2)}))
    else:
        (llama_copy / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=rf"checkpoint\.initial_load_hf = '{llama_copy}': .*{message}"):
        validate_job(_job(tmp_path, llama_copy))


@contextlib.contextmanager
def _deadline(seconds):
    """Raise TimeoutError in the test after ``seconds``: without the bounds, a config.json size
    of 1e9 builds Python lists for minutes (and GBs) instead of failing."""
    def stop(*_):
        raise TimeoutError(f"no refusal within {seconds} s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _refused_fast(call, match):
    """``call()`` raises HFCheckpointError matching ``match`` within a second and a few MB."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with _deadline(10), pytest.raises(HFCheckpointError, match=match):
            call()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 2.0 and peak < 10 * 2**20


@pytest.mark.parametrize("family, change, message", [
    # the probes: the rotary permutation of 1e9 rows; 1e8 layers built on meta
    ("llama", {"hidden_size": 1e9, "head_dim": None}, r"hidden_size = 1000000000\.0 is not valid; valid: an "
                                                      r"integer from 1 to 65536"),
    ("llama", {"num_hidden_layers": 1e8}, r"num_hidden_layers = 100000000\.0 is not valid; valid: an integer from 1 "
                                          r"to 256"),
    ("llama", {"num_hidden_layers": 200}, r"num_hidden_layers = 200 but .*model\.safetensors holds 2 layers "
                                           r"\(model\.layers\.N\); valid: at most 2"),
    ("llama", {"vocab_size": 10**6}, r"vocab_size = 1000000 but .*model\.safetensors holds 320 rows of "
                                     r"model\.embed_tokens\.weight; valid: at most 320"),
    ("llama", {"num_attention_heads": True}, r"num_attention_heads = True is not valid"),
    ("llama", {"intermediate_size": 96.5}, r"intermediate_size = 96\.5 is not valid"),
    ("llama", {"max_position_embeddings": "512"}, r"max_position_embeddings = '512' is not valid"),
    ("llama", {"num_key_value_heads": 0}, r"num_key_value_heads = 0 is not valid; valid: an integer from 1"),
    ("llama", {"num_key_value_heads": 3}, r"num_attention_heads = 4 is not a multiple of num_key_value_heads = 3"),
    ("llama", {"hidden_size": 66, "head_dim": None}, r"hidden_size = 66 is not divisible by num_attention_heads = 4"),
    ("llama", {"num_attention_heads": 1024, "num_key_value_heads": 1, "head_dim": 1024},
     r"num_attention_heads × head_dim = 1024 × 1024 exceeds 65536"),
    ("qwen3", {"head_dim": 10**9}, r"head_dim = 1000000000 is not valid; valid: an integer from 2 to 1024"),
    ("qwen3", {"head_dim": 31}, r"the head size is 31 .*valid: an even size"),
    ("deepseek_v2", {"n_routed_experts": 1e9}, r"n_routed_experts = 1000000000\.0 is not valid"),
    ("deepseek_v2", {"n_routed_experts": 4000}, r"n_routed_experts = 4000 but .*model\.safetensors holds 8 routed "
                                                r"experts"),
    ("deepseek_v2", {"num_experts_per_tok": 9}, r"num_experts_per_tok = 9 exceeds n_routed_experts = 8"),
    ("deepseek_v2", {"first_k_dense_replace": 4}, r"first_k_dense_replace = 4 exceeds num_hidden_layers = 3"),
    ("deepseek_v2", {"kv_lora_rank": -16}, r"kv_lora_rank = -16 is not valid"),
    ("deepseek_v2", {"qk_rope_head_dim": 7}, r"qk_rope_head_dim = 7 is odd"),
    ("deepseek_v2", {"rope_parameters.original_max_position_embeddings": 1e12},
     r"rope_parameters\.original_max_position_embeddings = 1000000000000\.0 is not valid"),
    # floats that size nothing but would poison every step (FLOAT_FIELDS): finite, positive
    ("llama", {"rope_parameters.rope_theta": float("nan")}, r"rope_parameters\.rope_theta = nan is not valid; "
                                                           r"valid: a finite number > 0"),
    ("llama", {"rope_parameters.rope_theta": 0}, r"rope_parameters\.rope_theta = 0 is not valid"),
    ("llama", {"rope_parameters.factor": float("inf")}, r"rope_parameters\.factor = inf is not valid"),
    ("llama", {"rope_parameters.factor": -8.0}, r"rope_parameters\.factor = -8\.0 is not valid"),
    ("llama", {"rope_parameters.high_freq_factor": 1.0}, r"rope_parameters\.high_freq_factor = 1 is not above "
                                                        r"low_freq_factor = 1"),
    ("llama", {"rms_norm_eps": 0.0}, r"rms_norm_eps = 0\.0 is not valid; valid: a finite number > 0 and at most 1"),
    ("llama", {"rms_norm_eps": "1e-6"}, r"rms_norm_eps = '1e-6' is not valid"),
    ("qwen3", {"rms_norm_eps": float("-inf")}, r"rms_norm_eps = -inf is not valid"),
    ("deepseek_v2", {"routed_scaling_factor": -1.5}, r"routed_scaling_factor = -1\.5 is not valid"),
    # routing: a method of the table; group sizes that split the experts and hold the top-k
    ("deepseek_v2", {"topk_method": "noaux_tc"}, r"topk_method = 'noaux_tc' is not supported for deepseek_v2; valid: "
                                                r"\['greedy', 'group_limited_greedy'\]"),
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": None},
     r"config\.json has no 'n_group'"),
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 1e9, "topk_group": 1},
     r"n_group = 1000000000\.0 is not valid; valid: an integer from 1 to 4096"),
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 1},
     r"n_routed_experts = 8 is not divisible by n_group = 3"),
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 5},
     r"topk_group = 5 is not within 1 and n_group = 4; valid: 1 to 4"),
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 1},
     r"num_experts_per_tok = 2 exceeds the 1 experts of the topk_group = 1 kept groups \(1 each\); "
     r"valid: at most 1"),
    ("deepseek_v2", {"rope_parameters.beta_fast": 0}, r"rope_parameters\.beta_fast = 0 is not valid"),
    ("deepseek_v2", {"rope_parameters.beta_slow": float("nan")}, r"rope_parameters\.beta_slow = nan is not valid"),
    ("deepseek_v2", {"rope_parameters.mscale": -0.707}, r"rope_parameters\.mscale = -0\.707 is not valid; "
                                                       r"valid: a finite number >= 0"),
])
def test_config_json_sizes_are_bounded(hf_dirs, tmp_path, family, change, message):
    """Every size field of config.json is an integer within SIZE_FIELDS and, for the layers,
    experts and embedding, within what the safetensors headers hold: refused at once, naming
    the file, the field and the value, before anything is sized by it."""
    path = tmp_path / family
    shutil.copytree(hf_dirs[family][0], path)
    config = json.loads((path / "config.json").read_text())
    for key, value in change.items():
        *outer, field = key.split(".")
        target = config[outer[0]] if outer else config
        if value is None:
            target.pop(field, None)
        else:
            target[field] = value
    (path / "config.json").write_text(json.dumps(config))
    _refused_fast(lambda: check_hf_checkpoint(str(path)), rf"{path}/config\.json: .*{message}")


ALL_FAMILIES = registry.FAMILIES

def _nested(depth):
    return {"a": _nested(depth - 1)} if depth else {}


# Each change of a valid config.json, the message that refuses it. The first two are fields no
# family reads (a top-level rope_theta that rope_parameters' own shadows; an unused dropout).
_BAD_NUMBERS = [
    ({"rope_theta": -1}, r"config\.json rope_theta = -1 is not valid; valid: a finite number > 0"),
    ({"attention_dropout": 1.0}, r"attention_dropout = 1\.0 is not valid; valid: a finite number >= 0 and below 1"),
    ({"initializer_range": -0.02}, r"initializer_range = -0\.02 is not valid; valid: a finite number >= 0"),
    ({"router_aux_loss_coef": float("nan")}, r"router_aux_loss_coef = nan is not valid"),
    ({"eos_token_id": [0, float("inf")]}, r"eos_token_id = inf is not valid; valid: a finite number"),
    ({"tie_word_embeddings": "false"}, r"tie_word_embeddings = 'false' is not valid; valid: true or false"),
    ({"extra": _nested(40)}, r"config\.json extra(\.a)+ nests objects more than 16 deep"),
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
     r"quantization_config\.quant_method = 'bitsandbytes' is not supported for [a-z0-9_]+; valid: .*no "
     r"quantization_config"),
]


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_every_number_of_config_json_is_range_checked_in_every_family(hf_models, tmp_path, family):
    """One check for every family (``StateDictAdapter.check_config``): every number of config.json,
    read by the family or not, within its field's range (finite when it has none), booleans
    booleans, and no quantisation the family does not dequantise: each refused naming the file,
    the field, its value and the valid range."""
    root, _ = hf_models
    shutil.copytree(root / family, tmp_path / family)
    path = tmp_path / family
    config = json.loads((path / "config.json").read_text())
    for change, message in _BAD_NUMBERS:
        (path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(HFCheckpointError, match=rf"{path}/config\.json: .*{message}"):
            check_hf_checkpoint(str(path))


def test_every_numeric_field_of_the_families_configs_has_a_range(hf_models):
    """The class, not the cases: each numeric field transformers writes in every family's
    config.json (every field of its config classes, defaults included) has a range in the tables
    (SIZE_FIELDS, FLOAT_FIELDS, ``*dropout``), except the token ids (ids of the tokenizer, not
    sizes; an old Llama's pad_token_id is -1). A new numeric field fails here until it has one."""
    from ray_titan.models.state_dict_adapter import FLOAT_FIELDS, SIZE_FIELDS

    root, _ = hf_models
    unranged = set()

    def walk(node, key=""):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, k)
        elif isinstance(node, list):
            for v in node:
                walk(v, key)
        elif isinstance(node, (int, float)) and not isinstance(node, bool):
            if key not in SIZE_FIELDS and key not in FLOAT_FIELDS and not key.endswith("dropout"):
                unranged.add(key)

    for family in ALL_FAMILIES:
        walk(json.loads((root / family / "config.json").read_text()))
    assert unranged == {"bos_token_id", "eos_token_id"}


def test_huge_config_json_is_refused_before_it_is_read(llama_copy, tmp_path):
    """A config.json is kilobytes: one above MAX_CONFIG_BYTES (here valid JSON padded with
    spaces; a sparse multi-GB file alike) is refused from its size, naming the file."""
    from ray_titan.storage import MAX_CONFIG_BYTES

    config = llama_copy / "config.json"
    text = config.read_text()
    config.write_text(text + " " * (MAX_CONFIG_BYTES + 1 - len(text.encode())))
    _refused_fast(lambda: check_hf_checkpoint(str(llama_copy)),
                  rf"{config} has {MAX_CONFIG_BYTES + 1} bytes; valid: at most {MAX_CONFIG_BYTES} \(MAX_CONFIG_BYTES")


@pytest.mark.parametrize("name, why", [("../outside.safetensors", "a path with '..'"),
                                       ("/etc/passwd", "an absolute path")])
def test_index_file_names_outside_the_model_directory_are_refused_before_they_are_opened(
        llama_copy, tmp_path, monkeypatch, name, why):
    """model.safetensors.index.json's weight_map names files relative to the model directory:
    an absolute path or '..' is refused (the checkpoint manifest's rule), naming the index and
    the entry, before any weights file is opened."""
    import ray_titan.checkpoint.hf_safetensors as hf

    shutil.copy(llama_copy / "model.safetensors", tmp_path / "outside.safetensors")
    index = llama_copy / "model.safetensors.index.json"
    from safetensors import safe_open

    with safe_open(llama_copy / "model.safetensors", "pt") as f:
        keys = list(f.keys())
    weight_map = dict.fromkeys(keys, "model.safetensors") | {keys[-1]: name}
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    opened = []
    monkeypatch.setattr(hf.SafetensorsFiles, "_read_header", lambda self, n: opened.append(n))
    with pytest.raises(HFCheckpointError, match=rf"{index}: weight_map places {keys[-1]} in '{name}', {why}; valid: "
                                                rf"a file name relative to {llama_copy}"):
        check_hf_checkpoint(str(llama_copy))
    assert opened == []


def test_huge_hidden_size_is_a_config_error_at_once(llama_copy, tmp_path):
    """The probe's path: checkpoint.initial_load_hf to a config.json with hidden_size = 1e9 and
    no head_dim (6 GB of RSS in 19 s before the bounds) is a ConfigError when the job loads."""
    config = json.loads((llama_copy / "config.json").read_text())
    config.pop("head_dim", None)
    (llama_copy / "config.json").write_text(json.dumps({**config, "hidden_size": 1e9}))
    t0 = time.perf_counter()
    with _deadline(10), pytest.raises(ConfigError, match=rf"checkpoint\.initial_load_hf = '{llama_copy}': "
                                                        rf"{llama_copy}/config\.json: .*hidden_size = 1000000000\.0"):
        _job(tmp_path, llama_copy)
    assert time.perf_counter() - t0 < 2.0


@pytest.mark.parametrize("name", ["model.safetensors", "model.safetensors.index.json"])
def test_oversized_safetensors_header_is_not_read(llama_copy, name):
    """A sparse 1 GiB file whose header length claims all of it (before the cap: read whole,
    then a JSONDecodeError) and an index of 1 GiB are refused from their size, naming the file."""
    big = llama_copy / name
    with open(big, "wb") as f:
        f.write(struct.pack("<Q", 2**30 - 8))
        f.truncate(2**30)
    match = (rf"{big} is not a readable safetensors file: ValueError: header length 1073741816 exceeds "
             r"100000000 bytes" if name == "model.safetensors" else
             rf"{big} is unreadable: ValueError: 1073741824 bytes; valid: at most 100000000")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    with _deadline(10), pytest.raises(HFCheckpointError, match=match):
        check_hf_checkpoint(str(llama_copy))
    assert time.perf_counter() - t0 < 2.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50 * 1024  # KiB


def test_tokenizer_that_does_not_fit_is_refused(llama_copy, tmp_path):
    big = write_tokenizer(tmp_path / "big_tokenizer", vocab_size=VOCAB + 40)
    with pytest.raises(ConfigError, match=rf"data.tokenizer_path = '{big}': its vocabulary \(360 tokens\) does not "
                                          r"fit the model's embedding \(320 rows"):
        validate_job(_job(tmp_path, llama_copy, "--data.tokenizer=huggingface", f"--data.tokenizer_path={big}"))


def test_family_and_flavor_come_from_config_json(llama_copy, tmp_path):
    cfg = _job(tmp_path, llama_copy)
    assert (cfg.model.name, cfg.model.flavor, cfg.data.tokenizer) == ("llama", "hf", "huggingface")
    assert cfg.data.tokenizer_path == f"{llama_copy}/tokenizer.json"
    validate_job(cfg)  # the good directory passes
    with pytest.raises(ConfigError, match=r"model\.flavor = 'debug' disagrees with .*config\.json: dim is 128 in "
                                          r"the flavor, 64 in config\.json"):
        _job(tmp_path, llama_copy, "--model.flavor=debug")
    with pytest.raises(ConfigError, match=r"model\.name = 'qwen3' but .*config\.json has model_type 'llama'"):
        _job(tmp_path, llama_copy, "--model.name=qwen3")


def test_a_jobs_memory_plan_is_of_the_checkpoints_model(hf_dirs, llama_copy, tmp_path):
    """Flavor ``hf`` (sizes from config.json) is planned, not refused: its parameters are the
    checkpoint's, counted on the model transformers made (one rank: fp32 parameters, bytes)."""
    from ray_titan.preflight.memory_plan import memory_plan

    plan = memory_plan(_job(tmp_path, llama_copy), device="cpu", levers=False)
    hf_elements = sum(p.numel() for p in hf_dirs["llama"][1].parameters())
    assert plan.job["flavor"] == "hf"
    assert [r.parameters for r in plan.ranks] == [4 * hf_elements]


def test_sharded_index_is_read(hf_dirs, tmp_path):
    """A checkpoint in several files with model.safetensors.index.json (as the hub's large models)."""
    path, ref = hf_dirs["deepseek_v2"]
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="60KB")
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 2
    model, _, _ = _load(f"file://{tmp_path / 'sharded'}")  # a URI goes through pyarrow's filesystems
    want, _, _ = _load(path)
    for (n, a), (_, b) in zip(model.state_dict().items(), want.state_dict().items()):
        assert torch.equal(a, b), n


def test_export_of_a_missing_checkpoint_is_a_clear_error(tmp_path, capsys):
    from ray_titan.cli import main

    assert main(["export", str(tmp_path / "nope"), "--to", "hf", str(tmp_path / "out")]) == 2
    assert f"ray-titan export: CHECKPOINT_OR_RUN_DIR = '{tmp_path / 'nope'}' does not exist" in capsys.readouterr().err
