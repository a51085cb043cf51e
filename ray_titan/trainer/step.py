"""One training step on this rank: forward and backward, gradient clipping, optimizer, LR.

Under PP the pipeline schedule runs the microbatches through this rank's stages; without it the
microbatches are accumulated. Either way the gradients are of the mean loss over this rank's
batch, the norm is that of the whole model (every stage and shard), and the loss leaves the
step as a host float on last-stage ranks (docs/design.md, lesson 1): nothing of the step outlives it
on the device.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.profiler import record_function

from ray_titan.data.loader import IGNORE_INDEX
from ray_titan.parallel import local_tensor
from ray_titan.parallel.context import shard_batch
from ray_titan.parallel.finite import nonfinite_flag
from ray_titan.parallel.grad_norm import clip_grad_norm_
from ray_titan.trainer.build import TrainParts
from ray_titan.trainer.mtp import mtp_labels
from ray_titan.trainer.nonfinite import StepHealth

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = ["StepResult", "microbatches", "model_kwargs", "run_schedule", "train_step"]


@dataclass
class StepResult:
    """What a step gives the loop: ``loss`` (nats per token, mean over this rank's microbatches;
    None off the last stage), ``grad_norm`` (whole model, before clipping), ``lr`` (the step's
    learning rate), ``health`` (the facts the non-finite policy decides on:
    ``ray_titan.trainer.nonfinite``), the MoE statistics (``aux_loss``, ``moe_layers``,
    ``expert_load``; see ``ray_titan.parallel.expert.MoEStepScalars.read``), and the seconds of
    forward/backward and of clipping plus the optimizer; ``loss_tokens``: with loss masks, the
    counted labels behind ``loss`` on this rank (None: every label counts); ``mtp_losses``: under
    ``model.mtp_layers``, each multi-token-prediction depth's loss, normalised as ``loss`` is
    (``loss`` is then the main next-token loss alone; None off the last stage or without MTP)."""

    loss: float | None
    grad_norm: float
    lr: float
    health: StepHealth
    aux_loss: float | None
    moe_layers: list[int]
    expert_load: list[list[int]]
    fwd_bwd_time_s: float
    optim_time_s: float
    loss_tokens: int | None = None
    mtp_losses: list[float] | None = None


def _autocast(parts: TrainParts) -> contextlib.AbstractContextManager:
    """``torch.autocast`` in ``parts.autocast`` (a bf16 run without FSDP2), else nothing."""
    if parts.autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(parts.device.type, dtype=parts.autocast)


def model_kwargs(positions: torch.Tensor | None, tokens: torch.Tensor | None = None) -> dict[str, Any]:
    """The model's keyword arguments besides its input: ``positions`` where documents are masked,
    ``tokens`` (the input ids, which every pipeline stage then receives) for multi-token prediction."""
    return ({} if positions is None else {"positions": positions}) | ({} if tokens is None else {"tokens": tokens})


def microbatches(inputs: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None,
                 n: int, tokens: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]:
    """``(inputs, labels, model keyword arguments)`` of each of ``n`` microbatches (``tokens``:
    the inputs as the model's ``tokens`` too, for multi-token prediction)."""
    pos = positions.chunk(n) if positions is not None else [None] * n
    for x, y, p in zip(inputs.chunk(n), labels.chunk(n), pos):
        yield x, y, model_kwargs(p, x if tokens else None)


def train_step(parts: TrainParts, inputs: torch.Tensor, labels: torch.Tensor, step: int,
               n_microbatches: int, max_norm: float,
               counted_tokens: int | None = None, positions: torch.Tensor | None = None) -> StepResult:
    """Train one step on ``inputs`` and ``labels`` (``(local batch, seq)`` int64, this rank's
    data-parallel slice; under PP only the first stage reads ``inputs`` and the last ``labels``).

    Splits the batch into ``n_microbatches``, runs forward and backward (pipeline schedule or
    gradient accumulation, scaled once by ``1 / n_microbatches``), scales the routed experts'
    gradients under EP, clips to ``max_norm`` over the whole model (0: no clipping), steps the
    optimizer unless the loss or the gradient norm is non-finite (then the update is withheld)
    and the LR schedule, and gathers the facts of the step (``StepResult.health``): the caller
    decides on them (``ray_titan.trainer.nonfinite``) and acts, undoing an update that made a
    parameter non-finite (from ``parts.backup``, saved here) or stopping the run.
    Raises what the collectives raise.

    ``counted_tokens``: with loss masks (labels ``IGNORE_INDEX`` that count in no loss), the
    counted labels of the whole global batch. Then each microbatch's loss is its summed
    cross-entropy scaled so that the gradients are those of the mean over every counted label
    of the global batch (``cross_entropy_loss``), and the step's ``loss`` is this rank's mean
    over its counted labels (``loss_tokens`` of them), which the collector weights by that
    count. None (every label counts): the mean per microbatch, as always. ``positions``
    (``(local batch, seq)`` int64, ``training.document_mask``): each token's position within its
    document, given to every stage (block-causal attention, rotary positions per document).
    Under multi-token prediction (``parts.mtp``) the labels of every depth go to the loss
    (``ray_titan.trainer.mtp.mtp_labels``), the inputs to every stage, and ``loss`` is the main
    loss, each depth's in ``mtp_losses``.

    Under context parallelism (``cp > 1``) the batch is that of the data-parallel rank: this cp
    rank keeps its load-balanced share of every sequence (``ray_titan.parallel.context``), and
    the step's loss and counted labels are reduced over the cp group, so each cp rank reports
    the data-parallel rank's figures.
    """
    t1 = time.perf_counter()
    parts.optimizer.zero_grad(set_to_none=True)
    if parts.dims.cp > 1:
        inputs, labels, positions = shard_batch(parts.dims.cp, parts.coords["cp"], inputs, labels, positions)
    targets = labels if parts.mtp is None else mtp_labels(labels, positions, parts.mtp.depths)
    if counted_tokens is None:
        # Named ranges in profiler traces (profiling.trace_steps); near free when not profiling.
        with record_function("ray_titan/forward_backward"):
            losses, total = _forward_backward(parts, inputs, targets, n_microbatches, positions, {})
        # The loss stays on the device until the step's one host copy (_update).
        if losses is not None:
            loss = torch.stack(losses).mean() if losses else None
        else:
            loss = total / n_microbatches if total is not None else None
        sums = _mtp_sums(parts, n_microbatches)
        depths = None
        if sums is not None:  # the main loss alone, and each depth's, means over the microbatches
            loss, depths = sums[0] / n_microbatches, sums[1] / n_microbatches
        return _update(parts, step, loss, max_norm, t1, mtp=depths)
    # The schedule averages gradients over microbatches and FSDP (HSDP) over data-parallel and
    # context-parallel ranks.
    scale = n_microbatches * parts.dims.dp * parts.dims.cp / max(1, counted_tokens)
    with record_function("ray_titan/forward_backward"):
        losses, total = _forward_backward(parts, inputs, targets, n_microbatches, positions,
                                          {"scale": scale})
    summed = torch.stack(losses).sum() if losses else total
    sums = _mtp_sums(parts, n_microbatches)
    depths = None
    if sums is not None:
        summed, depths = sums
    mine = (labels != IGNORE_INDEX).sum()  # this rank's counted labels, read with the step's scalars
    return _update(parts, step, summed, max_norm, t1, (scale, mine), depths)


def _mtp_sums(parts: TrainParts, n_microbatches: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Under multi-token prediction, on the last stage: the step's main and per-depth losses
    summed over its microbatches (``MtpLoss.take``); None otherwise."""
    return parts.mtp.take(n_microbatches) if parts.mtp is not None else None


def run_schedule(parts: TrainParts, inputs: torch.Tensor, labels: torch.Tensor,
                 positions: torch.Tensor | None, loss_kwargs: dict[str, Any], forward_only: bool = False,
                 tokens: bool = False) -> list[torch.Tensor] | None:
    """One pass of the pipeline schedule (``schedule.step``, or forward-only ``schedule.eval``)
    over this rank's stages; the last stage's per-microbatch losses (host-side tensors; under
    loss parallel the local value of each replicated loss), None on other ranks. ``tokens``: every
    stage also gets the inputs (multi-token prediction)."""
    assert parts.schedule is not None and parts.schedule_loss is not None
    is_last = parts.is_last_stage
    losses: list[torch.Tensor] | None = [] if is_last else None
    args = (inputs,) if parts.has_first_stage else ()
    # The loss arguments are bound into the schedule's loss, not passed as ``loss_kwargs``,
    # which torch 2.11's schedules forward to the model (ScheduleLoss).
    with _autocast(parts), parts.loss_context(), parts.schedule_loss.bound(loss_kwargs):
        if forward_only:
            parts.schedule.eval(*args, target=labels if is_last else None, losses=losses,
                                **model_kwargs(positions, inputs if tokens else None))
        else:
            # return_outputs=False: otherwise the last stage keeps every microbatch's logits
            # (output_chunks) until the next step and concatenates them, for nothing.
            parts.schedule.step(*args, target=labels if is_last else None, losses=losses,
                                return_outputs=False, **model_kwargs(positions, inputs if tokens else None))
    return [local_tensor(x) for x in losses] if losses is not None else None


def _forward_backward(parts: TrainParts, inputs: torch.Tensor, labels: torch.Tensor, n_microbatches: int,
                      positions: torch.Tensor | None, loss_kwargs: dict[str, Any]
                      ) -> tuple[list[torch.Tensor] | None, torch.Tensor | None]:
    """Forward and backward of the step's microbatches: ``(the schedule's per-microbatch losses
    (PP; None off the last stage), None)``, or ``(None, the sum of the microbatch losses)``
    (gradient accumulation, the gradients then divided by the microbatch count)."""
    mtp = parts.mtp is not None
    if parts.schedule is not None:
        return run_schedule(parts, inputs, labels, positions, loss_kwargs, tokens=mtp), None
    model = next(iter(parts.stages.values()))
    total = torch.zeros((), device=parts.device)
    for i, (x, y, kw) in enumerate(microbatches(inputs, labels, positions, n_microbatches, tokens=mtp)):
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


def _update(parts: TrainParts, step: int, loss: torch.Tensor | None, max_norm: float, t1: float,
            masked: tuple[float, torch.Tensor] | None = None, mtp: torch.Tensor | None = None) -> StepResult:
    """After backward: expert-gradient scaling, clipping, the non-finite flags, the optimizer
    and LR steps, the MoE statistics, then the step's one host synchronisation.

    ``loss``: this rank's loss on the device (0-dim; None off the last stage): the mean over its
    microbatches, or with loss masks (``masked = (scale, counted labels (0-dim int64))``) the sum
    of the scaled microbatch losses, turned into the mean over the counted labels on the host as
    before. ``t1``: when the step's forward began. ``mtp``: each MTP depth's loss ``(depths,)``,
    as ``loss`` (mean or scaled sum), read with the step's other scalars.

    Whether the update is withheld (a non-finite loss or gradient norm, under either policy) is
    decided on the device before the optimizer step: a fused optimizer takes it as ``found_inf``
    (its kernel skips the update and the step count, as under ``GradScaler``); any other
    implementation reads it on the host first (one more sync). Every scalar of the step (loss,
    counted labels, gradient norm, the two non-finite flags, the MoE balance loss and routing
    counts) goes into one float64 buffer, copied to the host once after the optimizer step is
    queued (:func:`_to_host`). Values are those of separate ``.item()`` calls (float32 and int64
    < 2**53 are exact in float64). The non-finite facts leave in ``StepResult.health``."""
    parts.moe.scale_expert_grads()
    if parts.dims.cp > 1 and loss is not None:
        loss, masked = _reduce_over_cp(parts, loss, masked)
    exclude: list[torch.Tensor] = []
    if parts.tied is not None:
        parts.tied.sync_grads()
        exclude = parts.tied.norm_exclude
    t2 = time.perf_counter()
    optimizer = parts.optimizer
    with record_function("ray_titan/optimizer"):
        norm = clip_grad_norm_(parts.params, max_norm, parts.pp_group, exclude)
        lr = float(parts.scheduler.get_last_lr()[0])  # typed float | Tensor; a float here
        # A non-finite loss or norm withholds the update: the same on every rank, on the device.
        loss_bad = _loss_flag(loss, parts.device)
        norm_bad = ~torch.isfinite(norm.detach().to(loss_bad.device))  # cpu_offload: the norm is on the host
        bad = torch.maximum(loss_bad, norm_bad.to(loss_bad.dtype).reshape(1))
        if parts.backup is not None:  # training.on_nonfinite = "skip" may have to undo this update
            parts.backup.save(parts.params, optimizer)
        if optimizer.defaults.get("fused"):
            # On the parameters' device, by a blocking copy: under memory.cpu_offload the host
            # optimizer must read the flag itself (one more sync there, which offloading's
            # gradient copies make anyway). 0-dim: DTensor parameters take a plain scalar beside them.
            where = local_tensor(parts.params[0]).device if parts.params else bad.device
            optimizer.found_inf = bad.reshape(()).to(where)  # type: ignore[attr-defined]  # Adam/AdamW/SGD.step
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf  # type: ignore[attr-defined]
        elif bad.item() == 0:  # foreach / for-loop kernels take no found_inf: one more host sync
            optimizer.step()
        update_bad = nonfinite_flag(parts.params, parts.device)
        parts.scheduler.step()
    moe = parts.moe.end_step()
    scalars = [loss_bad, norm, update_bad, *([] if loss is None else [loss]),
               *([] if masked is None else [masked[1]]), *([] if mtp is None else [mtp]), *moe.tensors()]
    host = _to_host(scalars, parts.device)
    loss_bad_h, grad_norm, update_bad_h = bool(host[0]), host[1], bool(host[2])
    rest = host[3:]
    loss_h = None
    if loss is not None:
        loss_h, rest = rest[0], rest[1:]
    loss_tokens = None
    if masked is not None:
        loss_tokens, rest = int(rest[0]), rest[1:]
        # This rank's mean over its counted labels; 0 of 0 weighs nothing in the collector's mean.
        loss_h = None if loss_h is None else (loss_h / masked[0] / loss_tokens if loss_tokens else 0.0)
    mtp_h = None
    if mtp is not None:
        mtp_h, rest = rest[:mtp.numel()], rest[mtp.numel():]
        if masked is not None:  # normalised as the main loss: by this rank's counted main labels
            mtp_h = [v / masked[0] / loss_tokens if loss_tokens else 0.0 for v in mtp_h]
    aux_loss, moe_layers, expert_load = moe.read(rest)
    # Rare path: which stages hold the non-finite gradients, for the message (every rank takes it:
    # the norm is the whole model's).
    grad_stages = _nonfinite_grad_stages(parts) if not math.isfinite(grad_norm) else ()
    health = StepHealth(step, loss_bad_h, grad_norm, update_bad_h, grad_stages)
    t3 = time.perf_counter()
    return StepResult(loss_h, grad_norm, lr, health, aux_loss, moe_layers, expert_load, t2 - t1, t3 - t2,
                      loss_tokens, mtp_h)


def _reduce_over_cp(parts: TrainParts, loss: torch.Tensor, masked: tuple[float, torch.Tensor] | None
                    ) -> tuple[torch.Tensor, tuple[float, torch.Tensor] | None]:
    """The data-parallel rank's loss from this cp rank's (context parallel: each holds ``1/cp`` of
    every sequence): the mean of the cp ranks' means (equal token counts), or with loss masks the
    sums of their scaled losses and of their counted labels. One all-reduce over ``cp``."""
    assert parts.meshes is not None
    group = parts.meshes["cp"].get_group()
    if masked is None:
        both = loss.detach().reshape(1).clone()
    else:
        both = torch.stack([loss.detach().reshape(()), masked[1].to(loss.dtype)])
    dist.all_reduce(both, group=group)
    if masked is None:
        return (both / parts.dims.cp).reshape(()), None
    return both[0], (masked[0], both[1].round().to(torch.int64))


def _loss_flag(loss: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """``(1,)`` float32 on ``device``: 1 when the loss (``loss``, this rank's; None off the last
    stage) is not finite on some rank. One tiny all-reduce, no host sync."""
    flag = torch.zeros(1, device=device)
    if loss is not None:
        flag = (~torch.isfinite(loss.detach().reshape(1).to(device))).to(flag.dtype)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag


def _nonfinite_grad_stages(parts: TrainParts) -> tuple[int, ...]:
    """The pipeline stages of the ranks whose gradients are not all finite (all of a rank's
    stages if it has several), from every rank: one ``all_gather_object``; the gradients must
    still be there. Collective."""
    local_bad = any(p.grad is not None and not torch.isfinite(local_tensor(p.grad)).all() for p in parts.params)
    mine = (sorted(parts.stages), local_bad)
    everyone: list[Any] = [mine]  # every rank's (stage ids, gradients bad)
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    return tuple(sorted({s for ids, bad in everyone if bad for s in ids}))


def _to_host(scalars: list[torch.Tensor], device: torch.device) -> list[float]:
    """The elements of ``scalars`` (device tensors of any shape and dtype) as host floats, in
    order: one float64 buffer on the device, copied without blocking into pinned host memory,
    then one wait for that copy: the step's single host synchronisation (docs/parallelisms.md)."""
    buf = torch.cat([t.detach().reshape(-1).to(device=device, dtype=torch.float64) for t in scalars])
    if device.type != "cuda":
        return buf.tolist()
    host = torch.empty(buf.shape, dtype=torch.float64, pin_memory=True)
    host.copy_(buf, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return host.tolist()
