"""Where documents start in packed sequences (``training.document_mask``)."""

from __future__ import annotations

import torch

__all__ = ["document_positions"]


def document_positions(inputs: torch.Tensor, bos_id: int) -> torch.Tensor:
    """Each token's position within its document: ``inputs (batch, seq)`` int64 token ids, a
    document starting at each BOS (the packer puts one before every document) and at the start
    of each row (the rest of a document cut at the previous row's end). Returns ``(batch, seq)``
    int64, 0 at every document's first token. As torchtitan finds its documents from their
    delimiter tokens."""
    seq = inputs.shape[1]
    index = torch.arange(seq, device=inputs.device).expand_as(inputs)
    starts = (inputs == bos_id)
    starts[:, 0] = True
    last_start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - last_start
