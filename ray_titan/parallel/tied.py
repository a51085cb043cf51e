"""Tied embeddings under pipeline parallelism: the embedding on the first stage and its copy as
the output head on the last stage, kept equal.

Where one module holds both (no PP), they are one ``Parameter``. Across pipeline stages each of
the two ranks holds a copy, initialised (or loaded) equal; after every backward
:meth:`TiedEmbeddings.sync_grads` sums the two copies' gradients between the first-stage and
last-stage ranks of the same ``dp_shard`` coordinate (Megatron-LM's "embedding group"), so the
same optimizer step keeps them equal; the gradient norm counts the sum once (the head's copy is
left out of it, :attr:`TiedEmbeddings.norm_exclude`), as a one-rank run does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ray_titan.parallel import local_tensor
from ray_titan.parallel.dims import ParallelDims

__all__ = ["TiedEmbeddings"]


class TiedEmbeddings:
    """The tied embedding's copies on this rank and the group that sums their gradients.

    ``stages``: this rank's stage modules by stage index; ``tied``: whether the model ties its
    output head to its embedding. Collective when ``dims.pp > 1`` and ``tied``: every rank
    creates the ``dp_shard`` groups of two ranks (first stage, last stage). Inactive otherwise.
    """

    def __init__(self, stages: dict[int, nn.Module], dims: ParallelDims, rank: int, tied: bool):
        self.params: list[torch.Tensor] = []
        self.group: dist.ProcessGroup | None = None
        self.norm_exclude: list[torch.Tensor] = []
        if not tied or dims.pp == 1:
            return
        first, last = 0, dims.stage_to_pp_rank(dims.num_stages - 1)
        for dp in range(dims.dp_shard):  # every rank creates every group, in the same order
            ranks = [first * dims.dp_shard + dp, last * dims.dp_shard + dp]
            group = dist.new_group(ranks)
            if rank in ranks:
                self.group = group
        if 0 in stages:
            self.params.append(stages[0].get_parameter("tok_embeddings.weight"))
        if dims.num_stages - 1 in stages:
            head = stages[dims.num_stages - 1].get_parameter("output.weight")
            self.params.append(head)
            self.norm_exclude.append(head)

    @torch.no_grad()
    def sync_grads(self) -> None:
        """Sum the gradients of the embedding and of its copy as the output head (this rank's
        shards) over the two ranks that hold them. No-op when inactive."""
        for p in self.params:
            if p.grad is not None:
                dist.all_reduce(local_tensor(p.grad), group=self.group)
