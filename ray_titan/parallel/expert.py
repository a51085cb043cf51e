"""Expert parallelism (EP): routed experts split over the ``ep`` mesh axis, tokens moved by all-to-all.

Token dispatch and combine use ``all_to_all_single_autograd`` from
``torch.distributed._functional_collectives``: each forward all-to-all records its backward
all-to-all in the autograd graph, so the gradients of tokens that visited another rank's
experts come back, and nothing a step sent outlives its backward (docs/design.md, lesson 2: a token
all-to-all whose backward never ran grew device memory every step until OOM).

Per MoE layer and forward, on each rank of an ``ep`` group of size ``E`` holding ``N / E``
experts each:

1. the model sorts tokens by their chosen expert (``top_k`` copies per token;
   ``ray_titan.models.deepseek_v2.model.route_tokens``) and calls :func:`run_remote_experts`:
2. the per-expert counts ``(N,)`` are exchanged with an (equal-split) all-to-all, so every rank
   knows how many tokens it sends to and receives from each peer; the sent and received counts
   are read on the host together: the layer's one host sync per forward (``all_to_all_single``
   with uneven splits takes host sizes; a recomputed forward under activation checkpointing reads
   them again);
3. dispatch: the sorted tokens go to the ranks owning their experts (uneven splits);
4. the received tokens, ordered by (source rank, local expert), are regrouped by local expert and
   run through the local experts;
5. combine: the inverse all-to-all returns the outputs, which the model weights by the router
   and sums per token.

Routing is dropless: no capacity limit, no token is dropped or padded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard

from ray_titan.parallel.tp import reduce_grad, sum_partial

__all__ = ["MoEStepScalars", "MoEStepState", "apply_expert_parallel", "apply_expert_tensor_parallel",
           "run_remote_experts"]


class _MoEModel(Protocol):
    """A stage module with MoE layers (``ray_titan.models.deepseek_v2.DeepSeekV2``, which this
    package may not import): its ``MoE`` modules by layer index."""

    def moe_modules(self) -> dict[int, Any]: ...


@torch.compiler.disable
def run_remote_experts(
    x_sorted: torch.Tensor, counts: torch.Tensor, experts: nn.Module, group: dist.ProcessGroup
) -> torch.Tensor:
    """Dispatch ``x_sorted`` (grouped by global expert, ``counts (N,)``) over ``group``, run the
    local experts, combine back. Returns the outputs in ``x_sorted``'s order.

    Never compiled (``training.compile`` compiles the block around it): its split sizes are host
    ints that change every step, and a compiled region after the host read guarded on their
    values, recompiling the rest of the layer on each new routing (DeepSeek debug, pp=2 ×
    dp_shard=2 × ep=2: 2 recompiles a rank in 10 steps, each of the MoE layer's tail)."""
    ep = dist.get_world_size(group)
    n_local = counts.numel() // ep
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    # The uneven all-to-alls need their split sizes on the host: both directions' in one read,
    # the layer's only host sync per forward (its backward reuses the sizes).
    sent_l, recv_flat = torch.stack([counts, recv_counts]).tolist()
    recv_l = [recv_flat[i * n_local:(i + 1) * n_local] for i in range(ep)]  # [i][e]: from rank i, local expert e
    in_splits = [sum(sent_l[i * n_local:(i + 1) * n_local]) for i in range(ep)]
    out_splits = [sum(r) for r in recv_l]
    x_recv = all_to_all_single_autograd(x_sorted, out_splits, in_splits, group)
    # Received segments come as (source rank, local expert); regroup them as (expert, source).
    seg_key = torch.arange(ep * n_local, device=counts.device).view(n_local, ep).T.flatten()
    # output_size, known on the host already, spares the op a device sync to size its output.
    keys = torch.repeat_interleave(seg_key, recv_counts, output_size=sum(out_splits))
    perm = torch.argsort(keys, stable=True)
    local_counts = [sum(recv_l[i][e] for i in range(ep)) for e in range(n_local)]
    y_local = experts(x_recv[perm], local_counts)
    y_recv = torch.zeros_like(y_local).index_copy(0, perm, y_local)
    return all_to_all_single_autograd(y_recv, in_splits, out_splits, group)


def _shard(experts: nn.Module, name: str, mesh: DeviceMesh, placements: list[Placement]) -> None:
    """Replace ``experts.<name>`` (a plain tensor of the full shape, normally on meta) by an empty
    ``DTensor`` parameter of that global shape sharded by ``placements`` over ``mesh``."""
    p = getattr(experts, name)
    shape = list(p.shape)
    for i, pl in enumerate(placements):
        if isinstance(pl, Shard):
            shape[pl.dim] //= mesh.size(i)
    local = torch.empty(shape, dtype=p.dtype, device=p.device)
    experts.register_parameter(name, nn.Parameter(DTensor.from_local(local, mesh, placements, run_check=False)))


# The hidden-unit dimension of each stacked expert weight: w1, w3 (n, hidden, dim), w2 (n, dim, hidden).
_HIDDEN_DIM = {"w1": 1, "w3": 1, "w2": 2}


def apply_expert_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split every MoE layer's routed experts of ``model`` (a stage module, normally on meta)
    over ``tp_mesh`` by their hidden units, as tensor parallel splits a dense SwiGLU: ``w1``,
    ``w3`` ``(n, hidden, dim)`` become ``Shard(1)``, ``w2`` ``(n, dim, hidden)`` ``Shard(2)``.

    Every tp rank routes the same tokens (the MoE layer's input is replicated over tp,
    ``ray_titan.parallel.tp.token_replicated_plan``) and runs its ``hidden / tp`` slice of each
    chosen expert; the experts' input gradient is summed over tp in backward and their partial
    outputs in forward (``reduce_grad``, ``sum_partial``), so the router, which weights those
    outputs, sees whole outputs and gets the same gradient on every tp rank.

    Call before :func:`apply_expert_parallel` (which adds the ``ep`` sharding) and FSDP. Raises
    ``ValueError`` if ``tp`` does not divide the experts' hidden size.
    """
    tp = tp_mesh.size()
    for moe in cast(_MoEModel, model).moe_modules().values():
        hidden = moe.experts.w1.shape[1]
        if hidden % tp:
            raise ValueError(f"the routed experts' hidden size {hidden} cannot be split over tp = {tp}")
        for name, dim in _HIDDEN_DIM.items():
            _shard(moe.experts, name, tp_mesh, [Shard(dim)])
        moe.experts.register_forward_pre_hook(lambda mod, args: (reduce_grad(args[0], tp_mesh), *args[1:]))
        moe.experts.register_forward_hook(lambda mod, args, out: sum_partial(out, tp_mesh))


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, ep_tp_mesh: DeviceMesh | None = None) -> None:
    """Shard every MoE layer's routed experts of ``model`` (a stage module, normally on meta)
    over ``ep_mesh``: weights become ``DTensor``s ``Shard(0)`` (rank ``j`` holds experts
    ``[j·N/E, (j+1)·N/E)``), and the layer dispatches tokens over the mesh's group.

    After :func:`apply_expert_tensor_parallel` (the weights already ``DTensor``s over ``tp``),
    ``ep_tp_mesh`` is the 2-D ``(ep, tp)`` mesh and the weights become ``(Shard(0), Shard(h))``
    over it: each rank holds the ``1/tp`` hidden slice of ``N/E`` experts.

    Call before FSDP, before materialising. Raises ``ValueError`` if ``E`` does not divide ``N``.
    """
    ep = ep_mesh.size()
    for moe in cast(_MoEModel, model).moe_modules().values():
        if moe.n_experts % ep:
            raise ValueError(f"{moe.n_experts} routed experts cannot be split over ep = {ep}")
        moe.run_experts = functools.partial(run_remote_experts, group=ep_mesh.get_group())
        for name, p in list(moe.experts.named_parameters(recurse=False)):
            if isinstance(p, DTensor):
                if ep_tp_mesh is None:
                    raise ValueError("routed experts already tensor-parallel: pass the (ep, tp) mesh")
                _shard(moe.experts, name, ep_tp_mesh, [Shard(0), *p.placements])
            else:
                _shard(moe.experts, name, ep_mesh, [Shard(0)])


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The routed experts' parameters of ``model`` (empty for a dense model)."""
    mods = cast(_MoEModel, model).moe_modules().values() if hasattr(model, "moe_modules") else []
    return [p for moe in mods for p in moe.experts.parameters()]


@dataclass
class MoEStepScalars:
    """A step's MoE statistics on the device: ``aux`` the balance loss summed over this rank's
    layers and microbatches (0-dim fp32; None without it), ``counts (layers, N)`` int64 the
    tokens (× top-k) routed to each expert (None without MoE layers), for ``layers``;
    ``n_microbatches`` divides ``aux``. :meth:`tensors` go into the step's one host copy and
    :meth:`read` turns their host values back into the report's fields."""

    aux: torch.Tensor | None
    counts: torch.Tensor | None
    layers: list[int]
    n_microbatches: int

    def tensors(self) -> list[torch.Tensor]:
        """What to copy to the host, in :meth:`read`'s order."""
        return [t for t in (self.aux, self.counts) if t is not None]

    def read(self, values: list[float]) -> tuple[float | None, list[int], list[list[int]]]:
        """``(aux_loss, layers, load)`` from the host values of :meth:`tensors` (flattened, in
        order): the balance loss averaged over microbatches (None without it), the layer indices,
        and per layer the tokens this rank routed to each expert in the step."""
        aux_loss = None
        if self.aux is not None:
            aux_loss, values = values[0] / self.n_microbatches, values[1:]
        if self.counts is None:
            return aux_loss, [], []
        n = self.counts.shape[1]
        load = [[int(v) for v in values[i * n:(i + 1) * n]] for i in range(len(self.layers))]
        return aux_loss, self.layers, load


class MoEStepState:
    """Per-step bookkeeping of this rank's MoE layers, called by the train loop.

    - :meth:`scale_expert_grads` after backward: an expert's gradient sums the contributions of
      every rank of its ``ep`` group (whose losses are each a mean over their own tokens), so it
      is divided by ``ep`` to become the gradient of the mean over the data-parallel batch, as
      FSDP's averaging does for every other parameter. (Under tensor parallel the tp ranks hold
      different hidden units of the same experts for the same tokens: nothing to add over tp.)
    - :meth:`end_step` after the optimizer step: takes and zeroes each layer's token counts and
      balance-loss sum (on the device; the step reads them with its other scalars), and
      with auxiliary-loss-free balancing updates each
      router's bias from the loads summed over ``dp_group`` (every rank holding that stage), so
      the bias stays identical on every rank and equal to a one-worker run's.
    """

    def __init__(self, stages: dict[int, nn.Module], ep: int, dp_group: dist.ProcessGroup | None,
                 n_microbatches: int):
        self.moes = {layer: moe for m in stages.values() if hasattr(m, "moe_modules")
                     for layer, moe in cast(_MoEModel, m).moe_modules().items()}
        self.layers = sorted(self.moes)
        self.expert_params = [p for m in stages.values() for p in expert_parameters(m)]
        self.ep, self.dp_group, self.n_mb = ep, dp_group, n_microbatches

    @property
    def active(self) -> bool:
        return bool(self.moes)

    @torch.no_grad()
    def scale_expert_grads(self) -> None:
        if self.ep > 1:
            for p in self.expert_params:
                if p.grad is not None:
                    p.grad.div_(self.ep)

    @torch.no_grad()
    def end_step(self) -> MoEStepScalars:
        """The step's MoE statistics on the device (:class:`MoEStepScalars`, read on the host with
        the step's other scalars), then the aux-free bias update and the counters zeroed. No
        host sync."""
        if not self.moes:
            return MoEStepScalars(None, None, [], self.n_mb)
        routers = [self.moes[i].router for i in self.layers]
        counts = torch.stack([r.tokens_per_expert for r in routers])  # (layers, N): a copy
        use_aux = any(self.moes[i].aux_coeff > 0 for i in self.layers)
        aux = torch.stack([self.moes[i].aux_loss_sum for i in self.layers]).sum() if use_aux else None
        if routers[0].use_bias:
            total = counts.clone()
            if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
                dist.all_reduce(total, group=self.dp_group)
            total = total.float()
            for r, c in zip(routers, total):
                # DeepSeek-V3 §2.1.2: raise under-loaded experts' bias, lower over-loaded ones'.
                r.expert_bias.add_(torch.sign(c.mean() - c), alpha=r.bias_update_rate)
        self.reset()
        return MoEStepScalars(aux, counts, self.layers, self.n_mb)

    @torch.no_grad()
    def reset(self) -> None:
        """Zero every layer's token counts and balance-loss sum."""
        for moe in self.moes.values():
            moe.router.tokens_per_expert.zero_()
            moe.aux_loss_sum.zero_()
