"""Multi-token prediction (no Ray, no process): the depths' labels against a loop over the
tokens, the loss against a hand-written forward of the same weights, one MTP depth of each family
that builds them (DeepSeek-V3, GLM-4.5, Qwen3.5 dense and MoE) against transformers' ``MtpLayer``
around the family's decoder layer on a checkpoint's tensors, the import and export of the depths,
and the pre-flight's refusals."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from ray_titan.data.loader import IGNORE_INDEX
from ray_titan.models.decoder import MtpDepth, document_causal_mask
from ray_titan.models.registry import build_model
from ray_titan.trainer.build import cross_entropy_loss
from ray_titan.trainer.mtp import MtpLoss, mtp_labels
from tests.support.hf_models import VOCAB, load_ray_titan, make_hf_model

transformers = pytest.importorskip("transformers")


def _packed(batch: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(inputs, labels, positions)`` of ``batch`` rows with documents of random lengths."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 258, (batch, seq + 1), generator=g)
    positions = torch.zeros(batch, seq, dtype=torch.int64)
    for b in range(batch):
        p = 0
        for i in range(seq):
            if i and torch.rand((), generator=g) < 0.15:
                p = 0
            positions[b, i] = p
            p += 1
    return tokens[:, :-1], tokens[:, 1:], positions


def test_depth_labels_never_cross_a_document_or_the_sequence_end():
    """Depth k's label at i is labels[i + k] when i and i + k are in one document (the same loop
    written over the tokens), IGNORE_INDEX otherwise; a label the main loss ignores stays
    ignored; without positions only the sequence's end is cut."""
    _, labels, positions = _packed(3, 40, seed=1)
    labels[0, 7] = IGNORE_INDEX  # a loss mask reaches every depth that reads it
    got = mtp_labels(labels, positions, 3)
    assert got.shape == (3, 40, 4) and torch.equal(got[..., 0], labels)
    for b in range(3):
        for i in range(40):
            for k in range(1, 4):
                same = i + k < 40 and all(positions[b, j] != 0 for j in range(i + 1, i + k + 1))
                want = labels[b, i + k] if same else IGNORE_INDEX
                assert got[b, i, k] == want, (b, i, k)
    assert (got[..., 1:] == IGNORE_INDEX).sum() > 3 * (1 + 2 + 3) + 20  # documents cut, not only the end
    plain = mtp_labels(labels, None, 2)
    assert torch.equal(plain[:, :-2, 2], labels[:, 2:]) and (plain[:, -2:, 2] == IGNORE_INDEX).all()


def _reference_loss(model, x: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor, weight: float):
    """DeepSeek-V3 §2.2 written out with the model's weights: the main model's last hidden state,
    then per depth k: h = head_norm(block(eh_proj[enorm(Emb(t_{i+k})); hnorm(h)])), logits by the
    shared head, cross-entropy against t_{i+k+1} summed over the positions whose tokens i ..
    i+k+1 lie in one document and in the sequence, over the tokens; main + weight × the depths'
    mean."""
    seq, n = x.shape[1], model.args.n_layers
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]
    mask = document_causal_mask(positions)
    h = model.tok_embeddings(x)
    for i in range(n):
        h = model.layers[str(i)](h, cos, sin, mask)
    main = F.cross_entropy(model.output(model.norm(h)).flatten(0, 1), labels.flatten())
    depth_losses = []
    for k in range(1, model.args.n_mtp_layers + 1):
        blk = model.layers[str(n + k - 1)]
        ahead = torch.zeros_like(x)
        ahead[:, :seq - k] = x[:, k:]
        e = blk.enorm(model.tok_embeddings(ahead))
        h = blk.head_norm(super(MtpDepth, blk).forward(blk.eh_proj(torch.cat([e, blk.hnorm(h)], -1)), cos, sin,
                                                           mask))
        logits = model.output(h)
        terms = []
        for b in range(x.shape[0]):
            for i in range(seq - k):
                if all(positions[b, j] != 0 for j in range(i + 1, i + k + 1)):
                    terms.append(F.cross_entropy(logits[b, i], labels[b, i + k]))
        depth_losses.append(torch.stack(terms).sum() / x.numel())  # DeepSeek-V3's 1/T (eq. 24)
    return main + weight * torch.stack(depth_losses).mean(), main, depth_losses


