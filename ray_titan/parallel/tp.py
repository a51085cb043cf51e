"""Tensor parallel (TP) and sequence parallel (SP) through DTensor's ``parallelize_module``.

Megatron-LM's scheme (Shoeybi et al. 2019, arXiv:1909.08053; sequence parallel: Korthikanti et
al. 2022, arXiv:2205.05198), as torchtitan applies it to Llama:

- a feed-forward (SwiGLU) splits its hidden units: ``w1``, ``w3`` column-wise (``Shard(0)`` of
  the weight, outputs sharded on the last dim), ``w2`` row-wise (outputs partial sums, reduced);
- attention splits its heads the same way: ``wq``, ``wk``, ``wv`` column-wise, ``wo`` row-wise;
- the token embedding is split **row-wise** (over the vocabulary: each rank looks up the ids it
  owns, the partial rows are summed), computed on the local shard (:class:`VocabParallelEmbedding`)
  so that its gradient is the local rows, not a whole-vocabulary partial sum;
- the output head is split column-wise (over the vocabulary); with **loss parallel** its logits
  stay vocabulary-sharded and the cross-entropy runs on the shards
  (``torch.distributed.tensor.parallel.loss_parallel``), else they are all-gathered;
- with **sequence parallel** the norms run on ``1/tp`` of the sequence (``SequenceParallel``) and
  the residual stream between blocks stays sequence-sharded: each attention or feed-forward
  all-gathers its input and reduce-scatters its output, instead of all-reducing it.

The helpers here build those plans for the parts of a stage that exist; each model family's
``parallelize`` chooses which modules get which plan. Parameters not in a plan stay plain,
replicated tensors that every tp rank computes identically (e.g. MLA's latent projections, the
MoE router).
"""

from __future__ import annotations

from functools import partial
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = [
    "ReduceGradSlice",
    "VocabParallelEmbedding",
    "apply_tp",
    "attention_plan",
    "decoder_ends_plan",
    "feed_forward_plan",
    "mtp_depth_plan",
    "norm_plan",
    "reduce_grad",
    "sum_partial",
    "token_replicated_plan",
]

Plan = dict[str, ParallelStyle]


def _seq(sequence_parallel: bool) -> Placement:
    """The residual stream's layout between blocks: sequence-sharded under SP, else replicated."""
    return Shard(1) if sequence_parallel else Replicate()


def decoder_ends_plan(model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> Plan:
    """Plan of a stage's token embedding (row-wise), final norm (SP) and output head
    (column-wise; vocabulary-sharded ``DTensor`` logits ``(batch, seq, vocab)`` ``Shard(2)`` with
    ``loss_parallel``, plain replicated logits without), for those of them this stage holds; a
    last stage's copy of the embedding for multi-token prediction (``mtp_embeddings``) is split
    as the embedding, so the two copies' shards hold the same rows (``ray_titan.parallel.tied``)."""
    plan: Plan = {}
    for emb in ("tok_embeddings", "mtp_embeddings"):
        if getattr(model, emb, None) is not None:
            plan[emb] = VocabParallelEmbedding(output_layout=_seq(sequence_parallel))
    if getattr(model, "norm", None) is not None and sequence_parallel:
        plan["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        plan["output"] = ColwiseParallel(
            input_layouts=_seq(sequence_parallel),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return plan


def norm_plan(name: str, sequence_parallel: bool) -> Plan:
    """Plan of the norm ``name`` of the residual stream: ``SequenceParallel`` under SP (its
    weight a replicated ``DTensor``, whose gradient DTensor sums over the sequence shards), else
    nothing (a plain module computed the same on every tp rank)."""
    return {name: SequenceParallel()} if sequence_parallel else {}


def feed_forward_plan(prefix: str, sequence_parallel: bool, norm: str | None = "ffn_norm") -> Plan:
    """Plan of a SwiGLU feed-forward at ``prefix`` (``w1``, ``w3`` column-wise, ``w2`` row-wise)
    fed by the norm ``norm`` of the residual stream: under SP the norm is ``SequenceParallel`` and
    the feed-forward's input is all-gathered, its output reduce-scattered back to ``Shard(1)``."""
    plan: Plan = {
        f"{prefix}.w1": ColwiseParallel(),
        f"{prefix}.w3": ColwiseParallel(),
        f"{prefix}.w2": RowwiseParallel(output_layouts=_seq(sequence_parallel)),
    }
    if sequence_parallel:
        plan.update(norm_plan(norm, True) if norm is not None else {})
        plan[prefix] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                          use_local_output=True)
    return plan


def attention_plan(prefix: str, colwise: list[str], rowwise: str, sequence_parallel: bool,
                   norm: str = "attention_norm") -> Plan:
    """Plan of an attention at ``prefix`` that splits its heads: the projections ``colwise``
    (names inside it) column-wise, the output projection ``rowwise`` row-wise. Its ``forward``
    takes ``(x, cos, sin, mask)``; under SP the norm ``norm`` is ``SequenceParallel`` and ``x`` is
    all-gathered (``cos``/``sin`` are the whole rotary tables or the per-document ones, ``mask``
    the document mask or None: replicated plain tensors)."""
    plan: Plan = {f"{prefix}.{name}": ColwiseParallel() for name in colwise}
    plan[f"{prefix}.{rowwise}"] = RowwiseParallel(output_layouts=_seq(sequence_parallel))
    if sequence_parallel:
        plan.update(norm_plan(norm, True))
        plan[prefix] = PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                          desired_input_layouts=(Replicate(), None, None, None), use_local_output=True)
    return plan


