"""Qwen3.5 dense against transformers' ``Qwen3_5ForCausalLM`` and the released ``config.json``
(no Ray, no process): logits of a tiny random model through the public import path, both
``config.json`` forms (text and multimodal), import → train loop → export bit for bit, the 27B
flavor against its model card, and what the pre-flight refuses (tensor parallel, document masks)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from ray_titan.checkpoint import check_hf_checkpoint, export_hf
from ray_titan.models.decoder import count_parameters
from ray_titan.models.registry import build_model, get_model_args, get_spec
from tests.support.hf_models import load_ray_titan, make_hf_model, random_tokens, train_one_dropped_step
from tests.support.saved import logits_and_floor, saved_bytes

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``(directory, transformers model)`` of the tiny Qwen3.5 (tests/support/hf_models.py): 4
    layers, the third full attention, the others Gated DeltaNet."""
    path = tmp_path_factory.mktemp("qwen3_5")
    return path, make_hf_model("qwen3_5", path)


def test_logits_match_transformers(tiny):
    """300 tokens (five DeltaNet chunks), fp32, weights std 0.3: logits within 1e-4 of
    transformers' (its own eager-vs-SDPA difference on these weights is printed: about 2e-5).
    Negative controls on the same weights: rotating the whole head instead of its first quarter,
    or dropping the attention's output gate, changes the logits."""
    path, ref = tiny
    model, spec, args = load_ray_titan(path)
    assert (spec.name, args.full_attention_layers, args.rotary_dim) == ("qwen3_5", [2], 8)
    tokens = random_tokens()
    want, got, _ = logits_and_floor(ref, model, tokens)
    assert want.abs().max() > 3
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    whole = build_model(spec.name, "", args=dataclasses.replace(args, partial_rotary_factor=1.0))
    whole.load_state_dict(model.state_dict())
    whole.init_buffers()
    attention = model.layers["2"].attention
    with torch.no_grad():
        assert (whole(tokens) - want).abs().max() > 1e-2
        saved = attention.wq.weight.clone()
        gate_rows = attention.wq.weight.view(args.n_heads, 2, args.head_dim, -1)[:, 1]
        gate_rows.fill_(1e3)  # sigmoid(gate) = 1 for these inputs: no gating
        assert (model(tokens) - want).abs().max() > 1e-2
        attention.wq.weight.copy_(saved)


def _as_multimodal(src, dst):
    """The tiny text model rewritten as the released multimodal files hold Qwen3.5: config under
    ``text_config`` (model_type ``qwen3_5``), language-model tensors under ``model.language_model.``,
    plus a vision tensor and a multi-token-prediction tensor the import must skip."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text())
    text = {**config, "model_type": "qwen3_5_text"}
    text.pop("architectures")
    multimodal = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                  "text_config": text, "tie_word_embeddings": False,
                  "vision_config": {"depth": 2, "hidden_size": 32, "model_type": "qwen3_5_vision"}}
    (dst / "config.json").write_text(json.dumps(multimodal))
    text_tensors = load_file(src / "model.safetensors")
    tensors = {k.replace("model.", "model.language_model.", 1): v for k, v in text_tensors.items()}
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(96, 32)
    tensors["mtp.fc.weight"] = torch.zeros(64, 128)
    (dst / "model.safetensors").unlink()
    save_file(tensors, dst / "model.safetensors")


def test_multimodal_config_form_imports_the_same_model(tiny, tmp_path, capsys):
    """The released form (``qwen3_5``, a ``text_config``, ``model.language_model.*`` names, a
    vision tower and an MTP layer) imports to the same arguments (but for where the tensors are)
    and the same weights as the text form, bit for bit; the vision and MTP tensors are skipped,
    each with a printed line; transformers' ``Qwen3_5ForCausalLM`` reads it to the same logits."""
    src, ref = tiny
    _as_multimodal(src, tmp_path / "mm")
    text_model, spec, text_args = load_ray_titan(src)
    model, mm_spec, args = load_ray_titan(tmp_path / "mm")
    out = capsys.readouterr().out
    assert "model.visual.*" in out and "mtp.*" in out
    assert mm_spec is spec and args.hf_prefix == "model.language_model."
    assert spec.hf.differences(args, text_args) == []
    assert dataclasses.replace(args, hf_prefix="model.") == text_args
    for (k, a), (k2, b) in zip(model.state_dict().items(), text_model.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "mm", dtype=torch.float32).eval()
    tokens = random_tokens(64, seed=4)
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, ref(tokens).logits, rtol=0, atol=0)


