"""Per-step fault handling on a worker: the non-finite policy, the attempt stamp, fault injection.

- :meth:`FaultHandler.check` decides, on every rank alike, whether a step's update is applied:
  a non-finite loss (known on the last stage) or gradient norm (known everywhere) either stops the
  run (``training.on_nonfinite = "stop"``, :class:`NonFiniteError` naming the step and the stage)
  or drops the update (``"skip"``).
- :meth:`FaultHandler.check_update` does the same after the optimizer step, for an update that
  made a parameter non-finite from finite gradients (a learning rate that overflows the
  parameters' dtype): ``stop`` ends the run, ``skip`` restores the parameters and optimizer state
  saved by :meth:`FaultHandler.before_update`. So non-finite weights never train on, and never
  reach a checkpoint (:func:`all_finite` guards the save as well).
- ``attempt_start_time``: when this worker group started (rank 0's clock, Unix seconds), stamped
  on every report, so the collector can tell a restarted group's replayed steps from the lost
  ones and keep the newest.
- ``debug.*`` settings inject faults for the fault-tolerance tests.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ray_titan.parallel import local_tensor

__all__ = ["FaultHandler", "NonFiniteError", "all_finite", "nonfinite_flag"]


class NonFiniteError(RuntimeError):
    """The loss or the gradient norm is NaN or infinite and ``training.on_nonfinite = "stop"``."""


@torch.no_grad()
def nonfinite_flag(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``(1,)`` float32 on ``device``: 1 when some element of ``tensors`` (this rank's shards of
    DTensors) is not finite on some rank, else 0. A max-abs per tensor (which cannot overflow,
    unlike a sum) and one all-reduce; no host sync."""
    local = [local_tensor(t).detach() for t in tensors]
    local = [t for t in local if t.numel() and (t.is_floating_point() or t.is_complex())]
    bad = torch.zeros(1, device=device)
    if local:
        norms = torch.stack([n.to(device) for n in torch._foreach_norm(local, float("inf"))])
        bad = (~torch.isfinite(norms)).any().to(bad.dtype).reshape(1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad


def all_finite(tensors: Sequence[torch.Tensor], device: torch.device) -> bool:
    """Whether every element of ``tensors`` is finite on every rank (:func:`nonfinite_flag`, read
    on the host: one sync)."""
    return nonfinite_flag(tensors, device).item() == 0


def _optimizer_tensors(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [v for p in params for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]


class FaultHandler:
    """Args: ``cfg`` the job, ``rank`` this global rank, ``stage_ids`` the pipeline stages it
    holds, ``last_stage`` the index of the model's last stage, ``device`` where collectives run."""

    def __init__(self, cfg, rank: int, stage_ids: list[int], last_stage: int, device: torch.device):
        self.cfg, self.rank, self.stage_ids, self.last_stage = cfg, rank, stage_ids, last_stage
        self.device = device
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        t = torch.tensor([time.time()], dtype=torch.float64, device=device)
        if self.world > 1:
            dist.broadcast(t, src=0)
        self.attempt_start_time = float(t.item())
        self._poison = False
        self._stop: NonFiniteError | None = None
        self.skipped = 0
        self._saved: list[torch.Tensor] = []  # under skip: the state before the update
        self._had_state: set[int] = set()

    def wrap_loss(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """``loss_fn``, made NaN at the steps in ``debug.nonfinite_loss_at_steps``."""
        if not self.cfg.debug.nonfinite_loss_at_steps:
            return loss_fn

        def poisoned(*args, **kwargs):
            loss = loss_fn(*args, **kwargs)
            return loss * float("nan") if self._poison else loss

        return poisoned

    def begin_step(self, step: int) -> None:
        self._poison = step in self.cfg.debug.nonfinite_loss_at_steps

    def loss_flag(self, loss: torch.Tensor | None) -> torch.Tensor:
        """``(1,)`` float32 on the device: 1 when the loss (``loss``, this rank's; None off the last
        stage) is not finite on some rank. One tiny all-reduce, no host sync."""
        flag = torch.zeros(1, device=self.device)
        if loss is not None:
            flag = (~torch.isfinite(loss.detach().reshape(1).to(self.device))).to(flag.dtype)
        if self.world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    def check(self, step: int, loss_bad: bool, grad_norm: float, params: Sequence[torch.Tensor]) -> bool:
        """True when this step's update must be dropped: a non-finite loss on some rank
        (``loss_bad``, :meth:`loss_flag` read on the host) or gradient norm.
        Under ``stop``, :meth:`end_step` then raises :class:`NonFiniteError` (after the step is
        reported, so the metrics show it). Every rank reaches the same verdict (the loss flag is
        all-reduced, the norm is the whole model's); the gradients must still be there."""
        if not loss_bad and math.isfinite(grad_norm):
            return False
        # Rare path: find which stages hold the non-finite values, for the message.
        local_grads_bad = any(
            p.grad is not None and not torch.isfinite(local_tensor(p.grad)).all() for p in params
        )
        mine = (self.stage_ids, local_grads_bad)
        everyone: list[Any] = [mine]  # every rank's (stage_ids, grads_bad)
        if self.world > 1:
            everyone = [None] * self.world
            dist.all_gather_object(everyone, mine)
        # Stages of the ranks holding non-finite gradients (all of a rank's stages if it has several).
        grad_stages = sorted({s for ids, bad in everyone if bad for s in ids})
        what = []
        if loss_bad:
            what.append(f"the loss is not finite on the last stage (stage {self.last_stage})")
        if not math.isfinite(grad_norm):
            what.append(f"the gradient norm is {grad_norm} (non-finite gradients in stage(s) {grad_stages})")
        message = f"step {step}: " + "; ".join(what)
        if self.cfg.training.on_nonfinite == "stop":
            self._stop = NonFiniteError(
                f"{message}. training.on_nonfinite = 'stop' ends the run; 'skip' would drop such updates"
            )
            return True
        self.skipped += 1
        if self.rank == 0:
            print(f"ray_titan: {message}: update skipped (training.on_nonfinite = 'skip')", flush=True)
        return True

    @torch.no_grad()
    def before_update(self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        """Under ``on_nonfinite = "skip"``: copy this rank's parameter and optimizer-state shards
        (into buffers kept from step to step: the same memory again as parameters plus optimizer
        state), so :meth:`check_update` can undo an update. Nothing under ``stop``."""
        if self.cfg.training.on_nonfinite != "skip":
            return
        tensors = [local_tensor(t) for t in list(params) + _optimizer_tensors(optimizer, params)]
        if len(self._saved) != len(tensors):  # the first step, before the optimizer made its state
            self._saved = [t.detach().clone() for t in tensors]
        else:
            torch._foreach_copy_(self._saved, tensors)
        self._had_state = {id(p) for p in params if optimizer.state.get(p)}

    @torch.no_grad()
    def check_update(self, step: int, update_bad: bool, params: Sequence[torch.Tensor],
                     optimizer: torch.optim.Optimizer) -> bool:
        """After the optimizer step: True when it made a parameter non-finite on some rank. Under
        ``stop`` :meth:`end_step` then raises :class:`NonFiniteError`; under ``skip`` the
        parameters and optimizer state are restored from :meth:`before_update` and the step counts
        as skipped. ``update_bad``: :func:`nonfinite_flag` of ``params`` after the update, read on
        the host (every rank the same). Call before the next forward."""
        if not update_bad:
            return False
        message = (f"step {step}: the optimizer update made parameters non-finite from finite gradients "
                   f"(optimizer.lr = {self.cfg.optimizer.lr:g} overflows the parameters' dtype?)")
        if self.cfg.training.on_nonfinite == "stop":
            self._stop = NonFiniteError(
                f"{message}. training.on_nonfinite = 'stop' ends the run; 'skip' would undo such updates"
            )
            return True
        for p in params:  # state the optimizer created in this update: gone again
            if id(p) not in self._had_state:
                optimizer.state.pop(p, None)
        tensors = [local_tensor(t) for t in list(params) + _optimizer_tensors(optimizer, params)]
        torch._foreach_copy_(tensors, self._saved[: len(tensors)])
        self.skipped += 1
        if self.rank == 0:
            print(f"ray_titan: {message}: update undone (training.on_nonfinite = 'skip')", flush=True)
        return True

    def end_step(self, step: int, restarted: bool) -> None:
        """After the step's report: raise the ``stop`` verdict of :meth:`check`, and
        ``debug.kill_at_step``: SIGKILL this process (rank ``debug.kill_rank``) unless this
        worker group is a restart."""
        if self._stop is not None:
            raise self._stop
        d = self.cfg.debug
        if d.kill_at_step == step and d.kill_rank == self.rank and not restarted:
            os.kill(os.getpid(), signal.SIGKILL)
