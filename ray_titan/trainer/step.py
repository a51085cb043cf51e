"""One training step on this rank: forward and backward, gradient clipping, optimizer, LR.

Under PP the pipeline schedule runs the microbatches through this rank's stages; without it the
microbatches are accumulated. Either way the gradients are of the mean loss over this rank's
batch, the norm is that of the whole model (every stage and shard), and the loss leaves the
step as a host float on last-stage ranks (docs/design.md, lesson 1): nothing of the step outlives it
on the device.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.profiler import record_function

from ray_titan.data.loader import IGNORE_INDEX
from ray_titan.parallel import local_tensor
from ray_titan.parallel.grad_norm import clip_grad_norm_
from ray_titan.trainer.build import TrainParts

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = ["StepResult", "microbatches", "model_kwargs", "run_schedule", "train_step"]


@dataclass
class StepResult:
    """What a step gives the loop: ``loss`` (nats per token, mean over this rank's microbatches;
    None off the last stage), ``grad_norm`` (whole model, before clipping), ``lr`` (the step's
    learning rate), ``skipped`` (its update was dropped, ``training.on_nonfinite = "skip"``),
    the MoE statistics (``aux_loss``, ``moe_layers``, ``expert_load``; see
    ``ray_titan.parallel.expert.MoEStepState.end_step``), and the seconds of forward/backward
    and of clipping plus the optimizer; ``loss_tokens``: with loss masks, the counted labels
    behind ``loss`` on this rank (None: every label counts)."""

    loss: float | None
    grad_norm: float
    lr: float
    skipped: bool
    aux_loss: float | None
    moe_layers: list[int]
    expert_load: list[list[int]]
    fwd_bwd_time_s: float
    optim_time_s: float
    loss_tokens: int | None = None


def _autocast(parts: TrainParts) -> contextlib.AbstractContextManager:
    """``torch.autocast`` in ``parts.autocast`` (a bf16 run without FSDP2), else nothing."""
    if parts.autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(parts.device.type, dtype=parts.autocast)


def model_kwargs(positions: torch.Tensor | None) -> dict[str, Any]:
    """The model's keyword arguments besides its input: ``positions`` where documents are masked."""
    return {} if positions is None else {"positions": positions}


def microbatches(inputs: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None,
                 n: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]:
    """``(inputs, labels, model keyword arguments)`` of each of ``n`` microbatches."""
    pos = positions.chunk(n) if positions is not None else [None] * n
    for x, y, p in zip(inputs.chunk(n), labels.chunk(n), pos):
        yield x, y, model_kwargs(p)


def train_step(parts: TrainParts, inputs: torch.Tensor, labels: torch.Tensor, step: int,
               n_microbatches: int, max_norm: float,
               counted_tokens: int | None = None, positions: torch.Tensor | None = None) -> StepResult:
    """Train one step on ``inputs`` and ``labels`` (``(local batch, seq)`` int64, this rank's
    data-parallel slice; under PP only the first stage reads ``inputs`` and the last ``labels``).

    Splits the batch into ``n_microbatches``, runs forward and backward (pipeline schedule or
    gradient accumulation, scaled once by ``1 / n_microbatches``), scales the routed experts'
    gradients under EP, clips to ``max_norm`` over the whole model (0: no clipping), applies the
    non-finite policy, steps the optimizer (unless the update is dropped; an update that makes a
    parameter non-finite is undone or stops the run, ``FaultHandler.check_update``) and the LR
    schedule.
    Raises what the collectives raise; the non-finite stop is raised later, by the loop
    (``FaultHandler.end_step``), after the step is reported.

    ``counted_tokens``: with loss masks (labels ``IGNORE_INDEX`` that count in no loss), the
    counted labels of the whole global batch. Then each microbatch's loss is its summed
    cross-entropy scaled so that the gradients are those of the mean over every counted label
    of the global batch (``cross_entropy_loss``), and the step's ``loss`` is this rank's mean
    over its counted labels (``loss_tokens`` of them), which the collector weights by that
    count. None (every label counts): the mean per microbatch, as always. ``positions``
    (``(local batch, seq)`` int64, ``training.document_mask``): each token's position within its
    document, given to every stage (block-causal attention, rotary positions per document).
    """
    t1 = time.perf_counter()
    parts.optimizer.zero_grad(set_to_none=True)
    loss: float | None
    if counted_tokens is None:
        # Named ranges in profiler traces (profiling.trace_steps); near free when not profiling.
        with record_function("ray_titan/forward_backward"):
            losses, total = _forward_backward(parts, inputs, labels, n_microbatches, positions, {})
        # Host float right away; the list (and its graph-free tensors) dies here.
        if losses is not None:
            loss = torch.stack(losses).mean().item() if losses else None
        else:
            loss = (total / n_microbatches).item() if total is not None else None
        return _update(parts, step, loss, max_norm, t1)
    # The schedule averages gradients over microbatches and FSDP (HSDP) over data-parallel ranks.
    scale = n_microbatches * parts.dims.dp / max(1, counted_tokens)
    with record_function("ray_titan/forward_backward"):
        losses, total = _forward_backward(parts, inputs, labels, n_microbatches, positions,
                                          {"scale": scale})
    summed = torch.stack(losses).sum() if losses else total
    mine = int((labels != IGNORE_INDEX).sum())
    # This rank's mean over its counted labels; 0 of 0 weighs nothing in the collector's mean.
    loss = None if summed is None else (summed.item() / scale / mine if mine else 0.0)
    return _update(parts, step, loss, max_norm, t1, mine)


