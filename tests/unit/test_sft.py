"""Supervised fine-tuning examples (loss masks, chat templates) and document masks (no Ray)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ray_titan.config.schema import ConfigError, Data, JobConfig
from ray_titan.data.documents import document_positions
from ray_titan.data.loader import IGNORE_INDEX
from ray_titan.data.sft import ChatTemplate, SFTLoader, tokenize_example
from ray_titan.data.tokenizer import ByteTokenizer
from ray_titan.models.registry import build_model
from ray_titan.trainer.build import cross_entropy_loss

TOK = ByteTokenizer()
# A Llama-3-like template: a header per message, an end-of-turn text, the assistant header as
# the generation prompt.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _text(ids, targets, want: bool) -> str:
    return TOK.decode([int(i) for i, t in zip(ids, targets) if t == want])


def test_prompt_response_counts_the_response_and_eos_only():
    data = Data(format="prompt_response")
    ids, targets = tokenize_example({"prompt": "2+2?", "response": " 4"}, data, TOK)
    assert ids[0] == TOK.bos_id and ids[-1] == TOK.eos_id
    assert _text(ids, targets, True) == " 4" and targets[-1]
    assert _text(ids, targets, False) == "2+2?" and not targets[0]


def test_messages_rendered_with_the_chat_template_count_assistant_turns(tmp_path):
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps({"chat_template": TEMPLATE, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    data = Data(format="messages", chat_template_path=str(path))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}]
    template = ChatTemplate(path)
    ids, targets = tokenize_example({"messages": messages}, data, TOK, template)
    assert TOK.decode(ids[1:].tolist()) == template.render(messages)  # the whole conversation, once
    assert _text(ids, targets, True) == "hello<|end|>\n4<|end|>\n"  # the assistant turns, not their headers
    with pytest.raises(ConfigError, match="no chat_template"):
        (tmp_path / "empty.json").write_text("{}")
        ChatTemplate(tmp_path / "empty.json")


def test_sft_loader_masks_prompt_labels_and_counts_the_global_batch(tmp_path):
    examples = pa.table({"prompt": [f"prompt {i} " * (i % 5 + 1) for i in range(40)],
                         "response": [f"answer {i}" * (i % 3 + 1) for i in range(40)]})
    data = Data(format="prompt_response")
    whole = SFTLoader(examples, TOK, data, 64, 8, seed=3)
    halves = [SFTLoader(examples, TOK, data, 64, 8, dp_rank=r, dp_degree=2, seed=3) for r in range(2)]
    inputs, labels = next(whole)
    assert inputs.min() >= 0 and inputs.max() < TOK.vocab_size  # no complemented id leaks out
    counted = labels != IGNORE_INDEX
    assert 0 < int(counted.sum()) < labels.numel() and whole.counted_tokens == int(counted.sum())
    # A label is counted exactly where the token it predicts is a response token or EOS.
    text = TOK.decode([int(t) for t in labels[counted]])
    assert "answer" in text and "prompt" not in text
    parts = [next(h) for h in halves]
    assert torch.equal(torch.cat([p[1] for p in parts]), labels)
    assert all(h.counted_tokens == whole.counted_tokens for h in halves)


def test_sft_sources_are_checked_before_workers(tmp_path, monkeypatch):
    from ray_titan.preflight.checks import validate_job

    pq.write_table(pa.table({"prompt": ["a"], "answer": ["b"]}), tmp_path / "x.parquet")
    cfg = JobConfig.from_dict({"data": {"source": "parquet", "path": str(tmp_path / "x.parquet"),
                                        "format": "prompt_response"}})
    with pytest.raises(ConfigError, match="data.response_column = 'response' is not a column"):
        validate_job(cfg)
    pq.write_table(pa.table({"messages": [[{"role": "user", "content": "a"}]]}), tmp_path / "m.parquet")
    cfg = JobConfig.from_dict({"data": {"source": "parquet", "path": str(tmp_path / "m.parquet"),
                                        "format": "messages"}})
    with pytest.raises(ConfigError, match="needs a chat template"):
        validate_job(cfg)


def test_document_positions_restart_at_each_bos():
    x = torch.tensor([[5, 6, 256, 7, 8, 9, 256, 1]])
    assert document_positions(x, 256).tolist() == [[0, 1, 0, 1, 2, 3, 0, 1]]


def test_packed_documents_compute_what_each_document_would_alone():
    """With document masks, the summed loss of a packed sequence is the sum of its documents'
    losses run alone (so its mean is their token-weighted mean); without, it is not."""
    model = build_model("llama", "debug", vocab_size=TOK.vocab_size)
    model.init_weights(0)
    with torch.no_grad():  # sharper attention than at initialisation, so that leaks show
        for name, p in model.named_parameters():
            if "attention.w" in name:
                p.mul_(8)
    rng = np.random.default_rng(0)
    docs = [np.concatenate(([TOK.bos_id], rng.integers(0, 256, n), [TOK.eos_id])) for n in (20, 35, 9, 30)]
    stream = torch.from_numpy(np.concatenate(docs))
    x, y = stream[None, :-1], stream[None, 1:]
    with torch.no_grad():
        packed = cross_entropy_loss(model(x, positions=document_positions(x, TOK.bos_id)), y, scale=1.0).item()
        unmasked = cross_entropy_loss(model(x), y, scale=1.0).item()
        alone, start = 0.0, 0
        for d in docs:
            end = min(start + len(d), x.shape[1])
            alone += cross_entropy_loss(model(x[:, start:end]), y[:, start:end], scale=1.0).item()
            start = end
    assert packed == pytest.approx(alone, rel=1e-5)
    assert abs(unmasked - alone) / alone > 1e-4  # ten times the tolerance above
