"""Activation checkpointing of transformer blocks (docs/design.md, lesson 3).

Modes (``[activation_checkpoint]``):

- ``none``: every block keeps its activations from forward to backward.
- ``full``: every block keeps only its input and recomputes its forward in backward
  (``torch.utils.checkpoint``, non-reentrant). Activation memory of a stage falls to about one
  block's worth plus the block inputs, for about one extra forward of compute.
- ``selective`` / ``layer``: full checkpointing of every ``layer_freq``-th block (by its index
  in the whole model, so the choice is the same whatever the pipeline split).
- ``selective`` / ``op``: every block saves the outputs of its matrix multiplications and of
  attention (the expensive ops) and recomputes the rest (norms, rotary embeddings, SiLU,
  products, casts) — op-level selective activation checkpointing
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``; Korthikanti et al. 2022,
  arXiv:2205.05198, for the idea of recomputing the cheap, memory-heavy ops).

The block is checkpointed by replacing its ``forward`` on the instance, not by wrapping it in
another module: parameter names stay those of the whole model (the weights are initialised from
their names, and checkpoints are keyed by them). Apply before FSDP2, which then runs its
unshard hooks around the checkpointed forward and the recomputation happens inside backward
after FSDP2's pre-backward unshard, as with torchtitan's ordering (AC, then FSDP).
"""

from __future__ import annotations

import functools
from typing import cast

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["SAVED_OPS", "apply_ac"]

_aten = torch.ops.aten
SAVED_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}
"""Ops whose outputs op-level selective AC saves; every other op in a block is recomputed."""
if hasattr(_aten, "_scaled_dot_product_cudnn_attention"):
    SAVED_OPS.add(_aten._scaled_dot_product_cudnn_attention.default)


def _op_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _op_context():
    return create_selective_checkpoint_contexts(_op_policy)


def _checkpoint_forward(block: nn.Module, context_fn=None) -> None:
    inner = block.forward  # the bound method of the class, captured before replacing it

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        extra = {"context_fn": context_fn} if context_fn is not None else {}
        return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)

    block.forward = forward


def apply_ac(model: nn.Module, mode: str, selective_option: str = "op", layer_freq: int = 2) -> list[str]:
    """Checkpoint the blocks of ``model.layers`` (a ``ModuleDict`` keyed by the layer's index in
    the whole model) in place, per ``mode`` (``none`` / ``full`` / ``selective``) and, for
    ``selective``, ``selective_option`` (``op`` / ``layer``) and ``layer_freq``. Returns the
    keys of the checkpointed blocks. Raises ``ValueError`` for an unknown mode or option."""
    if mode == "none":
        return []
    if mode not in ("full", "selective"):
        raise ValueError(f"activation_checkpoint.mode = {mode!r}; valid: 'none', 'full', 'selective'")
    if mode == "selective" and selective_option not in ("op", "layer"):
        raise ValueError(f"activation_checkpoint.selective_option = {selective_option!r}; valid: 'op', 'layer'")
    done = []
    for key, block in cast(nn.ModuleDict, model.layers).items():
        if mode == "selective" and selective_option == "layer" and int(key) % layer_freq:
            continue
        op_level = mode == "selective" and selective_option == "op"
        _checkpoint_forward(block, _op_context if op_level else None)
        done.append(key)
    return done
