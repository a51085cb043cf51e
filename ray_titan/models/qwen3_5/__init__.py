"""The Qwen3.5 family (dense): Gated DeltaNet linear attention (``delta_rule``) and gated full attention."""
