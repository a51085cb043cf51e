"""Parallelisms: the device mesh (dims.py), tensor, sequence and loss parallel (tp.py), expert
parallel (expert.py), FSDP2 and HSDP (fsdp.py), pipeline parallel (pipeline.py), activation
checkpointing (ac.py) and gradient clipping across all of them (grad_norm.py). Each is applied
by one ``apply_*``/``build_*`` function that takes the model and the mesh."""

from __future__ import annotations

import torch

__all__ = ["local_tensor"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` if it is a ``DTensor`` (``to_local()``, shape of the shard),
    else ``t`` itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t
