"""Tiny random Hugging Face models made with transformers (a test dependency) for the HF tests.

Each family's model is built from its transformers config class, re-initialised with weights
much larger than a training init (std 0.3; norms 1 ± 0.2): with std 0.02 attention is nearly
uniform, and a wrong rotary layout would go unnoticed. Saved with ``save_pretrained`` together
with a small byte-level BPE ``tokenizer.json`` trained here (nothing is downloaded).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

VOCAB = 320  # the model's embedding rows; the tokenizer has fewer (as Qwen3's is padded)
TOKENIZER_VOCAB = 300
SEQ = 128
WEIGHT_STD = 0.3


def corpus_lines(n: int = 400) -> list[str]:
    """Deterministic English-like lines: a corpus for the tokenizer and the fine-tuning data."""
    g = torch.Generator().manual_seed(0)
    words = ("the model reads tokens and learns which word comes next; a pipeline stage passes "
             "hidden states to the next rank while experts route each token to the best of "
             "eight small networks, and the optimizer moves every weight a little").split()
    out = []
    for _ in range(n):
        k = int(torch.randint(8, 24, (1,), generator=g))
        idx = torch.randint(0, len(words), (k,), generator=g).tolist()
        out.append(" ".join(words[i] for i in idx) + ".")
    return out


def write_tokenizer(directory: Path, vocab_size: int = TOKENIZER_VOCAB) -> Path:
    """A byte-level BPE ``tokenizer.json`` (with ``<|endoftext|>``) and a ``tokenizer_config.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus_lines(), trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    return directory / "tokenizer.json"


# Each family's tiny model is seeded apart. A registered family without one fails the tests that
# take every family (ray_titan.models.registry.FAMILIES): add its seed here and its config below.
SEEDS = {"llama": 1, "qwen3": 2, "deepseek_v2": 3, "deepseek_v3": 4, "qwen3_moe": 5, "gpt_oss": 6, "qwen3_5": 7,
         "qwen3_5_moe": 8, "glm4_moe": 9, "minimax_m2": 10}


