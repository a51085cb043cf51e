"""The non-finite policy (``training.on_nonfinite``): what a step with NaN or infinite values
means for the run, decided from that step's facts.

A training step gathers the facts, the same on every rank (:class:`StepHealth`): whether the loss
is non-finite on some rank (the last stage holds it), the whole model's gradient norm, and
whether the optimizer update made a parameter non-finite from finite gradients (a learning rate
that overflows the parameters' dtype). :meth:`NonFinitePolicy.decide` turns them into a
:class:`Decision`, as Ray Train's ``FailurePolicy.make_decision`` does for a worker group's
failure, and the trainer's loop acts on it at once (``ray_titan.trainer.loop``):

- :attr:`Action.APPLY`: a finite step; its update stands.
- :attr:`Action.SKIP` (``skip``, non-finite loss or gradients): the step already withheld the
  update (``ray_titan.trainer.step``); rank 0 prints the message, the report marks the step.
- :attr:`Action.UNDO` (``skip``, the update made weights non-finite): the parameters and
  optimizer state saved before the update are restored (``ray_titan.trainer.backup``).
- :attr:`Action.STOP` (``stop``, either case): :class:`NonFiniteError` with the message, raised
  once the step is reported, so the metrics show it.

So non-finite weights never train on, and never reach a checkpoint (the checkpointer's
``all_finite`` guards the save as well). The policy is pure: no tensors, no process group, no
state between steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Literal

__all__ = ["Action", "Decision", "NonFiniteError", "NonFinitePolicy", "StepHealth"]


class NonFiniteError(RuntimeError):
    """The loss, the gradient norm or an update is NaN or infinite and ``training.on_nonfinite = "stop"``."""


class Action(Enum):
    """What the trainer does with a step (module docstring)."""

    APPLY = "apply"
    SKIP = "skip"
    UNDO = "undo"
    STOP = "stop"


@dataclass(frozen=True)
class StepHealth:
    """The facts of one step, the same on every rank: ``loss_bad`` (the loss is not finite on
    some rank), ``grad_norm`` (the whole model's, before clipping), ``update_bad`` (the optimizer
    update made a parameter non-finite on some rank) and ``grad_stages``: the pipeline stages of
    the ranks holding non-finite gradients (all of a rank's stages if it has several; gathered
    only when the norm is not finite, for the message)."""

    step: int
    loss_bad: bool
    grad_norm: float
    update_bad: bool = False
    grad_stages: tuple[int, ...] = ()


@dataclass(frozen=True)
class Decision:
    """An :class:`Action` and its ``message``: for ``SKIP`` and ``UNDO`` the line rank 0 prints
    (after ``ray_titan: ``), for ``STOP`` the :class:`NonFiniteError`'s text; empty for ``APPLY``."""

    action: Action
    message: str = ""

    @property
    def skipped_update(self) -> bool:
        """The step counts as skipped (``StepReport.skipped_update``): every action but ``APPLY``
        (under ``STOP`` the run ends at this step)."""
        return self.action is not Action.APPLY


@dataclass(frozen=True)
class NonFinitePolicy:
    """``on_nonfinite``: ``training.on_nonfinite``; ``last_stage``: the index of the model's last
    pipeline stage (where the loss is); ``lr``: ``optimizer.lr``, named when an update overflows."""

    on_nonfinite: Literal["stop", "skip"]
    last_stage: int
    lr: float

    def __post_init__(self) -> None:
        if self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"on_nonfinite = {self.on_nonfinite!r}: 'stop' or 'skip'")

    def decide(self, health: StepHealth) -> Decision:
        """The :class:`Decision` for a step with these facts. A non-finite loss or gradient norm
        is judged first: its update was withheld, so whether the (unchanged) weights are finite
        says nothing."""
        stop = self.on_nonfinite == "stop"
        grads_bad = not math.isfinite(health.grad_norm)
        if health.loss_bad or grads_bad:
            what = []
            if health.loss_bad:
                what.append(f"the loss is not finite on the last stage (stage {self.last_stage})")
            if grads_bad:
                what.append(f"the gradient norm is {health.grad_norm} "
                            f"(non-finite gradients in stage(s) {sorted(health.grad_stages)})")
            message = f"step {health.step}: " + "; ".join(what)
            if stop:
                return Decision(Action.STOP, f"{message}. training.on_nonfinite = 'stop' ends the run; "
                                             "'skip' would drop such updates")
            return Decision(Action.SKIP, f"{message}: update skipped (training.on_nonfinite = 'skip')")
        if health.update_bad:
            message = (f"step {health.step}: the optimizer update made parameters non-finite from finite "
                       f"gradients (optimizer.lr = {self.lr:g} overflows the parameters' dtype?)")
            if stop:
                return Decision(Action.STOP, f"{message}. training.on_nonfinite = 'stop' ends the run; "
                                             "'skip' would undo such updates")
            return Decision(Action.UNDO, f"{message}: update undone (training.on_nonfinite = 'skip')")
        return Decision(Action.APPLY)
