"""Activation checkpointing of transformer blocks (docs/design.md, lesson 3).

Modes (``[activation_checkpoint]``):

- ``none``: every block keeps its activations from forward to backward.
- ``full``: every block keeps only its input and recomputes its forward in backward
  (``torch.utils.checkpoint``, non-reentrant). Activation memory of a stage falls to about one
  block's worth plus the block inputs, for about one extra forward of compute.
- ``selective`` / ``layer``: full checkpointing of every ``layer_freq``-th block (by its index
  in the whole model, so the choice is the same whatever the pipeline split).
- ``selective`` / ``op``: torchtitan's op-level selective activation checkpointing, its policy
  (torchtitan 0.3.0, ``torchtitan/distributed/activation_checkpoint.py``, ``SelectiveAC`` with
  its default config): every block saves the outputs of the ops in :data:`SAVED_OPS` (matmuls,
  attention, the float8 scaling ``max``, ``topk``, reduce-scatter and all-to-all) except every
  second matrix multiplication (``aten.mm`` / ``aten.linear``, counted per block and separately
  for the forward and its recomputation), never the router's matmul (torchtitan's default
  ``force_recompute_mm_shapes_by_fqns = ["moe.router.gate"]``), and recomputes the rest (norms,
  rotary embeddings, SiLU, products, casts) in backward
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``; Korthikanti et al. 2022,
  arXiv:2205.05198, for the idea of recomputing the cheap, memory-heavy ops).

The block is checkpointed by replacing its ``forward`` on the instance, not by wrapping it in
another module: parameter names stay those of the whole model (the weights are initialised from
their names, and checkpoints are keyed by them). Apply before FSDP2, which then runs its
unshard hooks around the checkpointed forward and the recomputation happens inside backward
after FSDP2's pre-backward unshard, as with torchtitan's ordering (AC, then FSDP).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["MM_OPS", "SAVED_OPS", "apply_ac", "op_sac_policy"]

_aten = torch.ops.aten


def _resolve(root: Any, path: str) -> Any:
    """``root.<path>`` where this torch registers it, else None (ops vary between versions)."""
    for part in path.split("."):
        root = getattr(root, part, None)
        if root is None:
            return None
    return root


def _compute_intensive_ops() -> set:
    """torch's own list of compute-intensive aten ops (``torch._functorch.partitioners``, what
    torchtitan starts its save list from), or the ones it lists on torch 2.13 where it is gone."""
    try:
        from torch._functorch.partitioners import get_default_op_list
    except ImportError:
        names = ["mm", "addmm", "bmm", "convolution", "convolution_backward", "_scaled_mm", "upsample_bilinear2d",
                 "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_flash_attention_forward", "_efficient_attention_forward"]
        return {op.default for op in (_resolve(_aten, n) for n in names) if op is not None}
    return {cast(Any, op).default for op in get_default_op_list().compute_intensive_ops}


def _saved_ops() -> frozenset:
    extra = [
        # SDPA variants; the CPU's flash kernel too, which torchtitan's list (written for GPUs) leaves
        # out: on the CPU op SAC then saves attention as it does on a GPU.
        "aten._scaled_dot_product_cudnn_attention.default", "aten._scaled_dot_product_attention_math.default",
        "aten._scaled_dot_product_fused_attention_overrideable.default",
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten.max.default",  # float8's absolute maximum (the scaling factor)
        "aten.linear.default", "aten.topk.default",  # linear: backends that do not decompose it
        "_c10d_functional.reduce_scatter_tensor.default", "_c10d_functional.all_to_all_single.default",
    ]
    ops = _compute_intensive_ops() | {op for op in (_resolve(torch.ops, p) for p in extra) if op is not None}
    ops |= {op for op in (_resolve(torch._higher_order_ops, n) for n in ("flex_attention", "inductor_compiled_code"))
            if op is not None}
    return frozenset(ops)


SAVED_OPS = _saved_ops()
"""Ops whose outputs op-level selective AC saves (every second matmul of :data:`MM_OPS` excepted);
every other op in a block is recomputed. torchtitan 0.3.0's list (``_get_default_save_ops``):
torch's compute-intensive ops, the SDPA variants, ``max``, flex attention, ``linear``, ``topk``,
compiled regions, reduce-scatter and all-to-all, those this torch registers; plus the CPU's flash
attention kernel."""

MM_OPS = frozenset({_aten.mm.default, _aten.linear.default})
"""The matrix multiplications op SAC counts: every second one per block is recomputed."""


def op_sac_policy(force_recompute: frozenset[tuple[int, ...]] = frozenset()) -> Callable[..., CheckpointPolicy]:
    """A fresh op-level SAC policy for one checkpointed call of a block (its forward and, in
    backward, its recomputation), torchtitan 0.3.0's ``SelectiveAC`` policy: a device-to-host copy
    is saved; a matmul of :data:`MM_OPS` whose right operand's shape ``(in, out)`` is in
    ``force_recompute`` is recomputed and not counted; of the other matmuls the 1st, 3rd, 5th…
    are saved and the 2nd, 4th… recomputed, counted from the start of the call separately for
    the forward and the recomputation (so both choose the same matmuls); other ops of
    :data:`SAVED_OPS` are saved, the rest recomputed."""
    counts = {False: 0, True: 0}  # matmuls seen, by ctx.is_recompute

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op is _aten._to_copy.default and args[0].device.type == "cuda" and str(kwargs.get("device")) == "cpu":
            return CheckpointPolicy.MUST_SAVE
        if op in MM_OPS:
            shape = tuple(args[1].shape)
            if (shape[::-1] if op is _aten.linear.default else shape) in force_recompute:
                return CheckpointPolicy.PREFER_RECOMPUTE
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _router_shapes(block: nn.Module) -> frozenset[tuple[int, ...]]:
    """The ``(in, out)`` shapes of the routers' weights in ``block`` (``moe.router``: ray_titan's
    router holds its gate's weight itself, torchtitan's an ``nn.Linear`` named ``gate``)."""
    return frozenset((w.shape[1], w.shape[0]) for name, m in block.named_modules()
                     if name.endswith("moe.router") and isinstance(w := getattr(m, "weight", None), torch.Tensor))


def _checkpoint_forward(block: nn.Module, context_fn=None) -> None:
    inner = block.forward  # the bound method of the class, captured before replacing it

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        extra = {"context_fn": context_fn} if context_fn is not None else {}
        return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)

    block.forward = forward


def apply_ac(model: nn.Module, mode: str, selective_option: str = "op", layer_freq: int = 2) -> list[str]:
    """Checkpoint the blocks of ``model.layers`` (a ``ModuleDict`` keyed by the layer's index in
    the whole model) in place, per ``mode`` (``none`` / ``full`` / ``selective``) and, for
    ``selective``, ``selective_option`` (``op`` / ``layer``) and ``layer_freq``. Returns the
    keys of the checkpointed blocks. Raises ``ValueError`` for an unknown mode or option."""
    if mode == "none":
        return []
    if mode not in ("full", "selective"):
        raise ValueError(f"activation_checkpoint.mode = {mode!r}; valid: 'none', 'full', 'selective'")
    if mode == "selective" and selective_option not in ("op", "layer"):
        raise ValueError(f"activation_checkpoint.selective_option = {selective_option!r}; valid: 'op', 'layer'")
    done = []
    for key, block in cast(nn.ModuleDict, model.layers).items():
        if mode == "selective" and selective_option == "layer" and int(key) % layer_freq:
            continue
        context_fn = None
        if mode == "selective" and selective_option == "op":
            context_fn = functools.partial(_op_context, _router_shapes(block))
        _checkpoint_forward(block, context_fn)
        done.append(key)
    return done


PROFILER_OPS = frozenset(op for op in (_resolve(torch.ops, p) for p in (
    "profiler._record_function_enter.default", "profiler._record_function_enter_new.default",
    "profiler._record_function_exit.default", "profiler._record_function_exit._RecordFunction")) if op is not None)
"""The profiler's range ops (``torch.profiler.record_function``), which op SAC leaves out of its
per-op count (:func:`_op_context`): a routed experts' FSDP2 unit inside a checkpointed block
(``ray_titan.parallel.fsdp.apply_fsdp``, bf16 or ``dp_shard > ep``) opens a different number of
FSDP ranges in the forward than in its recomputation, and SAC, which matches each op of the
recomputation to the forward's by its count, then failed in backward (``invocation index 2
encountered during backward but not found in storage``; DeepSeek-V3 16B, FSDP8 × EP8, bf16: the
``memory_vs_torchtitan`` benchmark). They hold no tensor: nothing to save or recompute."""


def _op_context(force_recompute: frozenset[tuple[int, ...]]):
    import torch.utils.checkpoint as ckpt

    ckpt.SAC_IGNORED_OPS |= PROFILER_OPS  # torch's own set of ops SAC runs uncounted: see PROFILER_OPS
    return create_selective_checkpoint_contexts(op_sac_policy(force_recompute))
