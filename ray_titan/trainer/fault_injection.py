"""Faults injected on purpose, for the fault-tolerance tests (the ``[debug]`` section; leave it
unset in real jobs): a NaN loss at ``debug.nonfinite_loss_at_steps`` (which exercises
``training.on_nonfinite``) and a SIGKILL of rank ``debug.kill_rank`` at the end of
``debug.kill_at_step`` (which exercises a worker group's restart). The metrics collector's own
fault, ``debug.kill_collector_at_step``, is the collector's (``ray_titan.metrics.collector``)."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import torch

from ray_titan.config.schema import Debug

__all__ = ["FaultInjection"]


class FaultInjection:
    """``debug``'s faults on global rank ``rank``. The loop calls :meth:`begin_step` before each
    step and :meth:`kill_if_due` after it; the trainer's loss is :meth:`wrap_loss`'s."""

    def __init__(self, debug: Debug, rank: int):
        self.debug, self.rank = debug, rank
        self._poison = False

    def wrap_loss(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """``loss_fn``, made NaN during the steps in ``debug.nonfinite_loss_at_steps`` (itself
        when there are none)."""
        if not self.debug.nonfinite_loss_at_steps:
            return loss_fn

        def poisoned(*args, **kwargs):
            loss = loss_fn(*args, **kwargs)
            return loss * float("nan") if self._poison else loss

        return poisoned

    def begin_step(self, step: int) -> None:
        """``step`` starts: its losses are NaN if it is one of ``debug.nonfinite_loss_at_steps``."""
        self._poison = step in self.debug.nonfinite_loss_at_steps

    def kill_if_due(self, step: int, restarted: bool) -> None:
        """After ``step`` is reported: SIGKILL this process at ``debug.kill_at_step`` on rank
        ``debug.kill_rank``, unless this worker group is a restart (so the restarted one runs on)."""
        d = self.debug
        if d.kill_at_step == step and d.kill_rank == self.rank and not restarted:
            os.kill(os.getpid(), signal.SIGKILL)
