"""Whether tensors sharded over the ranks are finite everywhere: one flag, all-reduced.

The trainer reads it after every optimizer step (an update that made a weight non-finite,
``ray_titan.trainer.nonfinite``) and the checkpointer before every save and after every load, so
non-finite weights never train on and never reach a checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ray_titan.parallel import local_tensor

__all__ = ["all_finite", "nonfinite_flag"]


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
