"""Context parallelism: every sequence split over the ``cp`` ranks of one data-parallel rank.

The design torchtitan moved to (``torchtitan/distributed/context_parallel``) and the one that
runs forward and backward on every backend here: queries stay sharded by sequence, and each
attention layer all-gathers the keys and values of the whole sequence over the ``cp`` group
(an autograd-aware collective, ``torch.distributed._functional_collectives``: the backward
reduce-scatters their gradients back to the ranks that computed them). ``torch``'s own
``context_parallel()`` context manager has no sharding rule for the CPU attention kernels, and
FlexAttention has no CPU backward, so neither can be proven on the development machines.

**Causal load balancing** (the "head-tail" balancer of torchtitan and Megatron-LM): the sequence
is cut into ``2·cp`` equal chunks and cp rank ``i`` keeps chunks ``i`` and ``2·cp − 1 − i``. Under
a causal mask the attention work of a query grows with its position, so each rank then holds as
many early as late queries and every rank does the same work (:func:`attention_work` counts it).

**Positions** are those of the whole sequence: the rotary angles of a local token are those of
its global index, or of its position within its document (``training.document_mask``); the
mask is computed from the global indices of the local queries and of the gathered keys, and the
document ids of the whole sequence (rebuilt from the gathered positions), so a document that
crosses a chunk boundary is attended to exactly as on one rank.

The model knows nothing of this: :func:`apply_context_parallel` sets two hooks the decoder
defines (``Decoder.sequence_sharding`` and each attention's ``core_attention``), as the other
parallelisms are applied by the parallelize step (``ray_titan.parallel.stack``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.nn.attention.bias import CausalBias, CausalVariant

__all__ = [
    "ContextParallel", "apply_context_parallel", "attention_work", "balanced_indices", "shard_batch",
    "shard_sequence", "sharded_mask",
]


def balanced_indices(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global token indices kept by cp rank ``rank`` of ``cp``: chunks ``rank`` and ``2·cp − 1 −
    rank`` of the ``2·cp`` chunks of ``seq_len`` tokens (module docstring), ``(seq_len // cp,)``
    int64, increasing. Raises ``ValueError`` when ``2·cp`` does not divide ``seq_len`` (the
    pre-flight checks refuse that first, naming ``training.seq_len``)."""
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len = {seq_len} is not a multiple of 2·cp = {2 * cp}")
    chunk = seq_len // (2 * cp)
    head = torch.arange(rank * chunk, (rank + 1) * chunk)
    tail_start = (2 * cp - 1 - rank) * chunk
    return torch.cat([head, torch.arange(tail_start, tail_start + chunk)])


