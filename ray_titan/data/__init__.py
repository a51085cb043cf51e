"""Data: tokenizers (tokenizer.py), corpus sources (corpus.py: the built-in corpus, Parquet, JSON
Lines), and packing into fixed-length sequences with per-data-parallel-rank slicing (loader.py)."""
