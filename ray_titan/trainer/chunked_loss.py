"""Cross-entropy over chunks of tokens (``training.loss_chunk_tokens``): the output head and the
loss, a chunk at a time, so that only one chunk's logits and their gradient are live.

The plain loss (``ray_titan.trainer.build.cross_entropy_loss``) takes the whole microbatch's
logits ``(batch, seq, vocab)``: the head's output, its fp32 copy, the log-softmax autograd keeps
for backward, and in backward the log-softmax's and the logits' fp32 gradients, each ``tokens ×
vocab``: 7.8 GiB apiece for 2 × 8192 tokens of Llama 3's 128256-token vocabulary. Here the last
stage returns its final-normed hidden states (``Decoder.hidden_out``) and :class:`ChunkedCrossEntropy`
applies the head (``Decoder.logits``) to ``chunk`` tokens at a time, each chunk's head and
cross-entropy under non-reentrant activation checkpointing (``torch.utils.checkpoint``): forward
keeps only the chunk's loss, backward recomputes the chunk's logits, takes their gradient, and
frees them before the next chunk's (autograd runs the later chunk's nodes first: their sequence
numbers are higher). The price is the head's forward matmul once more (about a third of the
head's FLOPs, ~2 % of Llama 3.1 8B's step).

The head is called as the module it is, inside the model's FSDP2 root unit, which does not
reshard after forward (``ray_titan.parallel.fsdp.apply_fsdp``): its weight is the unsharded one
from the forward through the backward, and FSDP2 reduce-scatters the gradient that the chunks
accumulate in it as it would the plain head's. Under tensor parallel with loss parallel the head's
``ColwiseParallel`` plan gives each chunk's logits as ``Shard(-1)`` ``DTensor`` and the chunk's
cross-entropy runs under ``loss_parallel`` (the step's ``loss_context``, in backward too).
The design is that of per-chunk recomputation (as torchtitan's and Liger-Kernel's chunked losses
trade memory for recompute); nothing is copied from them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from ray_titan.data.loader import IGNORE_INDEX

__all__ = ["ChunkedCrossEntropy"]


def _chunk_loss(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy (nats, fp32) of one chunk: ``hidden (tokens, dim)``, ``labels
    (tokens,)`` int64; :data:`IGNORE_INDEX` labels count nothing."""
    return F.cross_entropy(head(hidden).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


class ChunkedCrossEntropy:
    """The loss ``cross_entropy_loss`` computes, from final-normed hidden states.

    ``head``: the last stage's output head (``Decoder.logits``: ``(tokens, dim)`` to ``(tokens,
    vocab)``); ``chunk``: tokens per chunk (> 0). Called as ``loss(hidden, labels, scale=None)``
    with ``hidden (batch, seq, dim)`` (a plain tensor, or a ``DTensor`` under tensor parallel,
    made replicated first: the head's input would be all-gathered anyway) and ``labels (batch,
    seq)`` int64. ``scale`` None: the mean over the counted labels (not :data:`IGNORE_INDEX`; every
    one without loss masks), as ``F.cross_entropy``'s mean; otherwise the sum over them times
    ``scale`` (the SFT loss masks' scaling, ``cross_entropy_loss``). Returns a 0-dim fp32 tensor
    (a replicated ``DTensor`` under loss parallel). Values and gradients are the plain loss's up
    to the order of fp32 sums (tests/unit/test_chunked_loss.py).
    """

    def __init__(self, head: Callable[[torch.Tensor], torch.Tensor], chunk: int):
        if chunk <= 0:
            raise ValueError(f"chunk = {chunk}: tokens per chunk must be positive")
        self.head, self.chunk = head, chunk

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        if isinstance(hidden, DTensor) and any(not p.is_replicate() for p in hidden.placements):
            hidden = hidden.redistribute(hidden.device_mesh, [Replicate()] * hidden.device_mesh.ndim)
        flat, targets = hidden.flatten(0, 1), labels.flatten(0, 1)
        total: torch.Tensor | None = None
        for h, y in zip(flat.split(self.chunk), targets.split(self.chunk)):
            if torch.is_grad_enabled():
                # The whole chunk is recomputed, without checkpoint's early stop: that stop is an
                # exception raised from a saved-tensor hook inside the recomputed
                # cross_entropy_loss, and with CUDA's memory history recording
                # (memory.snapshot_steps) that call failed as "SystemError: ... returned NULL
                # without setting an exception" (torch 2.11, an H200; the same run without the
                # recording passed). The early stop is the suspect, not yet confirmed on a GPU;
                # it would save only the loss's last reduction.
                with set_checkpoint_early_stop(False):
                    part = checkpoint(_chunk_loss, self.head, h, y, use_reentrant=False, preserve_rng_state=False)
            else:
                part = _chunk_loss(self.head, h, y)
            total = part if total is None else total + part
        assert total is not None  # at least one token
        if scale is not None:
            return total * scale
        counted = (targets != IGNORE_INDEX).sum()
        if isinstance(total, DTensor):
            counted = DTensor.from_local(counted, total.device_mesh, total.placements, run_check=False)
        return total / counted
