"""What autograd saves for backward, measured: the check of the memory plan's block formulas."""

from __future__ import annotations

import torch


def saved_bytes(block: torch.nn.Module, *inputs: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves in one forward of ``block(*inputs)``, its
    parameters and buffers and every input but the first (the rotary tables) left out."""
    skip = {t.untyped_storage().data_ptr() for t in (*block.parameters(), *block.buffers(), *inputs[1:])}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(*inputs)
    return sum(seen.values())


def logits_and_floor(ref, model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(transformers' logits, ray_titan's, transformers' own eager-vs-SDPA difference)`` for
    ``tokens``, without gradients; prints the differences."""
    with torch.no_grad():
        want = ref(tokens).logits
        got = model(tokens)
        ref.config._attn_implementation = "eager"
        floor = (ref(tokens).logits - want).abs().max().item()
        ref.config._attn_implementation = "sdpa"
    print(f"max |logit difference| = {(got - want).abs().max().item():.2e}; transformers eager vs SDPA "
          f"{floor:.2e} (logits up to {want.abs().max():.1f})")
    return want, got, floor