def test_loss_matches_a_hand_written_reference():
    """Two depths on the debug flavor, packed documents, fp32: the trainer's loss (the model's
    outputs through MtpLoss) equals the hand-written objective within 1e-5, and so does each
    part MtpLoss keeps for the metrics; its gradient reaches every depth's weights and the shared
    embedding and head. Negative control: labels not cut at documents give another loss."""
    torch.manual_seed(0)
    model = build_model("deepseek_v3", "debug", n_mtp_layers=2, load_balance="none")
    model.init_weights(3)
    x, labels, positions = _packed(2, 48, seed=5)
    loss_fn = MtpLoss(cross_entropy_loss, 0.3, 2)
    out = model(x, positions=positions, tokens=x)
    assert isinstance(out, tuple) and len(out) == 3
    got = loss_fn(out, mtp_labels(labels, positions, 2))
    with torch.no_grad():
        want, main, depths = _reference_loss(model, x, labels, positions, 0.3)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    loss_fn(out, mtp_labels(labels, positions, 2))  # a second call: take(1) keeps the last one only
    kept_main, kept_depths = loss_fn.take(1)
    torch.testing.assert_close(kept_main, main, rtol=0, atol=1e-5)
    torch.testing.assert_close(kept_depths, torch.stack(depths), rtol=0, atol=1e-5)
    assert loss_fn.take(1) is None  # handed over once
    got.backward()
    for name in ("layers.4.eh_proj.weight", "layers.5.enorm.weight", "layers.5.moe.router.weight",
                 "tok_embeddings.weight", "output.weight"):
        assert model.get_parameter(name).grad.abs().sum() > 0, name
    uncut = mtp_labels(labels, None, 2)
    assert (loss_fn(out, uncut) - got).abs() > 1e-4
    # Validation gives no tokens: the logits alone, the main loss alone.
    logits = model(x, positions=positions)
    torch.testing.assert_close(loss_fn(logits, labels), main, rtol=0, atol=1e-5)


def _mtp_checkpoint(family: str, directory):
    """A tiny checkpoint of ``family`` (DeepSeek-V3 or GLM-4.5) with one MTP depth as the
    released files lay it out (``model.layers.3.*`` beside 3 layers): transformers' 4-layer model
    saved, its (MoE) layer 3 made the depth's block, with random ``enorm``, ``hnorm``,
    ``eh_proj``, ``shared_head.norm`` and the copies of the embedding and head. Returns the
    4-layer transformers model."""
    from safetensors.torch import load_file, save_file

    ref4 = make_hf_model(family, directory, num_hidden_layers=4)
    tensors = load_file(directory / "model.safetensors")
    g = torch.Generator().manual_seed(7)
    dim = ref4.config.hidden_size
    tensors |= {
        "model.layers.3.enorm.weight": 1 + 0.2 * torch.randn(dim, generator=g),
        "model.layers.3.hnorm.weight": 1 + 0.2 * torch.randn(dim, generator=g),
        "model.layers.3.shared_head.norm.weight": 1 + 0.2 * torch.randn(dim, generator=g),
        "model.layers.3.eh_proj.weight": 0.3 * torch.randn(dim, 2 * dim, generator=g),
        "model.layers.3.embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
        "model.layers.3.shared_head.head.weight": tensors["lm_head.weight"].clone(),
    }
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3,
                                                       "num_nextn_predict_layers": 1}))
    return ref4


