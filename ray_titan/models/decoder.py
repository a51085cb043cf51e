"""The decoder-only skeleton shared by the model families, and its common layers.

:class:`Decoder` holds the token embedding, a ``ModuleDict`` of blocks keyed by their index in
the whole model, the final norm and the output head, and the rotary tables; a family subclasses
it with its own block (:meth:`Decoder.make_layer`). Pipeline stages are made by removing modules
(``tok_embeddings``, entries of ``layers``, ``norm``/``output`` set to ``None``); fully qualified
parameter names stay those of the whole model, and :meth:`Decoder.init_weights` seeds every
parameter from its name, so a stage's weights do not depend on how the model was split.

Layers: RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467), rotary position embeddings (Su et al.
2021, arXiv:2104.09864) in Meta's interleaved-pair layout, and the SwiGLU feed-forward (Shazeer
2020, arXiv:2002.05202). Nothing here knows of parallelism, except that :meth:`init_weights`
copies into this rank's shard when a parameter is already a ``DTensor``.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ray_titan.models.rope import RopeScaling, inv_frequencies

__all__ = [
    "Decoder", "FeedForward", "MtpDecoder", "MtpDepth", "RMSNorm", "apply_rope", "count_parameters",
    "document_causal_mask", "param_seed",
    "rope_tables", "scaled_dot_product_attention",
]


def document_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """Block-causal attention mask of documents packed in a sequence: ``positions (batch, seq)``
    int64, each token's position within its document (a document starts where it is 0);
    returns ``(batch, 1, seq, seq)`` bool, True where query ``i`` may attend to key ``j``: ``j <=
    i`` and both in the same document (as torchtitan's per-document masks)."""
    doc = (positions == 0).cumsum(dim=1)
    seq = positions.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=positions.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def param_seed(seed: int, name: str) -> int:
    """A 63-bit seed for the parameter called ``name`` (its fully qualified name in the whole
    model), stable across processes and Python versions (SHA-256, not ``hash``)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019, arXiv:1910.07467).

    Input ``(..., dim)``, output the same shape.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(head_dim: int, max_seq_len: int, theta: float,
                scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of rotary embeddings, each ``(max_seq_len, head_dim // 2)`` fp32, with
    the frequencies and cos/sin factor of ``scaling`` (``ray_titan.models.rope``; None: plain)."""
    inv_freq, attention_factor = inv_frequencies(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    if attention_factor == 1.0:  # bitwise the unscaled tables
        return angles.cos(), angles.sin()
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` (same arguments and result), looked up at each call: the
    attentions' default ``core_attention`` hook. Not bound at import, because the simulated GPU
    (``ray_titan.dry_run``) replaces torch's function with its kernels' forms after the models load."""
    return F.scaled_dot_product_attention(*args, **kwargs)

def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(batch, seq, heads, head_dim)`` pairwise (interleaved pairs, as Meta's
    reference) by ``cos``/``sin`` ``(>= seq, head_dim // 2)``, whose first ``seq`` rows are used
    (positions ``0 .. seq - 1``), or ``(batch, seq, head_dim // 2)`` when each sequence has its
    own positions (documents packed in one sequence).

    Each pair ``(x1, x2)`` is multiplied as the complex number ``x1 + i x2`` by ``cos + i sin``
    (fp32), and its gradient by ``cos - i sin``: the products and sums of the real form
    ``(x1 cos - x2 sin, x1 sin + x2 cos)``, bitwise equal to it here, in a quarter of its CPU
    time (a dozen small ops forward and more backward dominated at small head dims). Only the
    ``cos``/``sin`` views are kept for backward, as before (:class:`_Rotate`)."""
    if cos.dim() == 3:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    else:
        seq = x.shape[1]
        cos, sin = cos[None, :seq, None, :], sin[None, :seq, None, :]
    return _Rotate.apply(x, cos, sin)


class _Rotate(torch.autograd.Function):
    """Rotary rotation as a complex multiply that saves only ``cos`` and ``sin`` (views of the
    model's tables): autograd's own complex multiply would keep a new ``cos + i sin`` per call."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _complex_rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _complex_rotate(grad, cos, -sin), None, None


def _complex_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # contiguous(): a slice of a wider projection (DeepSeek's rotary part) has no complex view.
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * torch.complex(cos, sin)).flatten(-2).type_as(x)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``. Input and output ``(batch, seq, dim)``."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Decoder(nn.Module):
    """Decoder-only language model skeleton shared by the model families.

    ``forward`` takes token ids ``(batch, seq)`` int64 when this module holds the embedding,
    otherwise hidden states ``(batch, seq, dim)``; it returns logits ``(batch, seq, vocab_size)``
    when it holds the output head (final-normed hidden states instead with :attr:`hidden_out`),
    otherwise hidden states. ``positions (batch, seq)`` int64, when
    given, is each token's position within its document (documents packed in one sequence): the
    rotary angles follow it and attention is block-causal within each document
    (:func:`document_causal_mask`); each block is then called with the mask as a fourth
    argument. ``layers`` is a ``ModuleDict`` keyed
    by the layer's index in the whole model, so a pipeline stage keeps the whole model's names.
    Subclasses provide :meth:`make_layer` and :attr:`rope_dim`.

    ``sequence_sharding`` (None: the whole sequence is here): a hook that context parallelism
    sets (``ray_titan.parallel.context``), with a method ``positions_and_mask(positions, device)
    -> (positions, mask)`` giving this rank's tokens' positions in the whole sequence and the
    mask of its queries over the keys its attentions' ``core_attention`` hooks see (None: those
    hooks mask causally themselves); then every block gets that mask.

    ``args.tie_word_embeddings`` (Llama 3.2 1B/3B, small Qwen3): the model has no ``output``
    module and computes logits with the embedding's weight; a last pipeline stage without the
    embedding gets an ``output`` copy (``ray_titan.parallel.pipeline.build_stage_module``),
    initialised as the embedding (:meth:`init_weights`), and the trainer sums the two copies'
    gradients across the first and last stages (``ray_titan.parallel.tied``). (One
    ``Parameter`` shared by two modules would come apart at ``to_empty``.)
    """

    #: Parameter-name suffixes of residual output projections, scaled by 1/sqrt(2·n_layers).
    RESIDUAL_OUTPUTS: tuple[str, ...] = ("wo.weight", "w2.weight")
    #: When True, :meth:`forward` on the last stage returns the final-normed hidden states
    #: ``(batch, seq, dim)``, not the logits: a chunked loss then applies the head itself
    #: (:meth:`logits`, a chunk of tokens at a time; ``training.loss_chunk_tokens``).
    hidden_out: bool = False

    # Types of the attributes set in __init__ (nn.Module's __getattr__ would give them as
    # ``Tensor | Module``); annotations only, no class attributes.
    layers: nn.ModuleDict
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    rope_positions: int  # the rotary tables' rows (fit_rope_tables)
    sequence_sharding: Any = None

    def __init__(self, args):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.make_layer(i) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = None if self.tied else nn.Linear(args.dim, args.vocab_size, bias=False)
        # Not persistent: recomputed by init_weights (also after materialising from meta).
        self.rope_positions = args.max_seq_len
        cos, sin = rope_tables(self.rope_dim, self.rope_positions, args.rope_theta, self.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def fit_rope_tables(self, positions: int) -> None:
        """Make the rotary tables ``rope_cos``/``rope_sin`` cover positions ``0 .. positions - 1``
        only, ``(positions, rope_dim // 2)`` fp32 each, on their current device (meta before
        materialising); :meth:`init_buffers` keeps that length. The trainer fits them to the
        job's ``training.seq_len`` instead of the model's ``max_seq_len`` (163,840 positions for
        DeepSeek-V3: 40 MiB of tables a rank holds for nothing), as torchtitan 0.3.0 sizes its
        rope cache from ``training.seq_len`` (``Decoder.Config.update_from_config``). Only the
        length changes: the frequencies depend on the scaling's
        ``original_max_position_embeddings``, never on the table's length, so each row is
        bitwise the full table's. Raises ``ValueError`` unless ``1 <= positions <=
        args.max_seq_len``."""
        if not 1 <= positions <= self.args.max_seq_len:
            raise ValueError(f"rotary tables of {positions} positions: the model covers 1 .. "
                             f"{self.args.max_seq_len} (max_seq_len)")
        self.rope_positions = positions
        with torch.device(self.rope_cos.device):
            self.rope_cos, self.rope_sin = rope_tables(self.rope_dim, positions, self.args.rope_theta,
                                                       self.rope_scaling)

    def make_layer(self, layer_id: int) -> nn.Module:
        raise NotImplementedError

    @property
    def rope_dim(self) -> int:
        """Per-head dimension that rotary embeddings rotate."""
        raise NotImplementedError

    @property
    def tied(self) -> bool:
        """Whether the output head shares the embedding's weight (``args.tie_word_embeddings``)."""
        return bool(self.args.tie_word_embeddings)

    @property
    def rope_scaling(self) -> RopeScaling | None:
        """The rope scaling of ``args`` (None: plain RoPE)."""
        return self.args.rope_scaling

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        h, _ = self.trunk(x, positions)
        if self.norm is None:  # not the last stage
            return h
        h = self.norm(h)
        return h if self.hidden_out else self.logits(h)

    def trunk(self, x: torch.Tensor, positions: torch.Tensor | None
              ) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
        """The embedding (when held) and this module's main blocks (keys below ``args.n_layers``;
        higher keys are a family's extra blocks, e.g. multi-token prediction's): ``(hidden states
        (batch, seq, dim), the blocks' rotary arguments: (cos, sin) or (cos, sin, mask))``."""
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        rope: tuple[torch.Tensor | None, ...]
        if self.sequence_sharding is not None:  # context parallel: this rank's slice, whole-sequence positions
            positions, mask = self.sequence_sharding.positions_and_mask(positions, h.device)
            rope = (self.rope_cos[positions], self.rope_sin[positions], mask)
        elif positions is None:
            # The whole tables: a block's attention may see more positions than ``h`` holds here
            # (sequence parallel keeps 1/tp of them between blocks); apply_rope takes what it needs.
            rope = (self.rope_cos, self.rope_sin)
        else:
            rope = (self.rope_cos[positions], self.rope_sin[positions], document_causal_mask(positions))
        n_layers = self.args.n_layers
        for key, layer in self.layers.items():
            if int(key) < n_layers:
                h = layer(h, *rope)
        return h, rope

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The output head on final-normed hidden states ``h (..., dim)``: logits ``(...,
        vocab_size)``, by the ``output`` module, or by the embedding's weight when tied and this
        module holds the embedding. Raises ``AttributeError`` on a stage without either."""
        if self.output is not None:
            return self.output(h)
        if self.tok_embeddings is not None:  # tied, and this module holds the embedding
            return F.linear(h, self.tok_embeddings.weight)
        raise AttributeError("this stage holds no output head")

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise every parameter deterministically from ``seed`` and its own name.

        Weights: normal(0, ``init_std``), residual output projections (:attr:`RESIDUAL_OUTPUTS`)
        scaled by 1/sqrt(2·n_layers) (GPT-2 style residual scaling); embeddings normal(0, 1), or
        normal(0, ``init_std``) when tied to the output head (as GPT-2 and Hugging Face's
        ``initializer_range`` do: a unit-variance head would give logits of std ~sqrt(dim));
        norms ones. Each full tensor is drawn on the CPU from a generator seeded by
        :func:`param_seed` and copied into the parameter, or into this rank's shard of it when
        the parameter is a ``DTensor`` (FSDP2, expert parallel), so the result is identical
        whatever the mesh. A tied output head is drawn as the embedding. Buffers are reset by
        :meth:`init_buffers`.
        """
        std = self.args.init_std
        for name, param in self.named_parameters():
            if (name == "output.weight" and self.tied) or name == "mtp_embeddings.weight":
                name = "tok_embeddings.weight"  # a last stage's copy of the embedding
            full = torch.empty(param.shape, dtype=torch.float32)
            if name.endswith("norm.weight"):
                full.fill_(1.0)
            else:
                g = torch.Generator().manual_seed(param_seed(seed, name))
                if name.startswith("tok_embeddings"):
                    full.normal_(0.0, std if self.tied else 1.0, generator=g)
                else:
                    s = std / math.sqrt(2 * self.args.n_layers) if name.endswith(self.RESIDUAL_OUTPUTS) else std
                    full.normal_(0.0, s, generator=g)
            _copy_full_into(param, full)
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Recompute the rotary tables (subclasses reset their own buffers too)."""
        cos, sin = rope_tables(self.rope_dim, self.rope_positions, self.args.rope_theta, self.rope_scaling)
        self.rope_cos = cos.to(self.rope_cos.device)
        self.rope_sin = sin.to(self.rope_sin.device)


class MtpDepth(nn.Module):
    """One depth of multi-token prediction around a family's own block (DeepSeek-V3,
    arXiv:2412.19437 §2.2, eq. 21–23; transformers' ``MtpLayer``), as a mixin placed before that
    block's class: DeepSeek's ``MtpBlock(MtpDepth, MoEBlock)``, GLM-4.5's
    ``Glm4MtpBlock(MtpDepth, Glm4MoeBlock)``, Qwen3.5's ``Qwen35MtpBlock(MtpDepth, Qwen35Block)``.
    The block's parameters keep their names; the depth adds ``enorm``, ``hnorm``, ``eh_proj``
    (``2·dim -> dim``) and ``head_norm`` (DeepSeek's ``shared_head.norm``), each norm of class
    :attr:`NORM` (the family's RMSNorm). ``h' = eh_proj [enorm(emb); hnorm(h)]`` (the embedding
    first, as DeepSeek's ``M_k[RMSNorm(h); RMSNorm(Emb)]`` is laid out in the released weights;
    GLM-4.5's and Qwen3.5's the same), then the block, then ``head_norm`` before the shared output
    head.

    ``__init__(args, layer_id, *more)``: the block's own (``args.dim``, ``args.norm_eps`` size the
    depth's parts). ``forward(h (batch, seq, dim), cos, sin, mask=None, emb=(batch, seq, dim))``:
    ``h`` the previous depth's output (depth 1: the main model's, :class:`MtpDecoder`), ``emb``
    the embedding of the tokens ``k`` ahead; returns the normed ``(batch, seq, dim)``. Raises
    ``ValueError`` without ``emb``. One call does it all, so FSDP2 gathers the depth's weights
    once."""

    NORM: ClassVar[type[RMSNorm]] = RMSNorm

    def __init__(self, args: Any, layer_id: int, *more: Any):
        super().__init__(args, layer_id, *more)  # the family's block, after this mixin in the MRO
        self.enorm = self.NORM(args.dim, args.norm_eps)
        self.hnorm = self.NORM(args.dim, args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.head_norm = self.NORM(args.dim, args.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None, emb: torch.Tensor | None = None) -> torch.Tensor:
        if emb is None:
            raise ValueError("an MTP block needs the embedding of the shifted tokens (emb=)")
        h = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(x)], dim=-1))
        return self.head_norm(super().forward(h, cos, sin, mask))


class MtpDecoder(Decoder):
    """A :class:`Decoder` with multi-token prediction (DeepSeek-V3 §2.2): with ``args.n_mtp_layers
    = D > 0`` ``layers`` also holds ``D`` depths (:meth:`make_mtp_layer`, an :class:`MtpDepth`
    around the family's block) under keys ``n_layers .. n_layers + D - 1`` (the DeepSeek-V3 and
    GLM-4.5 checkpoints' numbering); they belong to the last pipeline stage, which then also needs
    the token embedding: its own copy, ``mtp_embeddings``, when the stage does not hold
    ``tok_embeddings`` (``ray_titan.parallel.pipeline.build_stage_module``; kept equal as a tied
    embedding is, ``ray_titan.parallel.tied``). ``forward(x, positions=None, tokens=None)``: given
    the input ids ``tokens (batch, seq)`` int64 (every stage receives them; only the last reads
    them), a last stage holding the depths returns ``(logits, mtp logits of depth 1, ..., depth
    D)``, each ``(batch, seq, vocab_size)`` (final-normed hidden states under :attr:`hidden_out`);
    depth ``k``'s position ``i`` predicts token ``i + k + 1`` (its input is token ``i + k``,
    rolled in from the sequence's start past its end: those positions' labels are masked,
    ``ray_titan.trainer.mtp.mtp_labels``). Without ``tokens`` (validation) only the logits.

    Depth 1's hidden input is the main model's last block's output before its final norm
    (torchtitan's DeepSeek-V3), or after it when :attr:`MTP_AFTER_NORM` (Qwen3.5: vLLM's
    ``Qwen3NextMultiTokenPredictor`` is fed the target model's normed output)."""

    MTP_AFTER_NORM: ClassVar[bool] = False

    def __init__(self, args: Any):
        super().__init__(args)
        self.mtp_embeddings: nn.Embedding | None = None
        for k in range(getattr(args, "n_mtp_layers", 0)):
            self.layers[str(args.n_layers + k)] = self.make_mtp_layer(args.n_layers + k)

    def make_mtp_layer(self, layer_id: int) -> nn.Module:
        """The multi-token-prediction depth keyed ``layer_id`` (``n_layers + k``): an
        :class:`MtpDepth` around the family's block."""
        raise NotImplementedError

    @property
    def mtp_layer_ids(self) -> list[str]:
        """Keys in ``layers`` of the MTP depths this module holds, in depth order."""
        return [k for k in self.layers if int(k) >= self.args.n_layers]

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,  # type: ignore[override]
                tokens: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        # (the override returns a tuple with ``tokens``, which Decoder.forward does not take)
        h, rope = self.trunk(x, positions)
        if self.norm is None:
            return h
        # hidden_out (the chunked loss): each output stays hidden states; the loss applies the head.
        head = (lambda t: t) if self.hidden_out else self.logits
        normed = self.norm(h)
        out = head(normed)
        depths = self.mtp_layer_ids
        if tokens is None or not depths:
            return out
        emb = self.tok_embeddings if self.tok_embeddings is not None else self.mtp_embeddings
        assert emb is not None, "a last stage with MTP blocks has the embedding or its copy"
        outs = [out]
        if self.MTP_AFTER_NORM:
            h = normed
        for k, key in enumerate(depths, 1):
            h = self.layers[key](h, *rope, emb=emb(torch.roll(tokens, -k, dims=1)))
            outs.append(head(h))
        return tuple(outs)


def _copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into a plain parameter, or this rank's shard of a DTensor parameter."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        # Every rank drew the same full tensor, so slice locally: no scatter needed.
        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements (works on the meta device)."""
    return sum(p.numel() for p in model.parameters())
