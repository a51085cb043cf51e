"""FSDP2: shard every transformer block and the stage's root module over ``dp_shard``."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

__all__ = ["apply_fsdp", "resolve_reshard_after_forward"]


def resolve_reshard_after_forward(policy: str, pp_enabled: bool) -> bool:
    """``default``: reshard after forward unless pipelining, where every microbatch's forward
    would otherwise all-gather the parameters again; ``always`` / ``never`` force it."""
    if policy == "always":
        return True
    if policy == "never":
        return False
    return not pp_enabled


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, reshard_after_forward: bool) -> None:
    """``fully_shard`` each block in ``model.layers`` and then ``model`` itself (the embedding,
    final norm and output head, where this stage has them, are in the root's group).

    Parameters become ``DTensor``s sharded on dim 0 over ``dp_mesh``; gradients are
    reduce-scattered (averaged) over it. The root never reshards after forward: its backward
    starts at once.
    """
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False)
