"""DeepSeek-V3's multi-token prediction (no Ray, no process): the depths' labels against a loop
over the tokens, the loss against a hand-written forward of the same weights, one MTP depth
against transformers' ``MtpLayer`` on a checkpoint's tensors, the import and export of the
depths, and the pre-flight's refusals."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from ray_titan.data.loader import IGNORE_INDEX
from ray_titan.models.decoder import document_causal_mask
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
        h = blk.head_norm(super(type(blk), blk).forward(blk.eh_proj(torch.cat([e, blk.hnorm(h)], -1)), cos, sin,
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


def _mtp_checkpoint(directory):
    """A tiny DeepSeek-V3 checkpoint with one MTP depth as the released files lay it out
    (``model.layers.3.*`` beside 3 layers): transformers' 4-layer model saved, its layer 3 made
    the depth's block, with random ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and the
    copies of the embedding and head. Returns the 4-layer transformers model."""
    from safetensors.torch import load_file, save_file

    ref4 = make_hf_model("deepseek_v3", directory, num_hidden_layers=4)
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


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("v3_mtp")
    return path, _mtp_checkpoint(path)


def test_mtp_depth_matches_transformers_mtp_layer(mtp_ckpt):
    """The checkpoint's depth imported into ray_titan's MtpBlock and into transformers'
    ``MtpLayer`` (its block loaded from the same tensors): the same output within 1e-4 for the
    same hidden states and shifted embeddings. Negative control: the projection's halves swapped
    (hidden first, Inkling's order) differ."""
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer,
        DeepseekV3RMSNorm,
        DeepseekV3RotaryEmbedding,
    )

    path, ref4 = mtp_ckpt
    model, _, args = load_ray_titan(path)
    assert args.n_mtp_layers == 1 and list(model.layers) == ["0", "1", "2", "3"]
    config = transformers.DeepseekV3Config.from_pretrained(path).get_mtp_config()
    config._attn_implementation = "sdpa"  # causal without a mask, as ray_titan's
    layer = MtpLayer(config, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, 0).eval()
    from safetensors.torch import load_file

    files = load_file(path / "model.safetensors")
    state = {f"mtp_block.{k}": v for k, v in ref4.model.layers[3].state_dict().items()}
    state |= {f"{n}.weight": files[f"model.layers.3.{n}.weight"] for n in ("enorm", "hnorm", "eh_proj")}
    state["post_norm.weight"] = files["model.layers.3.shared_head.norm.weight"]
    layer.load_state_dict(state)
    g = torch.Generator().manual_seed(3)
    seq = 24
    h = torch.randn(1, seq, config.hidden_size, generator=g)
    ids = torch.randint(0, VOCAB, (1, seq), generator=g)
    emb = model.tok_embeddings(ids)
    pos = torch.arange(seq)[None]
    rotary = DeepseekV3RotaryEmbedding(config)
    with torch.no_grad():
        want = layer(emb, h, rotary(h, pos), None, pos, None)
        got = model.layers["3"](h, model.rope_cos, model.rope_sin, emb=emb)
        assert want.abs().max() > 0.5
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
        config.mtp_hidden_states_first = True
        assert (layer(emb, h, rotary(h, pos), None, pos, None) - got).abs().max() > 1e-2


def test_import_train_export_keeps_the_mtp_depth(mtp_ckpt, tmp_path):
    """The checkpoint imported by the train loop with model.mtp_layers = 1, one step whose update
    is dropped, exported: every tensor of the depth comes back bit for bit under its name, with
    num_nextn_predict_layers = 1; the copies of the embedding and head are not written
    (transformers ignores them). The step reported the depth's loss beside the main loss."""
    from safetensors.torch import load_file

    from ray_titan.checkpoint import export_hf
    from ray_titan.metrics.reading.steps import read_steps
    from tests.support.hf_models import train_one_dropped_step

    src, _ = mtp_ckpt
    _, run_dir = train_one_dropped_step(src, tmp_path, "--model.mtp_layers=1")
    row = read_steps(run_dir).to_pylist()[0]
    assert row["mtp_losses"] is not None and len(row["mtp_losses"]) == 1
    out = tmp_path / "export"
    export_hf(run_dir, str(out), dtype="fp32")
    exported = {k: v for f in out.glob("model*.safetensors") for k, v in load_file(f).items()}
    original = load_file(src / "model.safetensors")
    copies = {"model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"}
    assert exported.keys() == original.keys() - copies
    assert "model.layers.3.eh_proj.weight" in exported and "model.layers.3.mlp.experts.7.up_proj.weight" in exported
    for key, value in exported.items():
        assert torch.equal(value, original[key]), key
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1


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