def _assert_depth_matches(family: str, model, key: str, layer, rotary) -> torch.Tensor:
    """ray_titan's depth ``model.layers[key]`` and transformers' ``MtpLayer`` ``layer`` (its
    ``rotary`` embedding) on the same random hidden states and token embeddings: within 1e-4,
    and not with the projection's halves swapped (hidden first, Inkling's order). Returns the
    token ids it embedded, ``(1, 24)``."""
    g = torch.Generator().manual_seed(3)
    seq = 24
    h = torch.randn(1, seq, layer.config.hidden_size, generator=g)
    ids = torch.randint(0, VOCAB, (1, seq), generator=g)
    emb = model.tok_embeddings(ids)
    pos = torch.arange(seq)[None]
    with torch.no_grad():
        want = layer(emb, h, rotary(h, pos), None, pos, None)
        got = model.layers[key](h, model.rope_cos, model.rope_sin, emb=emb)
        print(f"{family}: max |difference| = {(got - want).abs().max().item():.2e} "
              f"(outputs up to {want.abs().max():.1f})")
        assert want.abs().max() > 0.5
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
        layer.config.mtp_hidden_states_first = True
        assert (layer(emb, h, rotary(h, pos), None, pos, None) - got).abs().max() > 1e-2
    return ids


# Each family that builds MTP depths: its transformers decoder layer, RMSNorm and rotary classes.
_HF_CLASSES = {
    "deepseek_v3": ("deepseek_v3", "DeepseekV3"),
    "glm4_moe": ("glm4_moe", "Glm4Moe"),
}


@pytest.fixture(scope="module", params=sorted(_HF_CLASSES))
def mtp_ckpt(request, tmp_path_factory):
    """``(family, directory, 4-layer transformers model)`` of :func:`_mtp_checkpoint`."""
    path = tmp_path_factory.mktemp(f"{request.param}_mtp")
    return request.param, path, _mtp_checkpoint(request.param, path)


def test_mtp_depth_matches_transformers_mtp_layer(mtp_ckpt):
    """The checkpoint's depth imported into ray_titan's depth (DeepSeek-V3's MtpBlock, GLM-4.5's
    Glm4MtpBlock) and into transformers' ``MtpLayer`` around the family's decoder layer (its block
    loaded from the same tensors): the same output within 1e-4 for the same hidden states and
    shifted embeddings. Negative control: the projection's halves swapped (hidden first,
    Inkling's order) differ."""
    import importlib

    from safetensors.torch import load_file
    from transformers.modeling_layers import MtpLayer

    family, path, ref4 = mtp_ckpt
    module, prefix = _HF_CLASSES[family]
    hf = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    model, _, args = load_ray_titan(path)
    assert args.n_mtp_layers == 1 and list(model.layers) == ["0", "1", "2", "3"]
    assert isinstance(model.layers["3"], MtpDepth) and hasattr(model.layers["3"], "moe")
    config = type(ref4.config).from_pretrained(path).get_mtp_config()
    config._attn_implementation = "sdpa"  # causal without a mask, as ray_titan's
    layer = MtpLayer(config, getattr(hf, f"{prefix}DecoderLayer"), getattr(hf, f"{prefix}RMSNorm"), 0).eval()
    files = load_file(path / "model.safetensors")
    state = {f"mtp_block.{k}": v for k, v in ref4.model.layers[3].state_dict().items()}
    state |= {f"{n}.weight": files[f"model.layers.3.{n}.weight"] for n in ("enorm", "hnorm", "eh_proj")}
    state["post_norm.weight"] = files["model.layers.3.shared_head.norm.weight"]
    layer.load_state_dict(state)
    _assert_depth_matches(family, model, "3", layer, getattr(hf, f"{prefix}RotaryEmbedding")(config))


