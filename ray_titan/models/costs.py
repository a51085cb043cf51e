"""What a model family costs, the generic part: training FLOPs per token and the activation bytes
a block saves for backward. Each family's own formulas live in ``ray_titan/models/<family>/costs.py``
and reach the trainer, the metrics and the memory plan through its
:class:`~ray_titan.models.registry.ModelSpec` (``flops_per_token``, ``block_activations``).

**FLOPs** (PaLM, Chowdhery et al. 2022, arXiv:2204.02311, Appendix B), per token of a training
step (forward + backward): ``6·N + 12·L·H·Q·T``.

- ``6·N``: every weight matrix of ``N`` parameters costs 2 FLOPs per parameter per token in
  the forward pass (one multiply, one add) and 4 in the backward pass (gradients of the input
  and of the weight). ``N`` is the number of *non-embedding* parameters: the token-embedding
  lookup is a gather, not a matmul, so it is excluded, while the output head (a matmul) is
  included. For a mixture-of-experts model ``N`` is the *activated* non-embedding parameters:
  the shared parameters plus the ``top_k`` routed experts a token visits (plus shared experts),
  not all experts.
- ``12·L·H·Q·T``: the two attention matmuls (``Q·Kᵀ`` and ``scores·V``) of each of ``L``
  layers, ``H`` heads of dimension ``Q`` over a context of ``T`` tokens: 2 FLOPs × 2 matmuls ×
  3 (forward + backward). ``H·Q`` is the attention width. Where queries/keys and values have
  different head dimensions (DeepSeek-V2's multi-head latent attention: 192 and 128), the two
  matmuls cost ``6·L·H·(d_qk + d_v)·T``, so pass ``H·(d_qk + d_v)/2``. By convention the causal
  mask's half-empty score matrix is not discounted and activation recomputation is not counted,
  so MFU stays comparable across trainers (torchtitan and the PaLM paper count the same way).

**Activations per block** (:class:`BlockActivations`), following the method of Korthikanti et al.
2022 ("Reducing Activation Recomputation in Large Transformer Models", arXiv:2205.05198, §4.1:
count the tensors each operation saves for backward, per token), applied to this trainer's exact
blocks, in bytes per token with ``e`` the activation element size (4 in fp32, 2 under
``training.mixed_precision = "bf16"``) and fp32 (4) for the residual stream, norm statistics,
router scores and the loss's log-softmax. Each family's formula is checked against what autograd
saves in one block's forward (``tests/integration/test_memory_plan.py``, the families' tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["F32", "I64", "BlockActivations", "fused_attention", "op_sac_saved", "transformer_flops_per_token"]

F32, I64 = 4, 8
"""Bytes of an fp32 and an int64 element."""


def transformer_flops_per_token(
    non_embedding_params: int, n_layers: int, attention_dim: int, seq_len: int
) -> int:
    """Training FLOPs per token, ``6·N + 12·L·(H·Q)·T`` (PaLM, Appendix B; module docstring).

    ``non_embedding_params`` (N): parameters that take part in matmuls for one token, i.e. all
    parameters minus the token embedding; for MoE the *activated* ones (shared + ``top_k``
    routed + shared experts). ``attention_dim``: heads × head dimension (``H·Q``), or
    ``H·(d_qk + d_v)/2`` when query/key and value head dimensions differ (MLA). ``seq_len`` (T):
    tokens of context each token attends over. Raises ``ValueError`` for a negative argument.
    """
    args = dict(non_embedding_params=non_embedding_params, n_layers=n_layers,
                attention_dim=attention_dim, seq_len=seq_len)
    for name, value in args.items():
        if value < 0:
            raise ValueError(f"{name} = {value} must be >= 0")
    return 6 * non_embedding_params + 12 * n_layers * attention_dim * seq_len


@dataclass(frozen=True)
class BlockActivations:
    """Bytes per token one block saves for backward: ``none`` (everything autograd saves),
    ``op`` (op-level selective AC: the block input, attention's outputs and every second matmul's,
    :func:`op_sac_saved`),
    ``input`` (full AC: the block input), and ``backward`` (the transient of its backward, or of
    its forward where that is larger: an MoE layer's combine of the routed outputs);
    ``experts_none`` / ``experts_op``: the MoE dispatch and expert part of ``none`` / ``op``;
    ``whole``: the part of ``none`` and ``op`` that tensor parallel does not split, the inputs of
    the column-parallel projections (under sequence parallel all-gathered over the sequence, and
    saved so by the projection: measured on the simulated GPU, ``ray-titan dry-run``);
    ``weight_step``: what a zero-bubble schedule's input-gradient step keeps for the block's
    weight-gradient step (:meth:`weight_step_inputs`); ``whole_op``: the part of ``op`` that
    tensor parallel does not split, where a family counts it apart from ``whole`` (None: ``whole``);
    ``backward_whole``: the part of ``backward`` that tensor parallel does not split (an MoE
    layer's combine of the routed outputs: the routed copies of the whole, gathered sequence)."""

    none: float
    op: float
    input: float
    backward: float
    experts_none: float = 0.0
    experts_op: float = 0.0
    whole: float = 0.0
    weight_step: float | None = None
    whole_op: float | None = None
    backward_whole: float = 0.0

    def weight_step_inputs(self) -> float:
        """Bytes per token a zero-bubble input-gradient step (``I``) keeps until the block's
        weight-gradient step (``W``): the gradient of every weight-consuming op's output
        (``torch.distributed.pipelining._backward.stage_backward_input`` keeps each parameter
        group's ``grads``: the gradients flowing into the autograd nodes where the input's and
        the weight's paths meet, the linear layers' and the norms' products). A family's own
        count where it gives one, else ``op`` (the outputs of the matmuls and attention, the same
        shapes)."""
        return self.op if self.weight_step is None else self.weight_step

    def unsplit(self, checkpointed: str) -> float:
        """Bytes per token within :meth:`kept` that every tensor-parallel rank keeps whole."""
        if checkpointed == "op" and self.whole_op is not None:
            return self.whole_op
        return 0.0 if checkpointed == "full" else self.whole

    def transient_unsplit(self, checkpointed: str) -> float:
        """Bytes per token within :meth:`recompute` and ``backward`` that every tensor-parallel
        rank holds whole while the block's backward runs: what it recomputes of ``whole`` (the
        whole part of ``none`` less that of :meth:`kept`) and ``backward_whole``."""
        return max(0.0, self.unsplit("none") - self.unsplit(checkpointed)) + self.backward_whole

    def experts(self, checkpointed: str) -> float:
        """Bytes per token of the MoE dispatch and expert activations within :meth:`kept`."""
        return {"none": self.experts_none, "op": self.experts_op, "full": 0.0}[checkpointed]

    def kept(self, checkpointed: str) -> float:
        """Bytes per token kept until backward under ``checkpointed`` (``none``, ``op``, ``full``)."""
        return {"none": self.none, "op": self.op, "full": self.input}[checkpointed]

    def recompute(self, checkpointed: str) -> float:
        """Bytes per token that exist only while backward recomputes this block."""
        return {"none": 0.0, "op": self.none - self.op, "full": self.none - self.input}[checkpointed]


def op_sac_saved(outputs: list[float], before: int = 0) -> float:
    """Bytes per token op-level selective AC saves of a block's matrix multiplications, given the
    outputs (bytes per token) of those it counts, in forward order, after ``before`` counted ones:
    the 1st, 3rd, 5th… of the block (torchtitan 0.3.0's every-second-matmul rule,
    ``ray_titan.parallel.ac.op_sac_policy``)."""
    return sum(size for i, size in enumerate(outputs, before + 1) if i % 2)


def fused_attention(args: Any, device: str) -> bool:
    """Whether ``scaled_dot_product_attention`` runs a fused kernel (no ``s × s`` probabilities
    saved): every accelerator kernel; on the CPU only where query/key and value head dimensions
    are equal (otherwise PyTorch falls back to its math kernel)."""
    qk = getattr(args, "qk_head_dim", None) or args.dim // args.n_heads
    v = getattr(args, "v_head_dim", None) or qk
    return device != "cpu" or qk == v
