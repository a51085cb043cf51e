"""One training step on this rank: forward and backward, gradient clipping, optimizer, LR.

Under PP the pipeline schedule runs the microbatches through this rank's stages; without it the
microbatches are accumulated. Either way the gradients are of the mean loss over this rank's
batch, the norm is that of the whole model (every stage and shard), and the loss leaves the
step as a host float on last-stage ranks (DESIGN.md, lesson 1): nothing of the step outlives it
on the device.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch.profiler import record_function

from ray_titan.parallel import local_tensor
from ray_titan.parallel.grad_norm import clip_grad_norm_
from ray_titan.trainer.build import TrainParts

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = ["StepResult", "train_step"]


@dataclass
class StepResult:
    """What a step gives the loop: ``loss`` (nats per token, mean over this rank's microbatches;
    None off the last stage), ``grad_norm`` (whole model, before clipping), ``lr`` (the step's
    learning rate), ``skipped`` (its update was dropped, ``training.on_nonfinite = "skip"``),
    the MoE statistics (``aux_loss``, ``moe_layers``, ``expert_load``; see
    ``ray_titan.parallel.expert.MoEStepState.end_step``), and the seconds of forward/backward
    and of clipping plus the optimizer."""

    loss: float | None
    grad_norm: float
    lr: float
    skipped: bool
    aux_loss: float | None
    moe_layers: list[int]
    expert_load: list[list[int]]
    fwd_bwd_time_s: float
    optim_time_s: float


def _autocast(kind: str, device: torch.device) -> contextlib.AbstractContextManager:
    if kind == "none":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def _forward_backward(parts: TrainParts, inputs: torch.Tensor, labels: torch.Tensor, n_microbatches: int,
                      autocast: str) -> float | None:
    """Forward and backward of the step's microbatches; returns the mean loss on last-stage ranks
    (a host float), None elsewhere."""
    loss: float | None
    if parts.schedule is not None:
        is_last = parts.is_last_stage
        losses: list[torch.Tensor] | None = [] if is_last else None
        args = (inputs,) if parts.has_first_stage else ()
        with _autocast(autocast, parts.device), parts.loss_context():
            # return_outputs=False: otherwise the last stage keeps every microbatch's logits
            # (output_chunks) until the next step and concatenates them, for nothing.
            parts.schedule.step(*args, target=labels if is_last else None, losses=losses, return_outputs=False)
        # Host float right away; the list (and its graph-free tensors) dies here. Under loss
        # parallel each loss is a replicated DTensor: its local value is the loss.
        loss = torch.stack([local_tensor(x) for x in losses]).mean().item() if losses is not None else None
        del losses
    else:
        model = next(iter(parts.stages.values()))
        total = torch.zeros((), device=parts.device)
        for i, (x, y) in enumerate(zip(inputs.chunk(n_microbatches), labels.chunk(n_microbatches))):
            if parts.dims.fsdp:
                cast("FSDPModule", model).set_requires_gradient_sync(i == n_microbatches - 1)
            with parts.loss_context():
                with _autocast(autocast, parts.device):
                    mb_loss = parts.loss_fn(model(x), y)
                mb_loss.backward()
            total += local_tensor(mb_loss.detach())
        # Accumulated, then scaled once, as the pipeline schedules do (scale_grads): the MoE
        # balance loss injects its gradient unscaled in every microbatch.
        if n_microbatches > 1:
            with torch.no_grad():
                for p in parts.params:
                    if p.grad is not None:
                        p.grad.div_(n_microbatches)
        loss = (total / n_microbatches).item()
        del total, mb_loss
    return loss


def train_step(parts: TrainParts, inputs: torch.Tensor, labels: torch.Tensor, step: int,
               n_microbatches: int, max_norm: float, autocast: str = "none") -> StepResult:
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
    """
    t1 = time.perf_counter()
    parts.optimizer.zero_grad(set_to_none=True)
    # Named ranges in profiler traces (profiling.trace_steps); near free when not profiling.
    with record_function("ray_titan/forward_backward"):
        loss = _forward_backward(parts, inputs, labels, n_microbatches, autocast)
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
    return StepResult(loss, grad_norm, lr, skipped, aux_loss, moe_layers, expert_load, t2 - t1, t3 - t2)
