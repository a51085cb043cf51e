"""Tied embeddings under pipeline parallelism: the embedding on the first stage and its copies
on the last stage (as the output head of a tied model, as multi-token prediction's embedding,
``mtp_embeddings``), kept equal.

Where one module holds both (no PP), they are one ``Parameter``. Across pipeline stages each of
the two ranks holds a copy, initialised (or loaded) equal; after every backward
:meth:`TiedEmbeddings.sync_grads` sums the two copies' gradients between the first-stage and
last-stage ranks of the same ``dp_shard`` coordinate (Megatron-LM's "embedding group"), so the
same optimizer step keeps them equal; the gradient norm counts the sum once (the head's copy is
left out of it, :attr:`TiedEmbeddings.norm_exclude`), as a one-rank run does. The pair of ranks
is the first- and last-stage ranks with the same ``dp_replicate``, ``dp_shard``, ``cp`` and ``tp``
coordinates, so their shards cover the same rows (both copies are sharded alike on the
vocabulary dimension); under a V-shaped schedule one rank holds both stages and sums locally.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ray_titan.parallel import local_tensor
from ray_titan.parallel.dims import ParallelDims

__all__ = ["TiedEmbeddings"]


class TiedEmbeddings:
    """The tied embedding's copies on this rank and the group that sums their gradients.

    ``stages``: this rank's stage modules by stage index; ``tied``: whether the model ties its
    output head to its embedding. Collective when ``dims.pp > 1`` and ``tied``: every rank
    creates every group of two ranks (first stage, last stage), in the same order. Inactive
    otherwise.
    """

    def __init__(self, stages: dict[int, nn.Module], dims: ParallelDims, rank: int, tied: bool, mtp: bool = False):
        self.params: list[torch.Tensor] = []
        self.group: dist.ProcessGroup | None = None
        self.norm_exclude: list[torch.Tensor] = []
        self.local = False
        # The last stage's copies of the embedding: the tied output head, multi-token
        # prediction's embedding (``mtp``: the model builds MTP depths, on the last stage).
        copies = [name for name, on in (("output.weight", tied), ("mtp_embeddings.weight", mtp)) if on]
        if not copies or dims.pp == 1:
            return
        by_pp: dict[tuple[int, ...], dict[int, int]] = {}  # other coordinates -> pp rank -> rank
        for r in range(dims.world_size):
            c = dims.coords(r)
            by_pp.setdefault(tuple(c.get(a, 0) for a in ("dp_replicate", "dp_shard", "cp", "tp")), {})[c["pp"]] = r
        first, last = dims.stage_to_pp_rank(0), dims.stage_to_pp_rank(dims.num_stages - 1)
        self.local = first == last  # V-shaped: the first and last stages on one rank
        if not self.local:
            for key in sorted(by_pp):  # every rank creates every group, in the same order
                ranks = [by_pp[key][first], by_pp[key][last]]
                group = dist.new_group(ranks)
                if rank in ranks:
                    # Typed with the non-member marker too (torch 2.15); a member gets its group.
                    assert isinstance(group, dist.ProcessGroup)
                    self.group = group
        if 0 in stages:
            self.params.append(stages[0].get_parameter("tok_embeddings.weight"))
        if dims.num_stages - 1 in stages:
            for name in copies:
                copy = stages[dims.num_stages - 1].get_parameter(name)
                self.params.append(copy)
                self.norm_exclude.append(copy)

    @torch.no_grad()
    def sync_grads(self) -> None:
        """Sum the gradients of the embedding and of its copy as the output head (this rank's
        shards) over the two ranks that hold them. No-op when inactive."""
        for p in self.params:
            # Under TP the embedding's gradient can come back Replicate while the weight (and the
            # head's gradient) is Shard(0) on the vocabulary: lay it out as its weight first.
            if isinstance(p, DTensor) and isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        grads = [local_tensor(p.grad) for p in self.params if p.grad is not None]
        if not grads:
            return
        # This rank's copies summed, then (across two ranks) the two ranks' sums.
        total = grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)
        if not self.local:
            dist.all_reduce(total, group=self.group)
        for g in grads:
            if g is not total:
                g.copy_(total)
