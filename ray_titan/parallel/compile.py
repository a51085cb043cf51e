"""``torch.compile`` of transformer blocks (``training.compile``).

Each block of ``model.layers`` is compiled in place (``nn.Module.compile``: the module stays
where it is, so parameter names, initialisation by name and checkpoints do not change) with
the inductor backend and a graph per block; the blocks of a family share their code, so the
compiled graphs are reused across blocks rather than one per layer (torchtitan compiles per
block for the same reason). Applied after activation checkpointing, whose checkpointed forward
is then traced as one region, and before FSDP2, whose unshard/reshard hooks run around the
compiled region (the order TP → AC → compile → FSDP of torchtitan's ``parallelize``). Pipeline
stages are plain modules, so the schedule calls the compiled blocks like eager ones.

MoE blocks route a data-dependent number of tokens to each expert (and, under expert
parallel, exchange them with an all-to-all of data-dependent split sizes): those shapes are
traced as unbacked symbolic sizes (``capture_scalar_outputs``), and such blocks are compiled
without ``fullgraph`` so that what dynamo cannot trace runs eagerly between compiled regions.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

__all__ = ["apply_compile"]


def apply_compile(model: nn.Module, fullgraph: bool = True) -> list[str]:
    """Compile every block of ``model.layers`` (a ``ModuleDict``) in place with inductor;
    ``fullgraph=False`` allows graph breaks (MoE blocks). Returns the compiled blocks' keys.
    The first step of each distinct block pays the compile (seconds to minutes on CPU; the
    ``compile`` benchmark reports it); later steps run the generated kernels."""
    # Token counts per expert become symbolic sizes instead of graph breaks.
    torch._dynamo.config.capture_scalar_outputs = True
    # Activation checkpointing recomputes a compiled block inside its backward graph, where the
    # forward's in-place statistics (MoE routing counts) must not be counted twice.
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    done = []
    for key, block in cast(nn.ModuleDict, model.layers).items():
        block.compile(backend="inductor", fullgraph=fullgraph)
        done.append(key)
    return done
