"""One stage's activations of one microbatch in the memory plan: the rows ``activations``,
``pipeline buffers`` and ``transient`` of the table in :mod:`ray_titan.preflight.memory_plan`, and
its "Activations per layer" (each family's formula, with its source, in
``ray_titan/models/<family>/costs.py``). What autograd keeps for backward under each block's
activation checkpointing, the transient above it while backward runs, and on a zero-bubble
schedule what an input-gradient step holds until its weight-gradient step."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ray_titan.config.schema import JobConfig
from ray_titan.models.costs import BlockActivations
from ray_titan.parallel.offload import offloads
from ray_titan.preflight.plan_job import _F32, _I64, _Job


def _cp_gathered(j: _Job) -> float:
    """Context parallel (``ray_titan.parallel.context``): bytes per local token each attention
    keeps above its own keys and values, the ``cp − 1`` other ranks' all-gathered (what the
    attention saves for backward is the whole sequence's ``k`` and ``v``: ``cp`` times the local
    ones). Their width from the model's arguments: MLA's reconstructed keys and values (``n_heads
    · (qk_head_dim + v_head_dim)``), else grouped-query ``2 · n_kv_heads · head_dim``, with document
    masks ``2 · n_heads · head_dim`` for all ``cp`` ranks (the heads repeated). 0 at cp = 1."""
    cp, a = j.dims.cp, j.args
    if cp == 1:
        return 0.0
    if getattr(a, "qk_head_dim", None):
        width = a.n_heads * (a.qk_head_dim + a.v_head_dim)
    elif j.cfg.training.document_mask and a.n_kv_heads != a.n_heads:
        # With a mask, SDPA's memory-efficient kernel takes no grouped heads: it attends over keys
        # and values repeated to every query head, and saves those (the simulated GPU's clone).
        return j.e * (cp * 2 * a.n_heads * a.head_dim - 2 * a.n_kv_heads * a.head_dim)
    else:
        width = 2 * a.n_kv_heads * a.head_dim
    return (cp - 1) * j.e * width


def _with_cp(j: _Job, blk: BlockActivations) -> BlockActivations:
    """A block's activations under context parallel (as they are at cp = 1): the gathered keys
    and values (:func:`_cp_gathered`) kept without AC, recomputed (gathered again) under op and
    full AC; with document masks the attention bias (the bool mask made additive in the
    activations' dtype, ``ContextParallel._additive``: ``seq_len`` elements a local token) made
    again while a recomputing backward runs. The bias the layers share is the stage's
    (:func:`_stage_activations`), not each block's."""
    gathered = _cp_gathered(j)
    if not gathered:
        return blk
    bias = j.e * j.cfg.training.seq_len if j.cfg.training.document_mask else 0
    return dataclasses.replace(blk, none=blk.none + gathered, backward=blk.backward + bias)


def _with_residual_dtype(j: _Job, blk: BlockActivations) -> BlockActivations:
    """A block's activations with its input in the residual stream's dtype: what activation
    checkpointing keeps of a block, its input (``input`` under full AC, and within ``op`` under
    op-level selective AC, whose other saved tensors are the cached op outputs), is the tensor
    the block was called with, the previous block's output or the embedding's: ``j.r`` bytes an
    element, bf16 under FSDP2's bf16 parameters (the embedding and every residual add compute in
    bf16), fp32 under autocast or in fp32. The families count it fp32 (``F32·d``). Measured on
    the simulated GPU (``ray-titan dry-run``, Llama 3.1 8B, FSDP, bf16, 16,384 tokens a rank,
    full AC): the kept block inputs are ``forward:add.Tensor``'s, 2 bytes an element; counted
    fp32 they were 4 GiB (11 % of the peak) too many, at cp = 8 (issue 42) as at cp = 1. A
    family whose ``op`` is its ``none`` (op SAC saves all of it) keeps its ``op``."""
    if j.r >= _F32 or not blk.input:
        return blk
    less = blk.input * (1 - j.r / _F32)
    return dataclasses.replace(blk, input=blk.input - less, op=blk.op - less if blk.op < blk.none else blk.op)


def _checkpointed(cfg: JobConfig, layer: int) -> str:
    """How block ``layer`` is checkpointed: ``none``, ``op`` or ``full`` (``ray_titan.parallel.ac``)."""
    ac = cfg.activation_checkpoint
    if ac.mode == "none":
        return "none"
    if ac.mode == "full":
        return "full"
    if ac.selective_option == "op":
        return "op"
    return "full" if layer % ac.layer_freq == 0 else "none"


@dataclass
class _StageActivations:
    """One stage's activations of one microbatch, bytes: what it keeps for backward (``kept``),
    the MoE experts' share of it, the transient above it while backward runs, its pipeline
    receive buffers over the step's microbatches, and ``freed``: the part of ``kept`` already
    freed at the transient's moment (the blocks after the one whose backward peaks, and the
    head), which the peak's split counts as temporaries (``RankPlan.categories``)."""

    kept: float
    experts: float
    transient: float
    pipe: float
    freed: float = 0.0  # of ``kept``, freed by the transient's moment (the split of the peak)
    # memory.activation_offload: what this microbatch's offloaded blocks keep in pinned host memory
    # instead (their device share is out of ``kept``; their copies back are in the transient).
    offloaded: float = 0.0
    # Zero-bubble schedules, a stage whose backward is split (not the first): what an input-
    # gradient step keeps for its weight-gradient step, and the two steps' transients
    # (:func:`_zero_bubble_terms`).
    held: float = 0.0
    input_transient: float = 0.0
    weight_transient: float = 0.0
    # The backward's moments, last first (the head on the last stage, then each block): bytes
    # kept up to it, its transient, its layer (-1: the head); for plan_ranks._fsdp_backward_moment.
    scan: list[tuple[float, float, int]] = field(default_factory=list)


def _stage_activations(j: _Job, s: int, act_modes: dict[str, float]) -> _StageActivations:
    """Stage ``s``'s activations (the table in :mod:`ray_titan.preflight.memory_plan`); adds its
    per-token bytes under each AC mode to ``act_modes``."""
    cfg, args, e, r, pp, tr = j.cfg, j.args, j.e, j.r, j.dims.pp, j.cfg.training
    first, last = s == 0, s == j.dims.num_stages - 1
    # Per token of one microbatch: what it keeps, and the most it holds while backward runs (from
    # the last block back: the blocks not yet done, the block being recomputed, the block's
    # backward temporaries).
    b = _scan_blocks(j, s, act_modes)
    kept_so_far, backward_peak, kept_at_peak, moe_part, unsplit = (
        b.kept_so_far, b.backward_peak, b.kept_at_peak, b.moe_part, b.unsplit)
    blocks, scan, host = b.blocks, b.scan, b.host
    head, loss_whole = 0.0, 0.0
    chunked = tr.loss_chunk_tokens > 0
    if last:  # final norm, output head's input, the loss's log-softmax (not kept by a chunked loss)
        head = _F32 * (2 * args.dim + 1) + e * args.dim + (0 if chunked else _F32 * j.vocab)
        if pp > 1 and not chunked:
            head += e * j.vocab  # the stage output (logits) waits for its backward
        loss_bwd = _loss_backward(j)
        scan.append((kept_so_far + head, loss_bwd, -1))
        if kept_so_far + head + loss_bwd >= backward_peak:
            backward_peak, kept_at_peak = kept_so_far + head + loss_bwd, kept_so_far + head
        if j.tp > 1 and not cfg.parallelism.loss_parallel:  # replicated logits: the loss's are whole
            unsplit += 0 if chunked else _F32 * j.vocab + (e * j.vocab if pp > 1 else 0)
            loss_whole = loss_bwd
    elif pp > 1:
        head = r * args.dim  # the stage's output waits for its backward
    for key in act_modes:
        act_modes[key] += head
    per_token = kept_so_far + head + (_I64 if first else 0)
    if j.dims.cp > 1 and tr.document_mask:
        # The document mask of the local queries over the whole sequence, bool, once a stage, and
        # its additive bias in the activations' dtype that every attention shares and saves (made
        # again in each block under full AC: _with_cp): seq_len bytes a local token, and e times it.
        per_token += tr.seq_len * (1 + (0 if cfg.activation_checkpoint.mode == "full" else j.e))
    # At the transient's moment (a block's backward) the blocks after it and the head are freed
    # already: kept bytes that the plan's split counts as temporaries then, not activations. Not
    # a last stage's logits under PP: the stage output, held by torch's backward_one_chunk until
    # it returns (simulated GPU, Interleaved1F1B).
    stays = (e * args.dim if chunked else e * j.vocab) if last and pp > 1 else 0.0
    freed = per_token - (_I64 if first else 0) - kept_at_peak - stays if backward_peak > per_token else 0.0
    n = cfg.parallelism.microbatches
    # Tensor parallel splits all but the projections' whole inputs (BlockActivations.whole); under
    # sequence parallel a stage sends and receives its 1/tp of the sequence.
    sp = j.tp if j.tp > 1 and cfg.parallelism.sequence_parallel else 1
    held = input_t = weight_t = 0.0
    if pp > 1 and j.rule is not None and j.rule.zero_bubble and not first:
        loss_t = _loss_backward(j) if last else 0.0
        held, input_t, weight_t = (x * j.tokens / j.tp for x in _zero_bubble_terms(j, s, blocks, loss_t))
    return _StageActivations(
        kept=(per_token / j.tp + unsplit * (1 - 1 / j.tp)) * j.tokens, experts=moe_part * j.tokens / j.tp,
        transient=(max(0.0, backward_peak - per_token) / j.tp + loss_whole * (1 - 1 / j.tp)) * j.tokens,
        freed=max(0.0, freed) * j.tokens / j.tp,
        pipe=r * args.dim * j.tokens * n * ((0 if first else 1) + (0 if last else 1)) / sp if pp > 1 else 0.0,
        held=held, input_transient=input_t, weight_transient=weight_t, offloaded=host * j.tokens / j.tp,
        scan=[(k * j.tokens / j.tp, t * j.tokens / j.tp, layer) for k, t, layer in scan])


@dataclass
class _BlockScan:
    """What :func:`_scan_blocks` finds over a stage's blocks, per token of a microbatch (bytes):
    ``kept_so_far`` (kept by all of them), ``backward_peak`` (the most held while one runs its
    backward), ``kept_at_peak``, ``moe_part``, ``unsplit`` (tp's whole parts), ``host``
    (offloaded), and the ``blocks`` and ``scan`` the zero-bubble and transient terms read."""

    kept_so_far: float
    backward_peak: float
    kept_at_peak: float
    moe_part: float
    unsplit: float
    host: float
    blocks: list
    scan: list[tuple[float, float, int]]


def _scan_blocks(j: _Job, s: int, act_modes: dict[str, float]) -> _BlockScan:
    """Stage ``s``'s blocks (and a last stage's multi-token-prediction depths), from the first:
    what each keeps, offloads and holds in its backward; adds each AC mode's bytes to
    ``act_modes``."""
    cfg, args, e, r, pp, tr = j.cfg, j.args, j.e, j.r, j.dims.pp, j.cfg.training
    first = s == 0
    kept_so_far, backward_peak, moe_part, unsplit = 0.0, 0.0, 0.0, 0.0
    kept_at_peak = 0.0  # what is still kept at the backward's peak moment (the blocks up to it)
    blocks = []  # (block, how checkpointed, layer), for the zero-bubble terms
    scan: list[tuple[float, float, int]] = []  # per block: kept up to it, its backward's transient, layer
    # Multi-token prediction's depths (the last stage's blocks after the main ones): each also
    # keeps its two input norms (the embedding's and the hidden state's, their concatenation the
    # projection's input) unless checkpointed (then the embedding, an input of the block), and
    # the same as the main head for its logits (its norm, the head's input, the loss's fp32
    # log-softmax; under PP the logits, an output of the stage).
    mtp = [int(k) for k in getattr(j.whole, "mtp_layer_ids", ())] if s == j.dims.num_stages - 1 else []
    logits = 0 if tr.loss_chunk_tokens > 0 else _F32 * j.vocab + (e * j.vocab if pp > 1 else 0)  # chunked: none kept
    one_head = _F32 * (2 * args.dim + 1) + e * args.dim + logits
    host, prev_off, prev_whole = 0.0, 0.0, 0.0  # activation offload: on the host; the block before's, back
    for i, layer in enumerate(j.split[s] + mtp):
        blk = _with_cp(j, _with_residual_dtype(
            j, j.spec.block_activations(args, layer, e, tr.seq_len, j.device, j.rho, j.dims.ep)))
        how = _checkpointed(cfg, layer)
        blocks.append((blk, how, layer))
        kept = blk.kept(how)
        if layer in mtp:
            kept += (2 * (_F32 * (2 * args.dim + 1) + e * args.dim) if how == "none" else e * args.dim) + one_head
        if i == 0 and not first:
            kept -= r * args.dim  # its input is the pipeline's receive buffer
        moved = j.device == "cuda" and offloads(cfg.memory.activation_offload, layer)  # a host device keeps them
        # Offloaded: every tensor the block saves without checkpointing; under full or op AC its
        # input (op checkpointing's cached outputs stay); not the receive buffer the pipeline holds.
        off = (kept if how == "none" else min(kept, blk.input)) if moved else 0.0
        host += (blk.kept(how) if how == "none" else blk.input) if moved else 0.0
        kept_so_far += kept - off
        whole_moved = moved and how == "none"  # moved with the rest: the experts' and tp's whole parts
        # Its backward: its own tensors back on the device, and the block before's, prefetched; the
        # whole (unsplit by tp) part of them comes back whole: (tp - 1) more of it before the / tp.
        whole = blk.whole if whole_moved else 0.0
        back = off + prev_off + (whole + prev_whole) * (j.tp - 1)
        transient = _block_transient(j, blk, how) + back
        scan.append((kept_so_far, transient, layer))
        if kept_so_far + transient > backward_peak:
            backward_peak, kept_at_peak = kept_so_far + transient, kept_so_far
        prev_off, prev_whole = off, whole
        moe_part += 0.0 if whole_moved else blk.experts(how)
        unsplit += 0.0 if whole_moved else blk.unsplit(how)
        lay = layer % cfg.activation_checkpoint.layer_freq == 0
        act_modes["none"] += blk.none
        act_modes["full"] += blk.input
        act_modes["selective_op"] += blk.op
        act_modes["selective_layer"] += blk.input if lay else blk.none
    return _BlockScan(kept_so_far, backward_peak, kept_at_peak, moe_part, unsplit, host, blocks, scan)


def _block_transient(j: _Job, blk: BlockActivations, how: str) -> float:
    """Bytes per token of a microbatch, before the plan's division by ``tp``, that block ``blk``
    checkpointed ``how`` holds above its kept activations while its backward runs: what it
    recomputes and its backward's transient, their whole part
    (:meth:`~ray_titan.models.costs.BlockActivations.transient_unsplit`) counted ``tp`` times so
    that each tensor-parallel rank's ``1/tp`` of it is the whole of it."""
    return blk.recompute(how) + blk.backward + blk.transient_unsplit(how) * (j.tp - 1)


def _loss_backward(j: _Job) -> float:
    """Bytes per token of a microbatch (of ``j.tokens``) that the loss's backward holds above
    what is kept. The plain loss: the gradients of the log-softmax and of the logits, both fp32
    (the loss upcasts bf16 logits; measured on the simulated GPU), ``2·4·V``. The chunked loss
    (``training.loss_chunk_tokens = c``, ``ray_titan.trainer.chunked_loss``): one chunk's
    recomputed log-softmax and those two gradients, ``3·4·V`` per token of ``min(c, T)``, and
    with more than one chunk the head weight's gradient of a chunk, ``e·V·d``, before autograd
    adds it to the others; spread over the microbatch's ``T`` tokens."""
    c, t = j.cfg.training.loss_chunk_tokens, j.tokens
    if c <= 0:
        return 2.0 * _F32 * j.vocab
    chunk = min(c, t)
    return (3.0 * _F32 * j.vocab * chunk + (j.e * j.vocab * j.args.dim if chunk < t else 0.0)) / t


def _zero_bubble_terms(j: _Job, s: int, blocks: list[tuple[Any, str, int]],
                       loss_bwd: float) -> tuple[float, float, float]:
    """Per token of one microbatch on stage ``s`` (not the first) of a zero-bubble schedule, bytes:
    what its input-gradient step ``I`` keeps until its weight-gradient step ``W``, the most ``I``
    holds above that and the kept activations, and the most ``W`` holds. ``blocks``: the stage's
    (block activations, how checkpointed, layer); ``loss_bwd``: the loss's backward on the last
    stage (0 elsewhere).

    Read from torch (``torch/distributed/pipelining``, 2.13): ``stage.backward_one_chunk(...,
    full_backward=False)`` runs ``_backward.stage_backward_input``, one ``autograd.grad`` to the
    stage input with ``retain_graph=True``: every saved activation stays (the graph is kept for
    ``W``, so nothing is freed as a full backward frees it) and each parameter group keeps the
    gradients flowing into its intermediate node, the output gradient of each weight-consuming op
    (``BlockActivations.weight_step_inputs``; on the last stage also the logits' gradient ``e·V``
    and the final norm's, ``4·d + e·d``). The first stage skips ``I`` and runs a full backward at
    ``W`` (``backward_weight_one_chunk``, ``stage_index == 0``): no terms here. ``W``
    (``stage_backward_weight``) calls ``autograd.grad`` once per parameter group, one per
    parameter tensor of a block: for a checkpointed block each call is a new graph task, so
    ``torch.utils.checkpoint`` (non-reentrant) recomputes the block each time and keeps every
    recomputed tensor whose saved-tensor holder is still alive until the graph dies at the step's
    end. Measured on the CPU (real tensors, one stage of debug blocks) and on the simulated GPU:
    ``W`` holds ``(G − 3)·R`` per checkpointed block plus one recomputation ``R`` in progress,
    ``G`` the block's parameter tensors and ``R`` its recomputed bytes (Llama: 6.9 R for one
    block, G = 9; 6.1 R per block over four; Qwen3 8.1 R, G = 11; DeepSeek-V2's dense block 7.8
    R, G = 10; its MoE block 7.5 R, G = 14, overestimated by this count)."""
    args, e, last = j.args, j.e, s == j.dims.num_stages - 1
    held = [blk.weight_step_inputs() for blk, _, _ in blocks]
    if blocks and not last:
        held[-1] -= j.r * args.dim  # the last block's output gradient is the received one (a pipeline buffer)
    head = e * j.vocab + _F32 * args.dim + e * args.dim if last else 0.0
    # I: from the last block back, each block's backward above the gradients already held.
    so_far, input_t = head, loss_bwd
    for (blk, how, _), h in zip(reversed(blocks), reversed(held)):
        input_t = max(input_t, so_far + _block_transient(j, blk, how))
        so_far += h
    input_t = max(input_t, so_far)
    recomputed = [(sum(1 for _ in j.whole.layers[str(layer)].parameters()), blk.recompute(how))
                  for blk, how, layer in blocks if how != "none"]
    leak = sum(max(0, g - 3) * r for g, r in recomputed) + max((r for _, r in recomputed), default=0.0)
    return so_far, input_t, leak
