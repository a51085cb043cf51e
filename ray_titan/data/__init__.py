"""Data: tokenizers, corpus sources, packing into sequences and per-DP-rank loading."""
