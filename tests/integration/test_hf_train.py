"""Hugging Face checkpoints through training, without Ray: import onto multi-rank meshes (parity
with a one-process load), fine-tuning and export, and the import -> export round trip.

One-process runs go through the train loop in this process; the multi-rank runs are the
launcher under torchrun (4 gloo processes).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pytest
import torch

from ray_titan.checkpoint import (
    LocalCheckpointStorage,
    check_hf_checkpoint,
    export_hf,
    find_latest,
    load_hf_weights,
    read_manifest,
    resolve_hf_job,
)
from ray_titan.config import load_config, merge_overrides
from ray_titan.metrics.collector.collector import MetricsCollector
from ray_titan.metrics.reading.steps import read_steps
from ray_titan.metrics.worker.report import LocalReporter
from ray_titan.models.registry import build_model
from ray_titan.preflight.checks import validate_job
from ray_titan.trainer import train_loop
from tests.support.hf_models import SEQ, VOCAB, corpus_lines, make_hf_model
from tests.support.ranks import launch

transformers = pytest.importorskip("transformers")

# The same data, batch and LR schedule in every run, so step losses compare across meshes.
COMMON = ["--data.source=jsonl", "--training.seq_len=32", "--training.global_batch_size=8",
          "--parallelism.microbatches=4", "--lr_scheduler.warmup_steps=4", "--optimizer.lr=3e-3",
          "--metrics.enable_tensorboard=false", "--metrics.log_freq=1", "--training.threads_per_worker=1",
          "--memory.breakdown_step=0"]


@pytest.fixture(scope="module")
def models(hf_models, tmp_path_factory):
    """The session's tiny Hugging Face models' directory and a JSON Lines text to train on."""
    data = tmp_path_factory.mktemp("hf_train") / "text.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus_lines()))
    return hf_models[0], data


def _overrides(root, data, family, dump, *extra):
    return [f"--checkpoint.initial_load_hf={root / family}", f"--data.path={data}", f"--job.dump_folder={dump}",
            *COMMON, *extra]


def _in_process(root, data, family, dump, *extra):
    """The train loop in this process on one rank; returns (step losses, run directory)."""
    cfg = resolve_hf_job(load_config(None, _overrides(root, data, family, dump, "--parallelism.pp=1",
                                                      "--parallelism.dp_shard=1", *extra)))
    validate_job(cfg)
    run_dir = dump / "run"
    run_dir.mkdir(parents=True)
    collector = MetricsCollector(str(run_dir), 1, [0], cfg.training.steps, enable_tensorboard=False)
    train_loop(cfg, LocalReporter(collector), None, checkpoint_storage=LocalCheckpointStorage(
        run_dir / "checkpoints", 0))
    collector.finish()
    return np.array(read_steps(run_dir).sort_by("step")["step_loss"].to_pylist()), run_dir


def _torchrun(root, data, family, dump, *extra):
    """The launcher on 4 ranks from a Hugging Face checkpoint; returns (the first rank's step
    losses, run directory)."""
    return _launch(4, dump, *_overrides(root, data, family, dump, *extra))


def _launch(nproc, dump, *overrides, timeout=600):
    """The launcher on ``nproc`` ranks (torchrun when more than one); returns (the first
    last-stage rank's step losses, run directory)."""
    dump.mkdir(parents=True, exist_ok=True)
    # tests/support/ranks.py: torchrun's ranks, forked
    out = launch(list(overrides), nproc, cwd=dump.parent, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    (run_dir,) = dump.glob("*-*")
    steps = read_steps(run_dir)
    last = steps.filter(pa.compute.is_valid(steps["step_loss"]))
    rank = min(last["rank"].to_pylist())
    losses = last.filter(pa.compute.equal(last["rank"], rank)).sort_by("step")["step_loss"].to_pylist()
    return np.array(losses), run_dir


def _transformers_load(path):
    """``from_pretrained`` with its loading report; fails on any missing, unexpected or
    mismatched key."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, output_loading_info=True, dtype=torch.float32)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(kind), (kind, info[kind])
    return model.eval()


def _ray_titan_load(path):
    spec, args = check_hf_checkpoint(str(path))
    model = build_model(spec.name, "", args=args)
    model.init_buffers()
    load_hf_weights(model, str(path), spec, args)
    return model.eval()


def _dcp_model_state(checkpoint, model):
    """The model entries of a ray_titan DCP checkpoint, loaded into ``model``'s state dict."""
    import torch.distributed.checkpoint as dcp

    sd = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    dcp.load(sd, checkpoint_id=str(checkpoint), no_dist=True)
    return {k[6:]: v for k, v in sd.items()}


@pytest.fixture(scope="module")
def finetune(models, tmp_path_factory):
    root, data = models
    return _in_process(root, data, "qwen3", tmp_path_factory.mktemp("finetune"), "--training.steps=16")


def test_finetune_trains_and_its_export_loads_in_transformers(finetune, tmp_path):
    losses, run_dir = finetune
    assert len(losses) == 16 and losses[-4:].mean() < losses[:4].mean() - 1.0, losses
    from ray_titan.cli import main

    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--to", "hf", str(out), "--dtype", "fp32"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in index["weight_map"]  # tied: the embedding once
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    # ... copied from the checkpoint, which keeps them and the imported config.json (issue 33)
    manifest = read_manifest(find_latest(run_dir / "checkpoints"))
    assert {"hf/tokenizer.json", "hf/tokenizer_config.json", "hf/config.json"} <= set(manifest["files"])
    assert (out / "tokenizer.json").read_bytes() == (find_latest(run_dir / "checkpoints") / "hf" /
                                                      "tokenizer.json").read_bytes()
    # Export -> import is bitwise the trained weights; transformers computes the same logits.
    mine = _ray_titan_load(out)
    trained = _dcp_model_state(find_latest(run_dir / "checkpoints"), mine)
    for name, value in mine.state_dict().items():
        assert torch.equal(value, trained[name]), name
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(mine(tokens), _transformers_load(out)(tokens).logits, rtol=0, atol=1e-4)


def test_import_onto_pp2_dp_shard2_matches_one_process(models, finetune, tmp_path):
    """Qwen3 (tied head: the copy on the last stage; a key head split by FSDP) on pp=2 ×
    dp_shard=2: the first steps' losses equal the one-process run's, and the run's own export
    (``checkpoint.last_save_hf``, from the 4-rank checkpoint) loads in transformers."""
    root, data = models
    losses, run_dir = _torchrun(root, data, "qwen3", tmp_path / "pp2dp2", "--training.steps=2",
                                "--parallelism.pp=2", "--parallelism.dp_shard=2", "--checkpoint.last_save_hf=true")
    np.testing.assert_allclose(losses, finetune[0][:2], rtol=1e-5)
    _transformers_load(run_dir / "hf")


@pytest.fixture(scope="module")
def qwen3_debug_one_process(models, tmp_path_factory):
    """Two steps of the built-in ``qwen3/debug`` flavor (tied, 4 k/v heads: tp=2 divides them)."""
    dump = tmp_path_factory.mktemp("qwen3_one") / "dump"
    return _launch(1, dump, *_qwen3_debug(models[1], dump))


def _qwen3_debug(data, dump, *extra):
    return merge_overrides(
        ["--model.name=qwen3", "--model.flavor=debug", "--data.tokenizer=byte", f"--data.path={data}", *COMMON,
         "--training.steps=2", "--checkpoint.enable=false", "--parallelism.pp=1", "--parallelism.dp_shard=1",
         f"--job.dump_folder={dump}"], list(extra))


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_tied_head_under_pp2_tp2_matches_one_process(models, qwen3_debug_one_process, tmp_path, schedule):
    """The tied copies under tensor parallel: the pair is the first- and last-stage ranks of the
    same tp coordinate (1F1B), or one rank holds both stages (V-shaped); the embedding's
    gradient, Replicate under TP, is summed as its Shard(0) weight. Either way the second
    step's loss is the one-process run's."""
    v = ["--parallelism.stages_per_rank=2"] if schedule == "ZBVZeroBubble" else []
    losses, _ = _launch(4, tmp_path / "dump", *_qwen3_debug(
        models[1], tmp_path / "dump", "--parallelism.pp=2", "--parallelism.dp_shard=1", "--parallelism.tp=2",
        f"--parallelism.pipeline_schedule={schedule}", *v))
    np.testing.assert_allclose(losses, qwen3_debug_one_process[0], rtol=1e-5)


@pytest.mark.parametrize("family, mesh", [
    ("deepseek_v2", ["--parallelism.pp=2", "--parallelism.dp_shard=2", "--parallelism.ep=2"]),
    # V3: the query latent and the sigmoid group routing under tensor parallel, experts over ep.
    ("deepseek_v3", ["--parallelism.pp=1", "--parallelism.tp=2", "--parallelism.dp_shard=2", "--parallelism.ep=2"]),
    # Qwen3-MoE (its pooled balance loss per stage under PP) and gpt-oss (sinks, sliding windows,
    # expert biases sharded over ep; tp is refused for it) on the MoE job's mesh.
    ("qwen3_moe", ["--parallelism.pp=2", "--parallelism.dp_shard=2", "--parallelism.ep=2"]),
    ("gpt_oss", ["--parallelism.pp=2", "--parallelism.dp_shard=2", "--parallelism.ep=2"]),
    # GLM-4.5 (partial rotary, q/k/v biases, its correction bias from the weights) over pp and ep.
    ("glm4_moe", ["--parallelism.pp=2", "--parallelism.dp_shard=2", "--parallelism.ep=2"]),
    ("minimax_m2", ["--parallelism.pp=2", "--parallelism.dp_shard=2", "--parallelism.ep=2"]),
    # Qwen3.5 (Gated DeltaNet; tp refused): its dense twin under FSDP and pipeline stages too.
    ("qwen3_5", ["--parallelism.pp=2", "--parallelism.dp_shard=2", "--parallelism.ep=1"]),
    ("qwen3_5_moe", ["--parallelism.pp=2", "--parallelism.dp_shard=2", "--parallelism.ep=2"]),
], ids=["deepseek_v2_pp2_ep2", "deepseek_v3_tp2_ep2", "qwen3_moe_pp2_ep2", "gpt_oss_pp2_ep2", "glm4_moe_pp2_ep2",
        "minimax_m2_pp2_ep2", "qwen3_5_pp2_dp2", "qwen3_5_moe_pp2_ep2"])
def test_moe_import_onto_a_mesh_matches_one_process(models, tmp_path, family, mesh):
    root, data = models
    single, _ = _in_process(root, data, family, tmp_path / "one", "--training.steps=1")
    losses, _ = _torchrun(root, data, family, tmp_path / "mesh", "--training.steps=1", *mesh)
    np.testing.assert_allclose(losses, single, rtol=1e-5)


def test_pp_stage_without_moe_layers_matches_one_process(models, tmp_path):
    """A 2-layer DeepSeek-V2 (first layer dense) on pp=2: stage 0 holds no MoE layer. Only MoE
    stages used to run the shape-inference dummy step, desynchronising the pipeline (a hang at
    step 1 or 2, killed by the timeout here)."""
    _, data = models
    root = tmp_path / "m"
    make_hf_model("deepseek_v2", root / "deepseek_v2", num_hidden_layers=2)
    single, _ = _in_process(root, data, "deepseek_v2", tmp_path / "one", "--training.steps=2")
    losses, _ = _launch(2, tmp_path / "mesh", *_overrides(root, data, "deepseek_v2", tmp_path / "mesh",
                                                          "--training.steps=2", "--parallelism.pp=2",
                                                          "--parallelism.dp_shard=1"), timeout=240)
    np.testing.assert_allclose(losses, single, rtol=1e-5)


def test_deepseek_v3_import_then_export_is_bitwise(models, tmp_path):
    """The tiny DeepSeek-V3 (its correction bias in the weights files, as the released ones):
    imported, saved by a run whose only update is dropped, exported: the same tensors, bit for
    bit, and transformers' DeepseekV3ForCausalLM loads the export with the same logits."""
    from safetensors.torch import load_file

    root, data = models
    _, run_dir = _in_process(root, data, "deepseek_v3", tmp_path / "run", "--training.steps=1",
                             "--model.bias_update_rate=0", "--debug.nonfinite_loss_at_steps=[1]",
                             "--training.on_nonfinite=skip")
    out = tmp_path / "export"
    export_hf(run_dir, str(out), dtype="fp32")
    exported = {k: v for f in out.glob("model*.safetensors") for k, v in load_file(f).items()}
    original = load_file(root / "deepseek_v3" / "model.safetensors")
    assert exported.keys() == original.keys()
    assert any(k.endswith("e_score_correction_bias") for k in exported)
    for key, value in original.items():
        assert torch.equal(exported[key], value), key
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["num_nextn_predict_layers"]) == ("deepseek_v3", 0)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(_ray_titan_load(out)(tokens), _transformers_load(out)(tokens).logits,
                                   rtol=0, atol=1e-4)


def test_import_then_export_is_bitwise_with_expert_bias(models, tmp_path):
    """An MoE checkpoint with an aux-loss-free router bias beside it: imported, saved by a run
    whose only update is dropped, exported: the same tensors, bit for bit, in the same files;
    transformers loads the export with the same logits."""
    from safetensors.torch import load_file, save_file

    root, data = models
    src = tmp_path / "src"
    shutil.copytree(root / "deepseek_v2", src)
    bias = {f"model.layers.{i}.mlp.gate.expert_bias": torch.randn(8) * 0.1 for i in (1, 2)}
    save_file(bias, src / "router_bias.safetensors")
    shutil.copytree(src, tmp_path / "models" / "deepseek_v2")
    _, run_dir = _in_process(tmp_path / "models", data, "deepseek_v2", tmp_path / "run", "--training.steps=1",
                             "--model.load_balance=aux_free", "--model.bias_update_rate=0",
                             "--debug.nonfinite_loss_at_steps=[1]", "--training.on_nonfinite=skip")
    out = tmp_path / "export"
    export_hf(run_dir, str(out), dtype="fp32", max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # several shards
    exported = {k: v for f in out.glob("model-*.safetensors") for k, v in load_file(f).items()}
    original = load_file(src / "model.safetensors")
    assert exported.keys() == original.keys()
    for key, value in original.items():
        assert torch.equal(exported[key], value), key
    kept = load_file(out / "router_bias.safetensors")
    assert kept.keys() == bias.keys() and all(torch.equal(kept[k], bias[k]) for k in bias)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    mine = _ray_titan_load(out)  # the bias is loaded back; aux_loss routing (transformers') ignores it
    assert torch.equal(mine.layers["2"].moe.router.expert_bias, bias["model.layers.2.mlp.gate.expert_bias"])
    with torch.no_grad():
        torch.testing.assert_close(mine(tokens), _transformers_load(out)(tokens).logits, rtol=0, atol=1e-4)
