"""Data: tokenizers (tokenizer.py), corpus sources (corpus.py: the built-in corpus, Parquet, JSON
Lines), packing into fixed-length sequences with per-data-parallel-rank slicing (loader.py),
which documents train and validate (build.py, holdout.py), supervised fine-tuning examples with
loss masks (sft.py), weighted mixtures (mixing.py), streams from Ray Data (ray_data.py), and
document positions for document masks (documents.py)."""
