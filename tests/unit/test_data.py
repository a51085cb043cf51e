"""Tokenizers, corpus sources and packing (no Ray)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ray_titan.config.schema import ConfigError, Data
from ray_titan.data.corpus import check_source, load_texts, materialize_python_stdlib
from ray_titan.data.loader import PackedLoader
from ray_titan.data.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'π' * x\n"
    ids = tok.encode(text)
    assert ids.dtype == np.int64 and ids.max() < 256 and tok.vocab_size == 258
    assert tok.decode(ids.tolist()) == text
    assert (tok.bos_id, tok.eos_id) == (256, 257)


def test_huggingface_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    hf.train_from_iterator(["def add(a, b):\n    return a + b\n"] * 50, trainer=trainer)
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer("huggingface", str(tmp_path / "tokenizer.json"))
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    ids = tok.encode("def add(a, b):")
    assert len(ids) < len("def add(a, b):") and ids.max() < tok.vocab_size
    with pytest.raises(FileNotFoundError, match="tokenizer_path"):
        build_tokenizer("huggingface", str(tmp_path / "missing.json"))


def test_python_stdlib_corpus_is_real_and_cached(tmp_path):
    out = materialize_python_stdlib(tmp_path)
    shards = sorted(out.glob("*.parquet"))
    assert len(shards) >= 2
    texts = load_texts(Data(cache_dir=str(tmp_path)))
    total = sum(len(t) for t in texts.to_pylist())
    assert 8e6 < total < 40e6  # ~12 MB of standard-library source on CPython 3.11
    assert any("def " in t for t in texts.to_pylist()[:50])
    mtime = shards[0].stat().st_mtime_ns
    assert materialize_python_stdlib(tmp_path) == out and shards[0].stat().st_mtime_ns == mtime


def test_a_corpus_cache_that_cannot_be_written_is_a_config_error_naming_it(tmp_path):
    """Issue 44, finding 1's train side: an unwritable cache gave "training failed: OSError"
    from the workers. Pre-flight's check_source now names the setting (a file where the cache
    directory would be: root ignores a read-only mode, a path through a file it cannot)."""
    (tmp_path / "a_file").write_text("")
    where = tmp_path / "a_file" / "cache"
    with pytest.raises(ConfigError, match=r"data.cache_dir = '.*a_file/cache'.*cannot write there: Not a directory"):
        check_source(Data(cache_dir=str(where)))


def test_parquet_and_jsonl_sources(tmp_path):
    pq.write_table(pa.table({"text": ["alpha", None, "beta"], "id": [1, 2, 3]}), tmp_path / "a.parquet")
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "b.jsonl").write_text("\n".join(json.dumps({"body": t}) for t in ["x", "y"]) + "\n")
    p = Data(source="parquet", path=str(tmp_path / "a.parquet"))
    check_source(p)
    assert load_texts(p).to_pylist() == ["alpha", "beta"]
    j = Data(source="jsonl", path=str(tmp_path / "j"), text_column="body")
    check_source(j)
    assert load_texts(j).to_pylist() == ["x", "y"]
    with pytest.raises(ConfigError, match=r"'text' is not a column .* \['body'\]"):
        check_source(Data(source="jsonl", path=str(tmp_path / "j")))
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    with pytest.raises(ConfigError, match="has type int64, not string"):
        check_source(Data(source="parquet", path=str(tmp_path / "ints.parquet")))


def _docs(n: int = 200) -> pa.ChunkedArray:
    rng = np.random.default_rng(0)
    return pa.chunked_array([[f"doc {i} " + "x" * int(rng.integers(1, 300)) for i in range(n)]])


def test_dp_ranks_read_disjoint_parts_whose_union_is_the_one_rank_batch():
    tok = ByteTokenizer()
    one = PackedLoader(_docs(), tok, seq_len=32, global_batch_size=8, seed=5)
    ranks = [PackedLoader(_docs(), tok, 32, 8, dp_rank=r, dp_degree=4, seed=5) for r in range(4)]
    for _ in range(30):  # crosses an epoch boundary (200 short docs)
        x, y = next(one)
        parts = [next(r) for r in ranks]
        assert all(p[0].shape == (2, 32) for p in parts)
        torch.testing.assert_close(torch.cat([p[0] for p in parts]), x, rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([p[1] for p in parts]), y, rtol=0, atol=0)
        torch.testing.assert_close(x[:, 1:], y[:, :-1], rtol=0, atol=0)


def test_packing_uses_every_token_once_with_bos_and_eos():
    tok = ByteTokenizer()
    docs = _docs(20)
    loader = PackedLoader(docs, tok, seq_len=15, global_batch_size=2, seed=1)
    stream = np.concatenate([torch.cat([x, y[:, -1:]], dim=1).flatten().numpy()
                             for x, y in (next(loader) for _ in range(40))])
    order = np.random.default_rng([1, 0]).permutation(20)
    expected = np.concatenate([np.concatenate(([256], tok.encode(docs[int(i)].as_py()), [257])) for i in order])
    n = min(len(stream), len(expected))
    assert n > 1000 and np.array_equal(stream[:n], expected[:n])


def test_order_is_deterministic_from_the_seed_and_resumable():
    tok = ByteTokenizer()
    a, b, c = (PackedLoader(_docs(), tok, 16, 4, seed=s) for s in (3, 3, 4))
    xa, xb, xc = next(a)[0], next(b)[0], next(c)[0]
    assert torch.equal(xa, xb) and not torch.equal(xa, xc)
    for _ in range(40):
        next(a)
    state = a.state_dict()
    resumed = PackedLoader(_docs(), tok, 16, 4, seed=3)
    resumed.load_state_dict(state)
    for _ in range(60):
        assert torch.equal(next(a)[0], next(resumed)[0])


def test_a_long_document_reads_from_jsonl_and_parquet_and_the_position_stays_three_integers(tmp_path):
    """A 3 MiB one-line document (pyarrow's JSON blocks are 1 MiB): read whole from JSON Lines and
    Parquet; the loader's position inside it is (epoch, document, offset), and a loader resumed
    there continues the same stream token for token."""
    long = "".join(chr(97 + i % 26) for i in range(3 << 20))
    texts = ["short one", long, "short two"]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    pq.write_table(pa.table({"text": texts}), tmp_path / "d.parquet")
    for source in ("jsonl", "parquet"):
        data = Data(source=source, path=str(tmp_path / f"d.{source}"))
        check_source(data)
        assert load_texts(data).to_pylist() == texts
    tok = ByteTokenizer()
    loader = PackedLoader(load_texts(data), tok, seq_len=255, global_batch_size=8, seed=0)
    for _ in range(300):  # 300 × 8 × 256 tokens: well inside the long document
        next(loader)
    state = loader.state_dict()
    assert set(state) == {"epoch", "doc_pos", "offset"} and all(type(v) is int for v in state.values())
    assert loader.texts[int(loader._order[state["doc_pos"]])].as_py() == long and state["offset"] > 0
    resumed = PackedLoader(load_texts(data), tok, seq_len=255, global_batch_size=8, seed=0)
    resumed.load_state_dict(state)
    for _ in range(1600):  # to the end of the long document, the next epoch included
        assert torch.equal(next(loader)[0], next(resumed)[0])
    assert loader.epoch >= 1


def test_data_that_cannot_train_is_refused(tmp_path):
    from ray_titan.config import load_config
    from ray_titan.preflight.checks import validate_job

    pq.write_table(pa.table({"text": ["", "", ""]}), tmp_path / "empty.parquet")
    pq.write_table(pa.table({"text": pa.array([None, None], pa.string())}), tmp_path / "null.parquet")
    (tmp_path / "null.jsonl").write_text('{"text": null}\n{"text": null}\n')
    for name, message in [
        ("empty.parquet", r"data.text_column = 'text' is empty or null in all 3 rows of data.path = .*empty.parquet"),
        ("null.parquet", r"data.text_column = 'text' is empty or null in all 2 rows"),
        ("null.jsonl", r"data.text_column = 'text' in .*null.jsonl' has type null, not string"),
    ]:
        with pytest.raises(ConfigError, match=message):
            check_source(Data(source=name.split(".")[1], path=str(tmp_path / name)))
    # A tokenizer whose ids leave gaps: id 50 in a vocabulary it reports as 7 ids (the embedding's rows).
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<s>": 2, "</s>": 3, "[UNK]": 4, "zz": 50}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    cfg = load_config(None, ["--data.source=parquet", f"--data.path={tmp_path / 'ok.parquet'}",
                             "--data.tokenizer=huggingface", f"--data.tokenizer_path={tmp_path / 'tokenizer.json'}"])
    pq.write_table(pa.table({"text": ["a b zz"]}), tmp_path / "ok.parquet")
    with pytest.raises(ConfigError, match=r"data.tokenizer_path = .*tokenizer.json': the tokenizer has token id 50 "
                                          r"but reports a vocabulary of 6 \(ids 0 .. 5\)"):
        validate_job(cfg)