def _train_one_step_and_export(src, tmp_path, *flags: str) -> tuple[dict, dict, dict]:
    """The checkpoint ``src`` imported by the train loop with model.mtp_layers = 1 (and
    ``flags``), one step whose update is dropped (it reports one depth's loss), exported in fp32:
    ``(exported tensors, src's tensors, exported config.json)``."""
    from safetensors.torch import load_file

    from ray_titan.checkpoint import export_hf
    from ray_titan.metrics.reading.steps import read_steps
    from tests.support.hf_models import train_one_dropped_step

    _, run_dir = train_one_dropped_step(src, tmp_path, "--model.mtp_layers=1", *flags)
    row = read_steps(run_dir).to_pylist()[0]
    assert row["mtp_losses"] is not None and len(row["mtp_losses"]) == 1
    out = tmp_path / "export"
    export_hf(run_dir, str(out), dtype="fp32")
    exported = {k: v for f in out.glob("model*.safetensors") for k, v in load_file(f).items()}
    return exported, load_file(src / "model.safetensors"), json.loads((out / "config.json").read_text())


def test_import_train_export_keeps_the_mtp_depth(mtp_ckpt, tmp_path):
    """The checkpoint imported by the train loop with model.mtp_layers = 1, one step whose update
    is dropped, exported: every tensor of the depth comes back bit for bit under its name, with
    num_nextn_predict_layers = 1; the copies of the embedding and head are not written
    (transformers ignores them). The step reported the depth's loss beside the main loss."""
    _, src, _ = mtp_ckpt
    # Auxiliary-loss-free balancing moves the correction bias after every step, a dropped one too.
    exported, original, config = _train_one_step_and_export(src, tmp_path, "--model.bias_update_rate=0")
    copies = {"model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"}
    assert exported.keys() == original.keys() - copies
    assert "model.layers.3.eh_proj.weight" in exported and "model.layers.3.mlp.experts.7.up_proj.weight" in exported
    for key, value in exported.items():
        assert torch.equal(value, original[key]), key
    assert config["num_nextn_predict_layers"] == 1


def test_transformers_checkpoint_without_mtp_tensors_imports_without_depths(tmp_path):
    """transformers' save_pretrained writes num_nextn_predict_layers = 1 but no depth: the import
    holds none (and trains none); a depth with tensors missing is refused naming them."""
    from safetensors.torch import load_file, save_file

    from ray_titan.checkpoint import HFCheckpointError, check_hf_checkpoint

    make_hf_model("deepseek_v3", tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert check_hf_checkpoint(str(tmp_path))[1].n_mtp_layers == 0
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = torch.randn(64, 128)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFCheckpointError, match=r"missing tensor\(s\) model.layers.3.enorm.weight"):
        check_hf_checkpoint(str(tmp_path))


@pytest.mark.parametrize("flags, message", [
    (["--model.name=deepseek_v2", "--model.mtp_layers=1"],
     r"model.mtp_layers = 1 but model.name = 'deepseek_v2' builds no multi-token prediction"),
    (["--model.name=deepseek_v3", "--model.mtp_layers=1", "--parallelism.tp=2", "mtp_tp=False"],
     r"model.mtp_layers = 1 with parallelism.tp = 2: deepseek_v3's multi-token-prediction depths have no "
     r"tensor-parallel plan"),
])
def test_preflight_refuses_what_mtp_cannot_run(flags, message, monkeypatch):
    """A family that builds no MTP; one whose parallelize plans no MTP under tp (``mtp_tp=False``:
    DeepSeek-V3's spec with its plan declared absent). DeepSeek-V3's own passes under tp."""
    import dataclasses

    from ray_titan.config import load_config
    from ray_titan.config.schema import ConfigError
    from ray_titan.models.registry import MODELS
    from ray_titan.preflight.checks import validate_job

    cfg = load_config(None, ["--parallelism.pp=1", "--parallelism.dp_shard=1", *flags[:3]])
    if "mtp_tp=False" in flags:
        validate_job(cfg, check_data=False)  # planned: accepted
        monkeypatch.setitem(MODELS, "deepseek_v3", dataclasses.replace(MODELS["deepseek_v3"], mtp_tp=False))
    with pytest.raises(ConfigError, match=message):
        validate_job(cfg, check_data=False)