def shard_sequence(t: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """This cp rank's tokens of ``t`` ``(batch, seq, ...)``: ``(batch, seq // cp, ...)`` at
    :func:`balanced_indices` (a copy)."""
    return t[:, balanced_indices(t.shape[1], cp, rank).to(t.device)]


def attention_work(seq_len: int, cp: int) -> list[int]:
    """The (query, key) pairs each cp rank's queries attend to under a causal mask: its
    attention work. Equal on every rank with :func:`balanced_indices` (a contiguous split would
    give the last rank ``2·cp − 1`` times the first's)."""
    return [int((balanced_indices(seq_len, cp, r) + 1).sum()) for r in range(cp)]


def sharded_mask(whole: torch.Tensor | None, local: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
    """The attention mask of the queries at global indices ``local (q,)`` over the keys at global
    indices ``gathered (k,)`` (int64), True where the query may attend: the key is not after the
    query and, with ``whole`` (``(batch, seq)`` int64, every token's position within its
    document, in sequence order), both are in the same document (a document starts where the
    position is 0, as ``ray_titan.models.decoder.document_causal_mask``). Returns ``(batch or 1,
    1, q, k)`` bool: the rows ``local`` and columns ``gathered`` of the whole sequence's mask."""
    causal = gathered[None, :] <= local[:, None]  # (q, k)
    if whole is None:
        return causal[None, None]
    doc = (whole == 0).cumsum(dim=1)
    same = doc[:, local][:, :, None] == doc[:, gathered][:, None, :]
    return (same & causal)[:, None]


# torch's all-gather whose backward reduce-scatters: all_gather_single_autograd from torch 2.13
# (all_gather_tensor_autograd, deprecated there, is its alias), all_gather_tensor_autograd before.
_ALL_GATHER_AUTOGRAD: Any = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


class _LowerRightCausal(CausalBias):
    """``torch.nn.attention.bias.causal_lower_right(seq_len_q, seq_len_kv)`` without its storage:
    ``CausalBias`` has no ``__new__``, so ``torch.Tensor.__new__`` reads its arguments as sizes and
    allocates an uninitialised ``(2, seq_len_q, seq_len_kv)`` fp32 host tensor (torch 2.11-2.15):
    32 GiB of address space per attention chunk of a 131,072-token sequence at cp = 2, which a
    host without overcommit refuses. This one wraps an empty tensor; ``scaled_dot_product_attention``
    reads only its variant and lengths."""

    def __new__(cls, seq_len_q: int, seq_len_kv: int) -> _LowerRightCausal:
        return torch.Tensor._make_subclass(cls, torch.empty(0))

    def __init__(self, seq_len_q: int, seq_len_kv: int) -> None:
        super().__init__(CausalVariant.LOWER_RIGHT, seq_len_q, seq_len_kv)


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward makes the gradient contiguous: torch 2.11's reduce-scatter (the
    all-gather's backward) refuses the strided gradient ``movedim`` hands it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class _GatherSummedGrad(torch.autograd.Function):
    """All-gather on dim 0 over ``group`` whose backward all-reduces the gradient and keeps this
    rank's rows: the CPU (gloo) form of the autograd all-gather. On gloo the reduce-scatter of
    torch's form aborted a rank (SIGABRT while waiting for it, in a pipeline stage's backward of
    DeepSeek-V2 on cp = 2 × pp = 2) in 2 of 48 runs of that parity case here, and once in CI; none in 40 runs
    with this form. Twice the reduce-scatter's traffic: GPU groups keep torch's."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.rows = group, x.shape[0]
        return funcol.wait_tensor(funcol.all_gather_tensor(x, 0, group))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", ctx.group))
        start = dist.get_rank(ctx.group) * ctx.rows
        return total[start:start + ctx.rows], None


class ContextParallel:
    """One stage's context-parallel state: the ``cp`` process group, this rank's place in it and
    the sequence length ``seq_len`` of the whole sequence (``training.seq_len``).

    :meth:`positions_and_mask` is the decoder's ``sequence_sharding`` hook, :meth:`attend` each
    attention's ``core_attention``."""

    def __init__(self, group: dist.ProcessGroup, seq_len: int):
        self.group = group
        self.cp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.seq_len = seq_len
        self.gloo = dist.get_backend(group) == "gloo"
        self.local = balanced_indices(seq_len, self.cp, self.rank)
        # The global index of each key after the all-gather: the ranks' shares in rank order.
        self.gathered = torch.cat([balanced_indices(seq_len, self.cp, r) for r in range(self.cp)])
        chunk = seq_len // (2 * self.cp)
        ends = [(c + 1) * chunk for c in (self.rank, 2 * self.cp - 1 - self.rank)]
        # Made here, at build time: tensor subclasses without data, which a dispatch mode active
        # in the step (selective AC's, ray-titan dry-run's fake tensors) would refuse to wrap.
        with unset_fake_temporarily():
            self._causal = [(end, _LowerRightCausal(chunk, end)) for end in ends]
        self._bias: tuple[weakref.ref, weakref.ref, torch.dtype] | None = None  # (mask, its bias, dtype)

    def positions_and_mask(self, positions: torch.Tensor | None,
                           device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rotary positions of this rank's tokens and the attention mask of its queries over
        the gathered keys.

        ``positions``: ``(batch, seq_len / cp)`` int64, each local token's position within its
        document (``training.document_mask``, sharded as the tokens), or None (one causal
        sequence: a token's position is its global index). Returns ``positions`` (the given
        ones, or ``(1, seq_len / cp)`` global indices) and, with ``positions``, a bool mask
        ``(batch, 1, seq_len / cp, seq_len)`` (:func:`sharded_mask`: ``seq_len² / cp`` bytes a
        sequence); without, None: :meth:`attend` then needs no mask (two causal attentions, one
        per chunk). Collective over the cp group when ``positions`` is given (one all-gather of
        the positions)."""
        local, gathered = self.local.to(device), self.gathered.to(device)
        if positions is None:
            return local[None], None
        everyone = funcol.wait_tensor(funcol.all_gather_tensor(positions.contiguous(), gather_dim=1, group=self.group))
        whole = torch.empty_like(everyone)
        whole[:, gathered] = everyone  # the whole sequence's positions, in order
        return positions, sharded_mask(whole, local, gathered)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
               is_causal: bool = False, **kwargs) -> torch.Tensor:
        """``F.scaled_dot_product_attention`` of the local queries ``q (batch, heads, seq_len / cp,
        head_dim)`` over the keys and values of the whole sequence, all-gathered from the cp group
        (``k``, ``v``: ``(batch, kv_heads, seq_len / cp, head_dim)`` → ``(..., seq_len, ...)``,
        autograd-aware: their gradients are reduce-scattered back). ``attn_mask``: the mask of
        :meth:`positions_and_mask` (documents), or None: causal over the whole sequence, computed
        without a mask as two attentions, each of one local chunk over the keys up to its end,
        causal aligned to the lower right (``torch.nn.attention.bias.causal_lower_right``, which
        the flash and memory-efficient kernels take); ``is_causal`` is ignored either way. Other
        keywords (``scale``, ``enable_gqa``) pass through. Returns ``(batch, heads, seq_len / cp,
        head_dim)``."""
        k, v = self.gather(k), self.gather(v)
        if attn_mask is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self._additive(attn_mask, q.dtype), **kwargs)
        order = torch.argsort(self.gathered).to(k.device)  # gathered order → sequence order
        k, v = k.index_select(2, order), v.index_select(2, order)
        chunk = self.seq_len // (2 * self.cp)
        outs = []
        for j, (end, bias) in enumerate(self._causal):
            outs.append(F.scaled_dot_product_attention(
                q[:, :, j * chunk:(j + 1) * chunk], k[:, :, :end], v[:, :, :end], attn_mask=bias, **kwargs))
        return torch.cat(outs, dim=2)


    def _additive(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The additive form of a bool ``mask`` (0 where it holds, −inf elsewhere) in ``dtype``,
        made once for all the layers that attend with the same mask while it lives. Given the
        bool mask, the memory-efficient and cuDNN kernels convert it themselves, and autograd keeps
        each layer's copy for its backward: ``seq_len² / cp`` elements a sequence per layer
        (bf16: 128 GiB over 32 layers at 131,072 tokens, cp = 8) where this keeps one. Under
        ``torch.compile`` the bool mask is passed on unchanged."""
        if mask.dtype != torch.bool or torch.compiler.is_compiling():
            return mask
        held = self._bias
        bias = held[1]() if held is not None and held[0]() is mask and held[2] == dtype else None
        if bias is None:
            bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
            self._bias = (weakref.ref(mask), weakref.ref(bias), dtype)
        return bias

    def sequence_sum(self, t: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``t`` summed over the cp group (no gradient: the MoE balance loss's routing counts) and
        the cp degree: the ``sequence_sum`` hook of the MoE layers
        (``ray_titan.models.deepseek_v2.model.sequence_balance_loss``)."""
        return funcol.wait_tensor(funcol.all_reduce(t.detach(), "sum", self.group)), self.cp

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """``t (batch, heads, seq_len / cp, dim)`` of every cp rank, concatenated in rank order on
        the sequence dimension, with a backward that reduce-scatters the gradient."""
        # Gathered on dim 0 (what the autograd all-gather supports), then moved back.
        flat = t.movedim(2, 0).contiguous()
        if self.gloo:
            return _GatherSummedGrad.apply(flat, self.group).movedim(0, 2)
        out = _ALL_GATHER_AUTOGRAD(flat, 0, self.group)
        return _ContiguousGrad.apply(out).movedim(0, 2)


def apply_context_parallel(model: nn.Module, group: dist.ProcessGroup, seq_len: int) -> ContextParallel:
    """Make one stage module context-parallel in place: its ``sequence_sharding`` hook, every
    submodule's ``core_attention`` (the attention kernels) and ``sequence_sum`` (the MoE layers'
    sequence-wise balance loss) become those of a
    :class:`ContextParallel` over ``group``. Raises ``TypeError`` when the module has no
    ``sequence_sharding`` hook (not a ``ray_titan.models.decoder.Decoder``) or no attention with a
    ``core_attention`` hook (a family whose attention context parallelism does not cover)."""
    if not hasattr(model, "sequence_sharding"):
        raise TypeError(f"{type(model).__name__} has no sequence_sharding hook: not a Decoder")
    ctx = ContextParallel(group, seq_len)
    setattr(model, "sequence_sharding", ctx)  # noqa: B010  # plain attributes, not submodules
    found = [m for m in model.modules() if hasattr(m, "core_attention")]
    for m in found:
        setattr(m, "core_attention", ctx.attend)  # noqa: B010
    for m in model.modules():
        if hasattr(m, "sequence_sum"):  # MoE layers: the sequence-wise balance loss
            setattr(m, "sequence_sum", ctx.sequence_sum)  # noqa: B010
    if not found and len(getattr(model, "layers", ())):
        raise TypeError(f"{type(model).__name__}'s attention has no core_attention hook: context parallel "
                        "does not cover it")
    return ctx


def shard_batch(cp: int, rank: int, inputs: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """This cp rank's share of a data-parallel rank's batch: ``inputs``, ``labels`` and
    ``positions`` (``(batch, seq)``, the last may be None) each through :func:`shard_sequence`.
    The labels are already shifted by one against the inputs, so a token and its label stay on
    the same rank."""
    return (shard_sequence(inputs, cp, rank), shard_sequence(labels, cp, rank),
            None if positions is None else shard_sequence(positions, cp, rank))
