"""The declared torch range at both ends (torch 2.11 on Python 3.12, the newest torch): what differs
between versions, simulated here on the development pin so that each difference is kept by a test
that runs everywhere."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ray_titan.parallel.pipeline import ScheduleLoss
from ray_titan.trainer.step import run_schedule


class _Torch211Schedule:
    """A pipeline schedule with torch 2.11's ``step``: no ``loss_kwargs``, and every keyword it
    does not know forwarded to the model; the loss is called as ``loss_fn(output, target)``."""

    def __init__(self, model: torch.nn.Module, loss_fn: Any):
        self.model, self.loss_fn = model, loss_fn

    def step(self, *args, target=None, losses: list | None = None, return_outputs=True, **kwargs):
        out = self.model(*args, **kwargs)
        if losses is not None:
            losses.append(self.loss_fn(out, target))

    def eval(self, *args, target=None, losses: list | None = None, **kwargs):
        with torch.no_grad():
            return self.step(*args, target=target, losses=losses, **kwargs)


class _Model(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # no **kwargs: as ray_titan's Decoder
        return x.float()


@pytest.mark.parametrize("forward_only", [False, True])
def test_loss_arguments_reach_the_loss_under_a_schedule_without_loss_kwargs(forward_only):
    """torch 2.11's ``schedule.step`` has no ``loss_kwargs``: passed there, they reached the model
    (``Decoder.forward() got an unexpected keyword argument 'loss_kwargs'``); bound into the
    schedule's loss, they reach the loss, and only for that step."""
    seen: list[dict] = []

    def loss(out, y, **kw):
        seen.append(kw)
        return (out - y).pow(2).mean() * kw.get("scale", 1.0)

    sl = ScheduleLoss(loss)
    parts = SimpleNamespace(schedule=_Torch211Schedule(_Model(), sl), schedule_loss=sl, is_last_stage=True,
                            has_first_stage=True, autocast=None, loss_context=contextlib.nullcontext)
    x, y = torch.ones(2, 3), torch.zeros(2, 3)
    losses = run_schedule(parts, x, y, None, {"scale": 0.5}, forward_only=forward_only)  # type: ignore[arg-type]
    assert seen == [{"scale": 0.5}] and losses is not None and losses[0].item() == 0.5
    assert sl.kwargs == {}  # unbound after the step: the next call adds nothing
    sl(x, y)
    assert seen[-1] == {}
