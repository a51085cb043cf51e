"""Validation: the loss of held-out batches, forward only, with no gradient.

:func:`eval_step` mirrors :func:`~ray_titan.trainer.step.train_step`: under PP it runs the
pipeline schedule's forward-only evaluation (``schedule.eval``) through this rank's stages, else
the microbatches one by one; every rank of the mesh takes part (pipeline sends, FSDP gathers,
expert all-to-alls). Nothing it does reaches training: no gradient is made, no optimizer, LR or
data state moves, and the MoE routers' counts of the evaluated tokens are dropped, so the
training losses are bit-identical with validation on or off (``tests/integration/test_validation.py``).

:class:`Validator` decides when to evaluate and reads the same validation batches every time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ray_titan.config.schema import JobConfig
from ray_titan.data.build import build_validation_loader, validation_documents
from ray_titan.data.documents import document_positions
from ray_titan.data.loader import IGNORE_INDEX
from ray_titan.data.tokenizer import Tokenizer
from ray_titan.parallel import local_tensor
from ray_titan.parallel.context import shard_batch
from ray_titan.trainer.build import TrainParts
from ray_titan.trainer.step import _autocast, microbatches, run_schedule

__all__ = ["EvalResult", "Validator", "eval_step"]


@dataclass
class EvalResult:
    """One evaluation on this rank: ``loss`` (nats per counted token, mean over this rank's
    validation tokens; None off the last stage), ``tokens`` (counted label tokens of this rank's
    data-parallel slice), ``time_s`` (seconds)."""

    loss: float | None
    tokens: int
    time_s: float


@torch.no_grad()
def eval_step(parts: TrainParts, inputs: torch.Tensor, labels: torch.Tensor, n_microbatches: int,
              positions: torch.Tensor | None = None) -> float | None:
    """The summed cross-entropy (nats) of the counted labels of ``inputs``/``labels`` (``(local
    batch, seq)`` int64, the training step's shape) on last-stage ranks, None elsewhere.
    ``positions``: as :func:`~ray_titan.trainer.step.train_step`'s. Collective: every rank of the
    mesh calls it with its slice. Under context parallelism this cp rank evaluates its share of
    the sequences and the sum is reduced over the cp group (that of the data-parallel rank)."""
    total: float | None
    if parts.dims.cp > 1:
        inputs, labels, positions = shard_batch(parts.dims.cp, parts.coords["cp"], inputs, labels, positions)
    if parts.schedule is not None:
        losses = run_schedule(parts, inputs, labels, positions, {"scale": 1.0}, forward_only=True)
        total = torch.stack(losses).sum().item() if losses is not None else None
        del losses
    else:
        model = next(iter(parts.stages.values()))
        acc = torch.zeros((), device=parts.device)
        for x, y, kw in microbatches(inputs, labels, positions, n_microbatches):
            with parts.loss_context(), _autocast(parts):
                acc += local_tensor(parts.loss_fn(model(x, **kw), y, scale=1.0))
        total = acc.item()
    if parts.dims.cp > 1 and total is not None:
        assert parts.meshes is not None
        summed = torch.tensor([total], dtype=torch.float64, device=parts.device)
        torch.distributed.all_reduce(summed, group=parts.meshes["cp"].get_group())
        total = float(summed.item())
    parts.moe.reset()  # the routers counted the evaluated tokens: not the step's load
    return total


class Validator:
    """Evaluates ``validation.steps`` batches every ``validation.freq`` steps and after the last.

    Each evaluation reads the validation documents from the start (a fresh loader), so
    successive losses are of the same batches. ``dp_rank``/``dp_degree`` as the training
    loader's. Raises ``ValueError`` when the validation batch is not a multiple of the training
    batch (the pre-flight checks refuse that first).
    """

    def __init__(self, cfg: JobConfig, tokenizer: Tokenizer, dp_rank: int, dp_degree: int):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        batch = cfg.validation.batch_size or cfg.training.global_batch_size
        if batch % cfg.training.global_batch_size:
            raise ValueError(f"validation.batch_size = {batch} is not a multiple of training.global_batch_size "
                             f"= {cfg.training.global_batch_size}")
        self.chunks = batch // cfg.training.global_batch_size
        self.docs = validation_documents(cfg)

    def due(self, step: int) -> bool:
        v = self.cfg.validation
        return v.enable and (step % v.freq == 0 or step == self.cfg.training.steps)

    def run(self, parts: TrainParts) -> EvalResult:
        """Evaluate on this rank (collective: every rank calls it at the same step)."""
        t0 = time.perf_counter()
        loader = build_validation_loader(self.cfg, self.docs, self.tokenizer, self.dp_rank, self.dp_degree)
        total, tokens = 0.0, 0
        for _ in range(self.cfg.validation.steps):
            inputs, labels = next(loader)
            tokens += int((labels != IGNORE_INDEX).sum())
            positions = document_positions(inputs, self.tokenizer.bos_id) if self.cfg.training.document_mask else None
            for x, y, kw in microbatches(inputs, labels, positions, self.chunks):
                s = eval_step(parts, x.to(parts.device), y.to(parts.device), self.cfg.parallelism.microbatches,
                              kw["positions"].to(parts.device) if kw else None)
                total += s if s is not None else 0.0
        if parts.infer_shapes is not None:
            # Back to training mode now, not in the next step: its shape inference would feed
            # phantom tokens to the MoE routers (ray_titan.trainer.build.infer_pipeline_shapes).
            parts.infer_shapes()
        loss = total / tokens if parts.is_last_stage and tokens else None
        return EvalResult(loss, tokens, time.perf_counter() - t0)