def test_import_train_export_is_bitwise(tiny, tmp_path):
    """The tiny model imported by the train loop (in this process), saved by a run whose only
    update is dropped, exported: the same tensors bit for bit under the same names, a
    config.json transformers reads back to the same architecture and logits; the same from the
    multimodal form, exported as the text model (``qwen3_5_text``, ``model.*`` names)."""
    from safetensors.torch import load_file

    src, ref = tiny
    original = load_file(src / "model.safetensors")
    tokens = random_tokens(64, seed=2)
    _as_multimodal(src, tmp_path / "mm")
    for i, source in enumerate((src, tmp_path / "mm")):
        (tmp_path / f"run{i}").mkdir()
        cfg, run_dir = train_one_dropped_step(source, tmp_path / f"run{i}")
        assert cfg.model.name == "qwen3_5"
        out = tmp_path / f"export{i}"
        export_hf(run_dir, str(out), dtype="fp32")
        exported = {k: v for f in out.glob("model*.safetensors") for k, v in load_file(f).items()}
        assert exported.keys() == original.keys()
        for key, value in original.items():
            assert torch.equal(exported[key], value), key
        config = json.loads((out / "config.json").read_text())
        assert (config["model_type"], config["layer_types"][2]) == ("qwen3_5_text", "full_attention")
        spec, args = check_hf_checkpoint(str(out))
        assert spec.hf.differences(args, check_hf_checkpoint(str(src))[1]) == []
        back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            torch.testing.assert_close(back(tokens).logits, ref(tokens).logits, rtol=0, atol=0)


# The language model's fields of the released config.json (huggingface.co/Qwen/Qwen3.5-27B,
# its text_config; the multimodal form, as the hub holds it).
HUB_27B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text", "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
        "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "hidden_act": "silu",
        "attention_bias": False, "attention_dropout": 0.0, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 48, "max_position_embeddings": 262144, "rms_norm_eps": 1e-06,
        "vocab_size": 248320, "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                                                  "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                                                  "mrope_interleaved": True}},
    "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                      "model_type": "qwen3_5_vision"},
}


def test_27b_flavor_is_the_model_card():
    """The flavor is what the released config.json describes (``differences``: none), 48 of its
    64 layers Gated DeltaNet, and on the meta device it has the card's 27B (26.90 B for the
    language model: the files' 27.8 B add the vision tower and the MTP layer, not built)."""
    spec = get_spec("qwen3_5")
    args = get_model_args("qwen3_5", "27B")
    spec.hf.check_config(HUB_27B)
    assert spec.hf.differences(args, spec.hf.args_from_hf(HUB_27B)) == []
    assert len(args.full_attention_layers) == 16 and args.rotary_dim == 64
    with torch.device("meta"):
        n = count_parameters(build_model("qwen3_5", "27B"))
    assert round(n / 1e9) == 27, n


@pytest.mark.parametrize("override, setting", [("--parallelism.tp=2", r"parallelism\.tp = 2"),
                                               ("--training.document_mask=true", r"training\.document_mask = true")])
def test_preflight_refuses_what_deltanet_cannot_do(override, setting):
    """Tensor parallel (DeltaNet's fused q/k/v projection is not split by heads) and document
    masks (its state crosses documents) are refused before any worker starts, with the reason."""
    from ray_titan.config import load_config
    from ray_titan.config.schema import ConfigError
    from ray_titan.preflight.checks import validate_job

    workers = 2 if "tp" in override else 1
    cfg = load_config(None, ["--model.name=qwen3_5", "--model.flavor=debug", override, "--parallelism.dp_shard=1",
                             "--parallelism.pp=1", f"--ray.num_workers={workers}"])
    with pytest.raises(ConfigError, match=setting + r" is not supported for qwen3_5/debug: Gated DeltaNet"):
        validate_job(cfg, check_data=False)