def mtp_depth_plan(sequence_parallel: bool) -> Plan:
    """Plan of the parts of a multi-token-prediction depth around its decoder block (DeepSeek-V3's
    ``MtpBlock``, ``ray_titan.models.deepseek_v2.model``): the norms ``enorm`` (of the shifted
    tokens' embedding), ``hnorm`` (of the previous depth's hidden state), ``head_norm`` (before
    the shared head) and the projection ``eh_proj (dim, 2·dim)`` of their concatenation. Under SP
    all four run on the sequence shards with a replicated weight (``SequenceParallel``; the
    embedding and the hidden state are both ``Shard(1)``, and ``eh_proj`` works per token, so
    nothing is gathered: DTensor keeps a ``Shard(1)`` input of a replicated ``Linear`` sharded
    and sums the weight's ``Partial`` gradient over tp); ``eh_proj``'s output is a plain
    ``(batch, seq / tp, dim)`` tensor, as a block's input is. Without SP: nothing (plain modules on
    the replicated stream, computed alike on every tp rank). The depth's decoder block gets the
    family's own block plan."""
    if not sequence_parallel:
        return {}
    return {**{name: SequenceParallel() for name in ("enorm", "hnorm", "head_norm")},
            "eh_proj": SequenceParallel(use_local_output=True)}


def token_replicated_plan(prefix: str, sequence_parallel: bool) -> Plan:
    """Plan of a module at ``prefix`` that needs every token of the sequence on each tp rank and
    whose output is the same on each of them (the MoE layer: its router sees all tokens): under
    SP its input is all-gathered and its output sliced back to ``Shard(1)`` (backward: the
    reverse). Without SP the residual stream is already replicated: nothing to do."""
    if not sequence_parallel:
        return {}
    return {prefix: PrepareModuleInputOutput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True,
    )}