def hf_config(family: str):
    """The transformers config of the tiny model of ``family`` (a key of :data:`SEEDS`). Raises
    ``KeyError`` for a family that has none."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  max_position_embeddings=4 * SEQ, bos_token_id=0, eos_token_id=0)
    if family == "llama":  # Llama 3.1-style rope scaling, GQA 4:2
        rope = {"rope_type": "llama3", "rope_theta": 10_000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return tf.LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, rope_parameters=rope, **common)
    if family == "qwen3":  # tied head, heads of 32 (wider than 64 / 4), GQA 4:1 (a k head split by FSDP)
        return tf.Qwen3Config(num_hidden_layers=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
                              **common)
    if family == "qwen3_moe":
        # Qwen3-30B-A3B's shape in small: heads of 32 (wider than 64 / 4), GQA 4:2, 8 experts top-2
        # with normalised weights, the middle layer dense (mlp_only_layers: not a prefix).
        return tf.Qwen3MoeConfig(num_hidden_layers=3, num_key_value_heads=2, head_dim=32, moe_intermediate_size=32,
                                 num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                                 **common)
    if family == "qwen3_5":
        # Qwen3.5's shape in small (the text model): DeltaNet, DeltaNet, full attention, DeltaNet
        # (not the default pattern: layer_types is read), heads of 32 of which a quarter rotates,
        # GQA 4:2; DeltaNet 2 key heads and 4 value heads of 16, a convolution of 4.
        return tf.Qwen3_5TextConfig(
            num_hidden_layers=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            tie_word_embeddings=False, **common)
    if family == "qwen3_5_moe":
        # Qwen3.5-MoE's shape in small: the dense tiny model's layers, 8 experts top-2 and a
        # shared expert wider than them (48 against 32) behind its sigmoid gate.
        common.pop("intermediate_size")
        return tf.Qwen3_5MoeTextConfig(
            num_hidden_layers=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
            **common)
    if family == "gpt_oss":
        # gpt-oss's shape in small: heads of 16, GQA 4:2, 8 experts top-2 (every layer MoE), layers
        # sliding (a window of 16: it matters at 300 tokens) / full / sliding, its YaRN (truncate false).
        rope = {"rope_type": "yarn", "rope_theta": 150_000.0, "factor": 32.0, "original_max_position_embeddings": 64,
                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
        return tf.GptOssConfig(
            num_hidden_layers=3, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
            sliding_window=16, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters=rope, **common)
    if family == "deepseek_v3":
        # DeepSeek-V3's shape in small: a query latent, sigmoid routing of 8 experts in 4 groups of
        # which 2 are kept (top-2), normalised and scaled weights, V3's YaRN (mscale 1).
        rope = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 40.0, "original_max_position_embeddings": 64,
                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
        return tf.DeepseekV3Config(
            num_hidden_layers=3, first_k_dense_replace=1, moe_intermediate_size=32, n_routed_experts=8,
            n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2, norm_topk_prob=True,
            routed_scaling_factor=2.5, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, rope_parameters=rope, **{**common, "max_position_embeddings": 40 * 64},
        )
    if family == "glm4_moe":
        # GLM-4.5's shape in small: heads of 32 of which 16 rotated (partial_rotary_factor 0.5), GQA
        # 4:2, q/k/v biases, q/k norms, the first layer dense, sigmoid routing of 8 experts in 2
        # groups of which 1 is kept (top-2) with the correction bias, one shared expert, scaling 2.5.
        return tf.Glm4MoeConfig(
            num_hidden_layers=3, num_key_value_heads=2, head_dim=32, first_k_dense_replace=1, moe_intermediate_size=32,
            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True, attention_bias=True, **common)
    if family == "minimax_m2":
        # MiniMax-M2's shape in small: heads of 32 of which 16 rotated (rotary_dim), GQA 4:2, q/k
        # norms over all heads, every layer MoE: sigmoid routing of 8 experts (top-2) with the
        # correction bias, no shared expert.
        return tf.MiniMaxM2Config(
            num_hidden_layers=3, num_key_value_heads=2, head_dim=32, rotary_dim=16, num_local_experts=8,
            num_experts_per_tok=2, **{**common, "intermediate_size": 32})
    if family == "deepseek_v2":
        # DeepSeek-V2-Lite's shape in small: YaRN (its factor, mscale), plain q projection, first
        # layer dense, 8 routed experts top-2 plus a shared one; a routed scaling factor that matters.
        rope = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 40.0, "original_max_position_embeddings": 64,
                "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
        return tf.DeepseekV2Config(
            num_hidden_layers=3, first_k_dense_replace=1, moe_intermediate_size=32, n_routed_experts=8,
            n_shared_experts=1, num_experts_per_tok=2, routed_scaling_factor=1.5, q_lora_rank=None,
            kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rope_parameters=rope,
            **{**common, "max_position_embeddings": 40 * 64},
        )
    raise KeyError(f"no tiny Hugging Face model of family {family!r}; tests/support/hf_models.py has {sorted(SEEDS)}")


def make_hf_model(family: str, directory: Path, dtype: torch.dtype = torch.float32, **changes):
    """Build, re-initialise (large weights) and ``save_pretrained`` the tiny model of ``family``
    into ``directory`` with a tokenizer; returns the transformers model (fp32, eval mode).
    ``changes``: config fields set on :func:`hf_config`'s (e.g. another routing method)."""
    import transformers as tf

    torch.manual_seed(SEEDS[family])
    config = hf_config(family)
    for name, value in changes.items():
        setattr(config, name, value)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, WEIGHT_STD)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's: large enough to change choices
                b.normal_(0.0, 0.1)
    model.to(dtype).save_pretrained(directory)
    write_tokenizer(directory)
    return model.float()