def run_schedule(parts: TrainParts, inputs: torch.Tensor, labels: torch.Tensor,
                 positions: torch.Tensor | None, loss_kwargs: dict[str, Any], forward_only: bool = False
                 ) -> list[torch.Tensor] | None:
    """One pass of the pipeline schedule (``schedule.step``, or forward-only ``schedule.eval``)
    over this rank's stages; the last stage's per-microbatch losses (host-side tensors; under
    loss parallel the local value of each replicated loss), None on other ranks."""
    assert parts.schedule is not None
    is_last = parts.is_last_stage
    losses: list[torch.Tensor] | None = [] if is_last else None
    args = (inputs,) if parts.has_first_stage else ()
    with _autocast(parts), parts.loss_context():
        if forward_only:
            parts.schedule.eval(*args, target=labels if is_last else None, losses=losses,
                                loss_kwargs=loss_kwargs or None, **model_kwargs(positions))
        else:
            # return_outputs=False: otherwise the last stage keeps every microbatch's logits
            # (output_chunks) until the next step and concatenates them, for nothing.
            parts.schedule.step(*args, target=labels if is_last else None, losses=losses,
                                loss_kwargs=loss_kwargs or None, return_outputs=False, **model_kwargs(positions))
    return [local_tensor(x) for x in losses] if losses is not None else None


def _forward_backward(parts: TrainParts, inputs: torch.Tensor, labels: torch.Tensor, n_microbatches: int,
                      positions: torch.Tensor | None, loss_kwargs: dict[str, Any]
                      ) -> tuple[list[torch.Tensor] | None, torch.Tensor | None]:
    """Forward and backward of the step's microbatches: ``(the schedule's per-microbatch losses
    (PP; None off the last stage), None)``, or ``(None, the sum of the microbatch losses)``
    (gradient accumulation, the gradients then divided by the microbatch count)."""
    if parts.schedule is not None:
        return run_schedule(parts, inputs, labels, positions, loss_kwargs), None
    model = next(iter(parts.stages.values()))
    total = torch.zeros((), device=parts.device)
    for i, (x, y, kw) in enumerate(microbatches(inputs, labels, positions, n_microbatches)):
        if parts.dims.fsdp:
            cast("FSDPModule", model).set_requires_gradient_sync(i == n_microbatches - 1)
        with parts.loss_context():
            with _autocast(parts):
                mb_loss = parts.loss_fn(model(x, **kw), y, **loss_kwargs)
            mb_loss.backward()
        total += local_tensor(mb_loss.detach())
        del mb_loss
    # Accumulated, then scaled once, as the pipeline schedules do (scale_grads): the MoE
    # balance loss injects its gradient unscaled in every microbatch.
    if n_microbatches > 1:
        with torch.no_grad():
            for p in parts.params:
                if p.grad is not None:
                    p.grad.div_(n_microbatches)
    return None, total


def _update(parts: TrainParts, step: int, loss: float | None, max_norm: float, t1: float,
            loss_tokens: int | None = None) -> StepResult:
    """After backward: expert-gradient scaling, clipping, the non-finite policy, the optimizer
    and LR steps, the MoE statistics. ``t1``: when the step's forward began."""
    parts.moe.scale_expert_grads()
    exclude: list[torch.Tensor] = []
    if parts.tied is not None:
        parts.tied.sync_grads()
        exclude = parts.tied.norm_exclude
    t2 = time.perf_counter()
    with record_function("ray_titan/optimizer"):
        grad_norm = clip_grad_norm_(parts.params, max_norm, parts.pp_group, exclude).item()
        lr = float(parts.scheduler.get_last_lr()[0])  # typed float | Tensor; a float here
        skipped = parts.faults.check(step, loss, grad_norm, parts.params)  # training.on_nonfinite
        if not skipped:
            parts.faults.before_update(parts.params, parts.optimizer)
            parts.optimizer.step()
            skipped = parts.faults.check_update(step, parts.params, parts.optimizer)
        parts.scheduler.step()
    aux_loss, moe_layers, expert_load = parts.moe.end_step()
    t3 = time.perf_counter()
    return StepResult(loss, grad_norm, lr, skipped, aux_loss, moe_layers, expert_load, t2 - t1, t3 - t2,
                      loss_tokens)