def reduce_grad(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Identity in forward; in backward the gradient of ``x`` is summed over ``mesh`` (Megatron's
    *f*). For a replicated tensor consumed by a tp-split computation, each rank of which gives
    only part of its gradient. Through DTensor: ``x`` is declared ``Replicate`` and its local
    gradient ``Partial``."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def sum_partial(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """All-reduce (sum) ``x`` over ``mesh`` in forward; identity in backward (Megatron's *g*): the
    output of a tp-split computation that each rank computed part of."""
    return DTensor.from_local(x, mesh, [Partial()], run_check=False).redistribute(placements=[Replicate()]).to_local()


class ReduceGradSlice(ParallelStyle):
    """Leaves a module replicated (plain parameters, computed the same on every tp rank) but sums
    over the tp ranks the gradient of its output's last-dim slice ``[start:]`` (:func:`reduce_grad`).

    For MLA's ``wkv_a``: its output is the latent ``c_KV`` (``[:kv_lora_rank]``), whose gradient
    comes back whole through ``wkv_b`` (column-wise, which all-reduces its input gradient), and
    the rotary key (``[kv_lora_rank:]``), shared by all heads, whose gradient each tp rank
    computes for its own heads only."""

    def __init__(self, start: int):
        super().__init__()
        self.start = start

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        start = self.start

        def hook(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
            return torch.cat([out[..., :start], reduce_grad(out[..., start:], device_mesh)], dim=-1)

        module.register_forward_hook(hook)
        return module


class VocabParallelEmbedding(ParallelStyle):
    """Splits an ``nn.Embedding`` ``(vocab, dim)`` over the vocabulary (``Shard(0)`` of its
    weight, ``torch.chunk``'s split: ``ceil(vocab / tp)`` rows a rank) and looks up on the local
    shard: ids ``(batch, seq)`` that another rank owns give zero rows, and the partial outputs are
    summed into ``output_layout`` (``Shard(1)``: reduce-scattered over the sequence, ``(batch,
    seq / tp, dim)``, under SP; ``Replicate()``: all-reduced, ``(batch, seq, dim)``); a plain
    tensor is returned. An id outside ``[0, vocab)`` raises, as with ``nn.Embedding``: a
    ``RuntimeError`` on the CPU, a device-side assert on CUDA (``torch._assert_async``: no host
    synchronisation). Megatron-LM's ``VocabParallelEmbedding`` (Shoeybi et al. 2019,
    arXiv:1909.08053), as torchtitan's vocab-parallel embedding (2026) runs it.

    Why not DTensor's ``RowwiseParallel``: its embedding backward has no row-wise strategy
    (torch 2.13, ``_embedding_ops.embedding_dense_backward_strategy``), so the weight's gradient
    comes back ``Partial`` with the **whole** vocabulary on every tp rank and is reduce-scattered
    only when FSDP2 reduces it. Under pipeline microbatches FSDP2 accumulates it unsharded in
    fp32: Llama 3.1 70B's first stage at tp=8 held 4.2 GB of whole-vocabulary gradient beside its
    2.1 GB bf16 one (``ray-titan dry-run``, 2026-11-26) where the local rows are 0.5 and 0.26 GB.
    Here the gradient is the local rows, ``Shard(0)`` as the weight: nothing to redistribute.

    Raises ``TypeError`` for a module that is not an ``nn.Embedding`` or uses ``padding_idx``,
    ``max_norm`` or sparse gradients; ``ValueError`` when the split would leave a rank no rows."""

    def __init__(self, *, output_layout: Placement):
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding) or module.padding_idx is not None or module.max_norm is not None \
                or module.sparse:
            raise TypeError(f"VocabParallelEmbedding takes a plain nn.Embedding, not {module!r}")
        tp, vocab = device_mesh.size(), module.num_embeddings
        rows = -(-vocab // tp)
        if rows * (tp - 1) >= vocab:
            raise ValueError(f"a vocabulary of {vocab} split {tp} ways (ceil({vocab}/{tp}) = {rows} rows a rank) "
                             "leaves the last tp rank no rows")
        module.register_parameter("weight", nn.Parameter(distribute_tensor(module.weight, device_mesh, [Shard(0)])))
        start = device_mesh.get_local_rank() * rows  # the coordinate is fixed: read it here, outside any fake mode
        module.forward = partial(_vocab_parallel_lookup, module, start, device_mesh, self.output_layout)  # type: ignore[method-assign]
        return module


def _vocab_parallel_lookup(module: nn.Embedding, start: int, mesh: DeviceMesh, layout: Placement,
                           ids: torch.Tensor) -> torch.Tensor:
    """:class:`VocabParallelEmbedding`'s forward: ids ``(batch, seq)`` (plain or a replicated
    ``DTensor``) to the summed rows in ``layout``, a plain tensor."""
    # A DTensor Shard(0) (FSDP2 swaps in its all-gathered one for the forward); to_local's
    # backward gives the gradient as the local rows, Shard(0).
    local = cast(DTensor, module.weight).to_local()
    if isinstance(ids, DTensor):
        ids = ids.to_local()
    # The masking below turns another rank's ids into zero rows, so an id outside the whole
    # vocabulary (a custom tokenizer's, 2^40, -1) would too, where nn.Embedding raises: refuse it
    # alike. _assert_async: a device-side assert on CUDA (no host sync in the step; the dry run
    # counts them), on the CPU a RuntimeError here.
    vocab = module.num_embeddings
    torch._assert_async(((ids >= 0) & (ids < vocab)).all(),
                        f"VocabParallelEmbedding: a token id outside the vocabulary [0, {vocab})")
    shifted = ids - start
    elsewhere = (shifted < 0) | (shifted >= local.shape[0])
    rows = F.embedding(shifted.masked_fill(elsewhere, 0), local).masked_fill(elsewhere.unsqueeze(-1), 0.0)
    return DTensor.from_local(rows, mesh, [Partial()], run_check=False).redistribute(mesh, [layout]).to_local()


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: Plan) -> None:
    """``parallelize_module(model, tp_mesh, plan)``: the planned modules' parameters become
    ``DTensor``s over ``tp_mesh`` (column-wise: ``Shard(0)`` of a ``Linear`` weight, row-wise:
    ``Shard(1)``, norms under SP: ``Replicate``) and their inputs and outputs are converted as
    planned. Apply first (before EP, activation checkpointing, FSDP), on the meta device."""
    if plan:
        parallelize_module(model, tp_mesh, plan)