def main(argv: list[str] | None = None) -> None:
    """``python -m tests.support.hf_models OUT_DIR [--family qwen3]``: write a tiny random Hugging Face
    model (with its tokenizer) to ``OUT_DIR/<family>`` and a JSON Lines text to
    ``OUT_DIR/text.jsonl``, to try ``configs/finetune_hf.toml`` without downloading a model."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tests.support.hf_models", description=main.__doc__)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--family", choices=list(SEEDS), default="qwen3")
    a = ap.parse_args(argv)
    make_hf_model(a.family, a.out_dir / a.family)
    (a.out_dir / "text.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus_lines()))
    print(f"wrote {a.out_dir / a.family} and {a.out_dir / 'text.jsonl'}")


if __name__ == "__main__":
    main()


def random_tokens(n: int = 300, seed: int = 11) -> torch.Tensor:
    """``(1, n)`` int64 token ids below :data:`VOCAB`, from ``seed``."""
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def load_ray_titan(path):
    """The Hugging Face directory ``path`` imported into ray_titan on one process:
    ``(model in eval mode, ModelSpec, model arguments)``."""
    from ray_titan.checkpoint import check_hf_checkpoint, load_hf_weights
    from ray_titan.models.registry import build_model

    spec, args = check_hf_checkpoint(str(path))
    model = build_model(spec.name, "", args=args)
    model.init_buffers()
    load_hf_weights(model, str(path), spec, args)
    return model.eval(), spec, args


def expert_choices(model, router_cls: type, tokens: torch.Tensor, index: int):
    """``(logits, choices)``: ``model``'s logits for ``tokens`` (no grad) and, per call of a
    ``router_cls`` module, the experts it chose, sorted per token (``(tokens, k)``); ``index``:
    where the router's output tuple holds them (transformers' top-k routers: 2; ray_titan's
    ``Router``: 1)."""
    seen: list[torch.Tensor] = []
    handles = [m.register_forward_hook(lambda mod, inputs, out: seen.append(out[index].sort(dim=-1).values))
               for m in model.modules() if isinstance(m, router_cls)]
    with torch.no_grad():
        logits = model(tokens)
    for h in handles:
        h.remove()
    return getattr(logits, "logits", logits), seen


def assert_config_refused(src: Path, tmp_path: Path, change: dict[str, Any], message: str) -> None:
    """A copy of the Hugging Face directory ``src`` whose ``config.json`` has ``change`` (a None
    value drops the field) is refused by ``check_hf_checkpoint`` with an ``HFCheckpointError``
    naming that file and matching ``message`` (a regular expression)."""
    import shutil

    import pytest

    from ray_titan.checkpoint import HFCheckpointError, check_hf_checkpoint

    shutil.copytree(src, tmp_path / "m")
    config = json.loads((src / "config.json").read_text())
    for key, value in change.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFCheckpointError, match=rf"{tmp_path / 'm'}/config\.json: .*{message}"):
        check_hf_checkpoint(str(tmp_path / "m"))


def export_equals_source(run_dir: Path, src: Path, out: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Export the run ``run_dir`` to ``out`` (fp32) and check it holds the tensors of the Hugging
    Face directory ``src`` bit for bit under the same names, that its ``config.json`` describes the
    same architecture (the family adapter's ``differences``) and that transformers reads it back
    with logits equal to the original's (64 tokens, to the bit). Returns ``(exported tensors by
    name, the export's config.json)``."""
    import torch
    import transformers as tf
    from safetensors.torch import load_file

    from ray_titan.checkpoint import check_hf_checkpoint, export_hf

    export_hf(run_dir, str(out), dtype="fp32")
    exported = {k: v for f in out.glob("model*.safetensors") for k, v in load_file(f).items()}
    original = load_file(src / "model.safetensors")
    assert exported.keys() == original.keys()
    for key, value in original.items():
        assert torch.equal(exported[key], value), key
    spec, args = check_hf_checkpoint(str(out))
    assert spec.hf.differences(args, check_hf_checkpoint(str(src))[1]) == []
    tokens = random_tokens(64, seed=2)
    with torch.no_grad():
        back, ref = (tf.AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in (out, src))
        torch.testing.assert_close(back(tokens).logits, ref(tokens).logits, rtol=0, atol=0)
    return exported, json.loads((out / "config.json").read_text())


def train_one_dropped_step(src: Path, tmp_path: Path, *flags: str) -> tuple[Any, Path]:
    """The train loop, in this process on one rank, starting from the Hugging Face directory
    ``src``, for one step whose update is dropped (a non-finite loss injected under
    ``on_nonfinite = "skip"``), saving its checkpoint: ``(resolved JobConfig, run directory)``,
    whose export must equal ``src`` bit for bit. ``flags``: more dotted settings (``--model.bias_update_rate=0``:
    auxiliary-loss-free balancing moves the router bias after a dropped update too)."""
    from ray_titan.checkpoint import LocalCheckpointStorage, resolve_hf_job
    from ray_titan.config import load_config
    from ray_titan.metrics.collector.collector import MetricsCollector
    from ray_titan.metrics.reading.steps import read_steps
    from ray_titan.metrics.worker.report import LocalReporter
    from ray_titan.preflight.checks import validate_job
    from ray_titan.trainer import train_loop

    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus_lines(64)))
    cfg = resolve_hf_job(load_config(None, [
        f"--checkpoint.initial_load_hf={src}", f"--data.path={data}", f"--job.dump_folder={tmp_path}",
        "--data.source=jsonl", "--training.seq_len=32", "--training.global_batch_size=4", "--training.steps=1",
        "--parallelism.pp=1", "--parallelism.dp_shard=1", "--metrics.enable_tensorboard=false",
        "--metrics.log_freq=1", "--training.threads_per_worker=1", "--memory.breakdown_step=0",
        "--debug.nonfinite_loss_at_steps=[1]", "--training.on_nonfinite=skip", *flags]))
    validate_job(cfg)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    collector = MetricsCollector(str(run_dir), 1, [0], cfg.training.steps, enable_tensorboard=False)
    train_loop(cfg, LocalReporter(collector), None,
               checkpoint_storage=LocalCheckpointStorage(run_dir / "checkpoints", 0))
    collector.finish()
    assert read_steps(run_dir).to_pylist()[0]["skipped_update"]
    return cfg, run_dir
