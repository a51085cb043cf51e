"""Tiny random Hugging Face models made with transformers (a test dependency) for the HF tests.

Each family's model is built from its transformers config class, re-initialised with weights
much larger than a training init (std 0.3; norms 1 ± 0.2): with std 0.02 attention is nearly
uniform, and a wrong rotary layout would go unnoticed. Saved with ``save_pretrained`` together
with a small byte-level BPE ``tokenizer.json`` trained here (nothing is downloaded).
"""

from __future__ import annotations

import json
from pathlib import Path

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


def hf_config(family: str):
    """The transformers config of the tiny model of ``family`` (llama, qwen3, deepseek_v2)."""
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
    # DeepSeek-V2-Lite's shape in small: YaRN (its factor, mscale), plain q projection, first layer
    # dense, 8 routed experts top-2 plus a shared one; a routed scaling factor that matters.
    rope = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 40.0, "original_max_position_embeddings": 64,
            "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
    return tf.DeepseekV2Config(
        num_hidden_layers=3, first_k_dense_replace=1, moe_intermediate_size=32, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, routed_scaling_factor=1.5, q_lora_rank=None, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rope_parameters=rope,
        **{**common, "max_position_embeddings": 40 * 64},
    )


def make_hf_model(family: str, directory: Path, dtype: torch.dtype = torch.float32, **changes):
    """Build, re-initialise (large weights) and ``save_pretrained`` the tiny model of ``family``
    into ``directory`` with a tokenizer; returns the transformers model (fp32, eval mode).
    ``changes``: config fields set on :func:`hf_config`'s (e.g. another routing method)."""
    import transformers as tf

    torch.manual_seed({"llama": 1, "qwen3": 2, "deepseek_v2": 3}[family])
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
    ap.add_argument("--family", choices=["llama", "qwen3", "deepseek_v2"], default="qwen3")
    a = ap.parse_args(argv)
    make_hf_model(a.family, a.out_dir / a.family)
    (a.out_dir / "text.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus_lines()))
    print(f"wrote {a.out_dir / a.family} and {a.out_dir / 'text.jsonl'}")


if __name__ == "__main__":
    main()
