"""Parallelisms: the device mesh and stage placement (dims.py), tensor, sequence and loss parallel
(tp.py), expert parallel (expert.py), FSDP2 and HSDP (fsdp.py), pipeline parallel (pipeline.py),
activation checkpointing (ac.py), a tied embedding's copies across pipeline stages (tied.py),
gradient clipping across all of them (grad_norm.py) and whether sharded tensors are finite on
every rank (finite.py). Each is applied by one ``apply_*``/``build_*`` function that takes the
model and the mesh; each model family's ``parallelize`` step calls them in a fixed order
(TP → EP → AC → compile → FSDP). Nothing here imports the models."""

from __future__ import annotations

import torch

__all__ = ["local_tensor"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` if it is a ``DTensor`` (``to_local()``, shape of the shard),
    else ``t`` itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t
