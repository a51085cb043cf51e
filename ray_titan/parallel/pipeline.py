"""Pipeline parallel: split the model into stages by layers and build the schedule.

Uses ``torch.distributed.pipelining``. Stages are contiguous runs of transformer blocks; the
embedding and the final norm plus output head each weigh as much as one block when balancing
(as torchtitan counts them), and every stage keeps at least one block.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from ray_titan.parallel.schedules import SCHEDULES

if TYPE_CHECKING:
    from torch.distributed.pipelining.stage import _PipelineStageBase  # the schedules' parameter type

__all__ = ["SCHEDULES", "ScheduleLoss", "build_pipeline_schedule", "build_stage_module", "split_layers",
           "stage_placement"]

def stage_placement(schedule: str) -> Literal["loop", "v"]:
    """How ``schedule`` places stages on pp ranks (:attr:`~ray_titan.parallel.schedules.Schedule.placement`:
    ``"v"`` for the V-shaped schedules, whose stage-to-rank mapping torch builds with ``style="v"``,
    ``"loop"`` for the others). :class:`~ray_titan.parallel.dims.ParallelDims` derives every
    stage's rank, and so the last-stage ranks, from it; :func:`build_pipeline_schedule` checks
    that the schedule it built runs that same mapping. Raises ``ValueError`` for an unknown
    schedule."""
    if schedule not in SCHEDULES:
        raise ValueError(f"parallelism.pipeline_schedule = {schedule!r}; valid: {sorted(SCHEDULES)}")
    return SCHEDULES[schedule].placement

_M = TypeVar("_M", bound=nn.Module)


class ScheduleLoss:
    """The loss a pipeline schedule calls as ``loss(output, target)``: ``fn(output, target,
    **kwargs)`` with the keyword arguments bound for the current step (:meth:`bound`).

    The step's loss arguments (the masked loss's ``scale``) reach the loss through this object,
    never through ``schedule.step(loss_kwargs=...)``: that parameter is recent, and torch 2.11's
    ``step`` forwards every keyword it does not know to the first stage's model
    (``TypeError: ... unexpected keyword argument 'loss_kwargs'``). One path on every torch, and
    the same call of ``fn`` as ``loss_kwargs`` makes where it exists.
    """

    def __init__(self, fn: Callable[..., torch.Tensor]):
        self.fn = fn
        self.kwargs: dict[str, Any] = {}

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        return self.fn(output, target, **self.kwargs)

    @contextlib.contextmanager
    def bound(self, kwargs: dict[str, Any] | None) -> Iterator[None]:
        """Within the block, every call adds ``kwargs`` (None or empty: none); cleared on exit,
        so a later step (or the build's shape-inference step) never sees a stale ``scale``."""
        self.kwargs = dict(kwargs or {})
        try:
            yield
        finally:
            self.kwargs = {}


class _DecoderParts(Protocol):
    """The parts of a ``ray_titan.models.decoder.Decoder`` (which this package may not import)
    that a pipeline stage removes."""

    layers: nn.ModuleDict
    tok_embeddings: nn.Embedding | None
    norm: nn.Module | None
    output: nn.Module | None
    tied: bool


def split_layers(n_layers: int, num_stages: int) -> list[list[int]]:
    """Layer indices of each stage: contiguous, each stage >= 1 layer, balanced with the
    embedding counted as a layer of the first stage and the output head as one of the last.

    Raises ``ValueError`` if ``n_layers < num_stages``.
    """
    if n_layers < num_stages:
        raise ValueError(f"{n_layers} layers cannot fill {num_stages} pipeline stages")
    counts = [1] * num_stages
    extra = [0] * num_stages
    extra[0] += 1
    extra[-1] += 1
    for _ in range(n_layers - num_stages):
        # Next layer goes to the lightest stage; ties to the earliest, keeping the split stable.
        s = min(range(num_stages), key=lambda i: (counts[i] + extra[i], i))
        counts[s] += 1
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out


def build_stage_module(whole: _M, layers: list[int], first: bool, last: bool) -> _M:
    """A copy of ``whole`` (normally on the meta device) keeping only ``layers``, the embedding
    if ``first`` and the final norm and output head if ``last``. Parameter names are unchanged.
    A model whose head is tied to its embedding computes logits with the embedding; a last
    stage without it gets its own ``output`` (the copy ``ray_titan.parallel.tied`` keeps equal).
    Multi-token-prediction blocks (a model's ``mtp_layer_ids``) go to the last stage, with a copy
    of the embedding, ``mtp_embeddings``, when it does not hold ``tok_embeddings`` (kept equal
    the same way)."""
    stage = copy.deepcopy(whole)
    parts = cast(_DecoderParts, stage)
    if parts.tied and last and not first and parts.tok_embeddings is not None:
        emb = parts.tok_embeddings
        parts.output = nn.Linear(emb.embedding_dim, emb.num_embeddings, bias=False, device=emb.weight.device)
    keep = {str(i) for i in layers}
    mtp = list(getattr(stage, "mtp_layer_ids", ()))  # multi-token prediction's blocks: the last stage's
    if last:
        keep |= set(mtp)
        if mtp and not first and parts.tok_embeddings is not None:  # they embed the shifted tokens
            emb = parts.tok_embeddings
            stage.mtp_embeddings = nn.Embedding(emb.num_embeddings, emb.embedding_dim, device=emb.weight.device)
    for name in list(parts.layers.keys()):
        if name not in keep:
            del parts.layers[name]
    if not first:
        parts.tok_embeddings = None
    if not last:
        parts.norm = None
        parts.output = None
    return stage


class _Stage(PipelineStage):
    """A ``PipelineStage`` whose communicator warm-up leaves out the neighbours on its own rank.

    torch 2.11's multi-stage schedules warm their p2p communicators up at the first step by
    sending one element to each neighbouring stage and receiving one from it
    (``_get_init_p2p_neighbors_ops``), even when that stage is on the same rank (the V-shaped
    placements' middle stages, or every stage in a one-rank world), and gloo cannot send to its
    own rank (``Pair is not connected``: Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble
    and DualPipeV failed on CPU). Those messages carry nothing (activations between stages of one
    rank are handed over in memory), so they are dropped, in pairs: a neighbour on this rank
    would have posted the matching send and receive. Later torches warm up otherwise and never
    call this method (torch 2.15 has none).
    """

    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        base: Any = super()  # Any: torch 2.15's PipelineStage has no such method to type-check
        ops = base._get_init_p2p_neighbors_ops()
        return [op for op in ops if op.group_peer != self.group_rank]


def build_pipeline_schedule(
    schedule: str,
    stage_modules: dict[int, nn.Module],
    num_stages: int,
    n_microbatches: int,
    loss_fn: Callable[..., torch.Tensor],
    device: torch.device,
    pp_group,
    stage_to_rank: dict[int, int] | None = None,
) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """The ``torch.distributed.pipelining`` schedule for this rank's stages (``stage index ->
    module``). Gradients are scaled by ``1 / n_microbatches``, so with a per-microbatch mean
    loss they are the gradient of the mean over the rank's batch.

    ``stage_to_rank`` (``{stage: pp rank}``, ``ParallelDims.stage_to_rank_mapping``) is the
    placement the rest of the job assumes (which ranks feed inputs and labels, which report the
    loss); a multi-stage schedule that runs another one is refused. Raises ``ValueError`` for
    an unknown schedule, a single-stage schedule given several stages, or such a mismatch."""
    if schedule not in SCHEDULES:
        raise ValueError(f"parallelism.pipeline_schedule = {schedule!r}; valid: {sorted(SCHEDULES)}")
    cls = SCHEDULES[schedule].torch_class
    stages: list[_PipelineStageBase] = [
        _Stage(mod, idx, num_stages, device, group=pp_group)
        for idx, mod in sorted(stage_modules.items())
    ]
    if issubclass(cls, PipelineScheduleSingle):
        if len(stages) != 1:
            raise ValueError(f"{schedule} runs one stage per rank, this rank has {len(stages)}")
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
    multi = cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
    runs = getattr(multi, "stage_index_to_group_rank", None)
    if stage_to_rank is not None and runs is not None and dict(runs) != stage_to_rank:
        raise ValueError(f"{schedule} places stages on pp ranks as {dict(runs)}, but the job assumed "
                         f"{stage_to_rank} (ray_titan.parallel.pipeline.stage_placement)")
    return multi