def test_debug_flavor_trains_and_init_is_transformers_like():
    """The debug flavor initialised from a seed: zero-centred norms 0, ``dt_bias`` 1, ``A_log``
    in [0, log 16]; the same seed gives the same weights; one SGD step on a repeated batch lowers
    the loss (gradients reach every parameter)."""
    model = build_model("qwen3_5", "debug")
    model.init_weights(0)
    again = build_model("qwen3_5", "debug")
    again.init_weights(0)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    block = model.layers["0"]
    assert torch.equal(block.attention_norm.weight, torch.zeros(128))
    assert torch.equal(block.linear_attn.dt_bias, torch.ones(4))
    assert torch.equal(block.linear_attn.norm.weight, torch.ones(32))
    assert 0 <= block.linear_attn.A_log.min() and block.linear_attn.A_log.max() <= torch.log(torch.tensor(16.0))
    x = torch.randint(0, 258, (2, 80), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(2):
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None and p.grad.abs().max() > 0 for p in model.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[1] < losses[0]


@pytest.mark.parametrize("layer, dtype, seq", [(0, torch.float32, 100), (0, torch.bfloat16, 128),
                                               (3, torch.float32, 128), (3, torch.bfloat16, 100)])
def test_block_activation_formula_is_what_autograd_saves(layer, dtype, seq):
    """The memory plan's block formula (``costs.py``) within 1 % of the bytes autograd saves in
    one block's forward: a Gated DeltaNet layer (0: the chunk matrices, the convolution's padded
    input, the gated norm; 100 tokens pad to two chunks) and the full-attention layer (3), in
    fp32 and in bf16 (whose upcasts copy)."""
    from ray_titan.models.qwen3_5.costs import qwen3_5_block_activations

    model = build_model("qwen3_5", "debug")
    model.init_weights(0)
    b = 2
    block = model.layers[str(layer)].to(dtype)
    x = torch.randn(b, seq, model.args.dim, requires_grad=True, dtype=dtype)
    cos, sin = model.rope_cos[:seq], model.rope_sin[:seq]
    saved = saved_bytes(block, x, cos, sin)
    planned = qwen3_5_block_activations(model.args, layer, dtype.itemsize, seq, "cpu", 1.0, 1).none * b * seq
    print(f"layer {layer} {dtype}: planned {planned:.0f} bytes, autograd saves {saved}")
    assert planned == pytest.approx(saved, rel=0.01)


@pytest.mark.parametrize("mode, option", [("full", "op"), ("selective", "op"), ("selective", "layer")])
def test_activation_checkpointing_gives_the_plain_gradients(mode, option):
    """Full and selective (op, layer) activation checkpointing recompute DeltaNet's chunk loop
    and the gated attention in backward: the same loss and every parameter's gradient as without
    it (fp32, to rounding)."""
    from ray_titan.parallel.ac import apply_ac

    base = build_model("qwen3_5", "debug")
    base.init_weights(0)
    x = torch.randint(0, 258, (2, 100), generator=torch.Generator().manual_seed(1))
    runs = []
    for ac in (False, True):
        model = build_model("qwen3_5", "debug")
        model.load_state_dict(base.state_dict())
        model.init_buffers()
        if ac:
            apply_ac(model, mode, option, 2)
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss, grads), (loss_ac, grads_ac) = runs
    torch.testing.assert_close(loss_ac, loss, rtol=0, atol=1e-6)
    assert [n.replace("_checkpoint_wrapped_module.", "") for n in grads_ac] == list(grads)
    for (name, g), g_ac in zip(grads.items(), grads_ac.values()):
        torch.testing.assert_close(g_ac, g, rtol=1e-5, atol=1e-7, msg=name)
