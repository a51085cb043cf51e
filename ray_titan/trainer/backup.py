"""The state before an optimizer update, kept so that an update can be undone.

Under ``training.on_nonfinite = "skip"`` an update that makes a parameter non-finite from finite
gradients is undone (``ray_titan.trainer.nonfinite``, ``Action.UNDO``): the step saves this
rank's parameter and optimizer-state shards before the optimizer runs (:meth:`UpdateBackup.save`)
and the loop restores them (:meth:`UpdateBackup.restore`). The buffers are kept from step to step:
the same memory again as the parameters plus the optimizer state, which is why nothing is saved
under ``stop``. Local only: no collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ray_titan.parallel import local_tensor

__all__ = ["UpdateBackup"]


def _optimizer_tensors(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [v for p in params for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]


class UpdateBackup:
    """This rank's parameters and optimizer state as they were before the latest update."""

    def __init__(self) -> None:
        self._saved: list[torch.Tensor] = []
        self._had_state: set[int] = set()

    @torch.no_grad()
    def save(self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        """Copy ``params``' shards and ``optimizer``'s state for them (before its step)."""
        tensors = [local_tensor(t) for t in list(params) + _optimizer_tensors(optimizer, params)]
        if len(self._saved) != len(tensors):  # the first step, before the optimizer made its state
            self._saved = [t.detach().clone() for t in tensors]
        else:
            torch._foreach_copy_(self._saved, tensors)
        self._had_state = {id(p) for p in params if optimizer.state.get(p)}

    @torch.no_grad()
    def restore(self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        """Put back what :meth:`save` copied: state the optimizer created in the update is dropped
        again, the rest overwritten in place."""
        for p in params:
            if id(p) not in self._had_state:
                optimizer.state.pop(p, None)
        tensors = [local_tensor(t) for t in list(params) + _optimizer_tensors(optimizer, params)]
        torch._foreach_copy_(tensors, self._saved[: len(tensors)])
