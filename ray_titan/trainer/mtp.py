"""Multi-token prediction's loss (DeepSeek-V3, arXiv:2412.19437 §2.2.2): the labels of each depth
and the objective ``main + λ × mean of the depths' losses``.

The model's last stage returns ``(logits, depth 1's logits, ..., depth D's)`` when it is given the
input ids (``ray_titan.models.deepseek_v2.model.DeepSeekV2``); the step passes it the labels of
every depth stacked, ``(batch, seq, 1 + D)`` (:func:`mtp_labels`), so that they travel as one
target through the pipeline schedule, whose loss is :class:`MtpLoss` around the trainer's loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ray_titan.data.loader import IGNORE_INDEX
from ray_titan.parallel import local_tensor

__all__ = ["MtpLoss", "mtp_labels"]


def mtp_labels(labels: torch.Tensor, positions: torch.Tensor | None, depths: int) -> torch.Tensor:
    """The labels of the main model and of each MTP depth, ``(batch, seq, 1 + depths)`` int64
    from ``labels (batch, seq)`` (``labels[:, i]`` is token ``i + 1``). Depth ``k``'s label at
    position ``i`` is ``labels[:, i + k]`` (token ``i + k + 1``, DeepSeek-V3 eq. 23), or
    :data:`IGNORE_INDEX` where ``i + k`` is past the sequence or, with ``positions (batch, seq)``
    (each token's position in its document, ``training.document_mask``), where tokens ``i`` and
    ``i + k`` are not in the same document (``positions[i + k] != positions[i] + k``): a depth
    never predicts across a document boundary (torchtitan's ``roll_mtp_sequence`` rule).
    A label the main loss ignores is ignored at every depth it reaches."""
    seq = labels.shape[1]
    out = labels.new_full((*labels.shape, 1 + depths), IGNORE_INDEX)
    out[..., 0] = labels
    for k in range(1, min(depths, seq - 1) + 1):
        shifted = labels[:, k:]
        if positions is not None:
            same_doc = positions[:, k:] == positions[:, :-k] + k
            shifted = torch.where(same_doc, shifted, IGNORE_INDEX)
        out[:, :seq - k, k] = shifted
    return out


class MtpLoss:
    """The loss with multi-token prediction: ``fn(logits, labels[..., 0]) + weight × mean_k
    fn(depth k's logits, labels[..., k])`` (DeepSeek-V3 eq. 24–25: ``L_MTP = λ/D Σ_k L_k``).

    ``fn(logits (batch, seq, vocab), labels (batch, seq), scale=None, **kwargs)`` is the trainer's
    loss (``ray_titan.trainer.build.cross_entropy_loss``; 0-dim). Without loss masks (``fn``'s
    mean over every label) a depth's loss is its cross-entropy summed over its labels and divided
    by the tokens ``batch × seq``, DeepSeek-V3's ``L_k = -1/T Σ log P`` (eq. 24), whatever the
    labels the depth loses at the sequence's and the documents' ends: so it is also the same
    whatever the split of the batch into microbatches and data-parallel ranks. Under loss masks
    (``scale``) each depth's is its scaled sum, scaled as the main loss by the main labels' count
    (torchtitan's ``global_valid_tokens``). ``output``: the
    model's tuple, or its logits alone (validation, the schedule's shape inference), which get
    ``fn`` of the main labels only. Each call keeps its main and per-depth losses (detached),
    which :meth:`take` sums and hands over once per step, for the metrics (on the device: no
    sync)."""

    def __init__(self, fn: Callable[..., torch.Tensor], weight: float, depths: int):
        self.fn = fn
        self.weight = weight
        self.depths = depths
        self._kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, output: Any, target: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if isinstance(output, torch.Tensor):
            return self.fn(output, target if target.dim() == 2 else target[..., 0], **kwargs)
        main = self.fn(output[0], target[..., 0], **kwargs)
        # Every label counts in the main loss (no scale): a depth's summed over its labels and
        # divided by the tokens, as DeepSeek-V3's 1/T (eq. 24), not by its own count.
        depth_kw = kwargs if "scale" in kwargs else {**kwargs, "scale": 1.0 / target[..., 0].numel()}
        depth = torch.stack([self.fn(o, target[..., k], **depth_kw) for k, o in enumerate(output[1:], 1)])
        self._kept.append((local_tensor(main.detach()), local_tensor(depth.detach())))
        return main + self.weight * depth.mean()

    def take(self, microbatches: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(main losses summed (0-dim), each depth's summed (depths,))`` over the last
        ``microbatches`` calls, the step's, then all calls are forgotten; None when nothing was
        computed here (not the last stage). Only the last ones: a pipeline schedule that infers
        its stages' shapes again inside a step (torch 2.13 does after an ``eval``) calls the
        loss once more, on its first microbatch, before the step's own calls."""
        if not self._kept:
            return None
        kept, self._kept = self._kept[-microbatches:], []
        return torch.stack([m for m, _ in kept]).sum(), torch.stack([d for _, d in kept]).sum(0)