def _qwen35_mtp_checkpoint(family: str, directory):
    """A tiny Qwen3.5 (dense or MoE) checkpoint with its MTP layer as the released files lay it
    out (vLLM's ``qwen3_next_mtp.py`` names): ``mtp.layers.0.*`` the full-attention layer 2's
    tensors plus noise, random zero-centred ``mtp.pre_fc_norm_embedding`` /
    ``mtp.pre_fc_norm_hidden`` / ``mtp.norm`` and ``mtp.fc`` (the routed experts without noise:
    transformers fuses them); ``mtp_num_hidden_layers = 1``.
    Returns the transformers model (without the MTP layer, which transformers ignores)."""
    from safetensors.torch import load_file, save_file

    ref = make_hf_model(family, directory)
    tensors = load_file(directory / "model.safetensors")
    g = torch.Generator().manual_seed(9)
    dim = ref.config.hidden_size
    # The routed experts stay layer 2's (transformers fuses them: the reference reads its own layer 2's).
    tensors |= {k.replace("model.layers.2.", "mtp.layers.0."): v + (0 if ".experts." in k else 0.02) *
                torch.randn(v.shape, generator=g) for k, v in tensors.items() if k.startswith("model.layers.2.")}
    tensors |= {f"mtp.{n}.weight": 0.3 * torch.randn(dim, generator=g)
                for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    tensors["mtp.fc.weight"] = 0.3 * torch.randn(dim, 2 * dim, generator=g)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    return ref


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def qwen35_mtp_ckpt(request, tmp_path_factory):
    """``(family, directory, transformers model)`` of :func:`_qwen35_mtp_checkpoint`."""
    path = tmp_path_factory.mktemp(f"{request.param}_mtp")
    return request.param, path, _qwen35_mtp_checkpoint(request.param, path)


def test_qwen35_mtp_depth_matches_transformers_mtp_layer(qwen35_mtp_ckpt):
    """The checkpoint's ``mtp.*`` imported into ray_titan's Qwen35MtpBlock and into transformers'
    ``MtpLayer`` around the family's decoder layer (full attention) and zero-centred RMSNorm,
    loaded from the same tensors: the same output within 1e-4. Negative control: the
    projection's halves swapped differ. The model feeds depth 1 the main model's normed output
    (vLLM's): its MTP logits are the depth's on ``norm(h)``, not on ``h``."""
    import copy
    import importlib

    from safetensors.torch import load_file
    from transformers.modeling_layers import MtpLayer

    from ray_titan.models.qwen3_5.model import Qwen35MtpBlock

    family, path, ref = qwen35_mtp_ckpt
    hf = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    prefix = "Qwen3_5Moe" if family == "qwen3_5_moe" else "Qwen3_5"
    model, _, args = load_ray_titan(path)
    assert args.n_mtp_layers == 1 and isinstance(model.layers["4"], Qwen35MtpBlock)
    assert hasattr(model.layers["4"], "attention") and model.mtp_layer_ids == ["4"]
    config = copy.deepcopy(ref.config)
    config.layer_types = ["full_attention"]
    config._attn_implementation = "sdpa"
    layer = MtpLayer(config, getattr(hf, f"{prefix}DecoderLayer"), getattr(hf, f"{prefix}RMSNorm"), 0).eval()
    files = load_file(path / "model.safetensors")
    state = {f"mtp_block.{k}": files.get(f"mtp.layers.0.{k}", v) for k, v in ref.model.layers[2].state_dict().items()}
    state |= {f"{a}.weight": files[f"mtp.{b}.weight"] for a, b in (
        ("enorm", "pre_fc_norm_embedding"), ("hnorm", "pre_fc_norm_hidden"), ("eh_proj", "fc"), ("post_norm", "norm"))}
    layer.load_state_dict(state)
    ids = _assert_depth_matches(family, model, "4", layer, getattr(hf, f"{prefix}TextRotaryEmbedding")(config))
    depth = model.layers["4"]
    with torch.no_grad():
        # The whole model: depth 1 reads the main model's normed output and the next token's embedding.
        x = ids
        _, mtp_logits = model(x, tokens=x)
        trunk, _ = model.trunk(x, None)
        ahead = model.tok_embeddings(torch.roll(x, -1, dims=1))
        normed = model.output(depth(model.norm(trunk), model.rope_cos, model.rope_sin, emb=ahead))
        torch.testing.assert_close(mtp_logits, normed, rtol=0, atol=1e-5)
        assert (mtp_logits - model.output(depth(trunk, model.rope_cos, model.rope_sin, emb=ahead))).abs().max() > 1e-3


def test_qwen35_import_train_export_keeps_the_mtp_layer(qwen35_mtp_ckpt, tmp_path):
    """The Qwen3.5 checkpoint imported by the train loop with model.mtp_layers = 1, one step whose
    update is dropped, exported: every tensor, ``mtp.*`` included, comes back bit for bit under
    its name, with mtp_num_hidden_layers = 1; the step reported the depth's loss. Two depths
    (the layout holds one ``mtp.fc``) are refused before any worker starts."""
    from ray_titan.checkpoint import resolve_hf_job
    from ray_titan.config import load_config
    from ray_titan.config.schema import ConfigError
    from ray_titan.preflight.checks import validate_job

    family, src, _ = qwen35_mtp_ckpt
    exported, original, config = _train_one_step_and_export(src, tmp_path)
    assert exported.keys() == original.keys() and "mtp.fc.weight" in exported
    for key, value in exported.items():
        assert torch.equal(value, original[key]), key
    assert config["mtp_num_hidden_layers"] == 1
    cfg = resolve_hf_job(load_config(None, [f"--checkpoint.initial_load_hf={src}", "--model.mtp_layers=2",
                                            "--parallelism.pp=1", "--parallelism.dp_shard=1"]))
    with pytest.raises(ConfigError, match=rf"model.mtp_layers = 2 but model.name = '{family}' builds at most 1"):
        validate_job(cfg, check_data=False)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_qwen35_flops_and_memory_plan_count_the_mtp_depth(family):
    """One depth (model.mtp_layers = 1) adds to the FLOPs its block's activated parameters and the
    output head once more (6 × (N_depth + V·d)) and one full-attention layer's scores; the memory
    plan's block formula counts the depth's block (layer n_layers) as a full-attention block."""
    import dataclasses

    from ray_titan.models.deepseek_v2.model import activated_parameters
    from ray_titan.models.registry import get_model_args, get_spec

    spec, args = get_spec(family), get_model_args(family, "debug")
    mtp = dataclasses.replace(args, n_mtp_layers=1)
    with torch.device("meta"):
        base, with_depth = (build_model(family, "", args=a) for a in (args, mtp))
    count = activated_parameters if spec.moe else (lambda m: sum(p.numel() for p in m.parameters()))
    depth = count(with_depth) - count(base)
    assert depth > 2 * args.dim * args.dim  # eh_proj and the block
    seq = 256
    want = 6 * (depth + args.vocab_size * args.dim) + 12 * args.n_heads * args.head_dim * seq
    assert spec.flops_per_token(mtp, seq) - spec.flops_per_token(args, seq) == want
    depth_block = spec.block_activations(mtp, args.n_layers, 2, seq, "cpu", 1.0, 1)
    assert depth_block == spec.block_activations(args, args.full_attention_layers[0], 2, seq, "cpu", 1.0, 1)
    assert depth_block != spec.block_activations(args, 0, 2, seq, "cpu", 1.0, 1)  # a DeltaNet block's differs
