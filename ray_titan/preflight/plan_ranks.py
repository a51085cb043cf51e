"""Every rank's plan (:class:`~ray_titan.preflight.plan_types.RankPlan`): its pipeline rank's
stages' model states (:mod:`~ray_titan.preflight.plan_states`) and activations
(:mod:`~ray_titan.preflight.plan_activations`) times the microbatches the schedule keeps in flight,
at the moment of the most memory: the row ``peak`` of the table in
:mod:`ray_titan.preflight.memory_plan` and its "Microbatches in flight". On a mesh over
:data:`LISTED_RANKS` ranks, one plan stands for all the ranks of a pipeline rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ray_titan.config.schema import JobConfig
from ray_titan.preflight.plan_activations import _stage_activations, _StageActivations
from ray_titan.preflight.plan_job import _F32, _I64, _Job, _job, _job_summary
from ray_titan.preflight.plan_states import _model_states, _stage_params, _StageParams
from ray_titan.preflight.plan_types import RankPlan

if TYPE_CHECKING:
    from ray_titan.parallel.dims import ParallelDims


LISTED_RANKS = 1024
"""The one bound on the plan's mesh-sized work: a mesh of up to this many ranks gets one
:class:`RankPlan` per rank; a larger one, one per pipeline rank (its ranks share every figure),
standing for ranks ``rank`` to ``through``. A plan of a million ranks is then as small and quick
as one of a thousand (one record per rank was ~10 KB and ~50 µs: 6 GB and a minute)."""


def _plan_ranks(cfg: JobConfig, device: str, rho: float,
                vocab_size: int | None) -> tuple[dict[str, Any], list[RankPlan]]:
    """What was planned, and every rank's plan in rank order: the ranks of one pipeline rank
    share their figures (:func:`_pp_rank_plans`)."""
    j = _job(cfg, device, rho, vocab_size)
    plans = {p.rank: p for pp_rank in range(j.dims.pp) for p in _pp_rank_plans(j, pp_rank)}
    return _job_summary(j), [plans[r] for r in sorted(plans)]


def _pp_rank_plans(j: _Job, pp_rank: int) -> list[RankPlan]:
    """The plans of the ranks at pipeline rank ``pp_rank``: their stages' parameters and
    activations times the microbatches in flight, and the peak of the forward/backward and the
    optimizer phases."""
    from ray_titan.parallel.schedules import InFlight, local_stages

    cfg, dims, tr = j.cfg, j.dims, j.cfg.training
    pp, v, n = dims.pp, dims.stages_per_rank, cfg.parallelism.microbatches
    stage_ids = local_stages(j.rule.placement, pp, v, pp_rank) if pp > 1 and j.rule is not None else [0]
    flight = j.rule.in_flight(pp, v, n, pp_rank) if pp > 1 and j.rule is not None else \
        InFlight((1,), (1 if n > 1 else 0,))
    params = {s: _stage_params(j.whole, j.split[s], s == 0, s == dims.num_stages - 1, dims.fsdp_shard, dims.ep, j.tp,
                               j.bf16) for s in stage_ids}
    act_modes = dict.fromkeys(("none", "full", "selective_op", "selective_layer"), 0.0)
    acts = {s: _stage_activations(j, s, act_modes) for s in stage_ids}
    pipe = sum(a.pipe for a in acts.values())
    param_b, opt_b, grads_after, gathered, grads_during = _model_states(j, params)
    buffers = sum(p.buffers for p in params.values()) + 2 * _I64 * j.mb * n * tr.seq_len  # and the step's batch
    a_peak = sum(c * acts[s].kept for c, s in zip(flight.peak, stage_ids))
    a_grads = sum(c * acts[s].kept for c, s in zip(flight.with_grads, stage_ids))
    transient, freed = max((a.transient, a.freed) for a in acts.values())
    base = (0.0 if j.offload else param_b + opt_b) + gathered + pipe + buffers
    before_grads = base + a_peak + transient
    with_grads = base + grads_during + a_grads + transient
    # The first stage's backward ends with the embedding's whole gradient in the compute dtype beside
    # FSDP2's fp32 accumulation of it, the microbatch just done freed (gpt-oss-120B rank 0: 1.1 GiB).
    emb_grad = j.e * j.vocab * j.args.dim / j.tp if 0 in stage_ids and dims.fsdp_shard > 1 else 0.0
    a_after = sum(max(c - 1, 0) * acts[s].kept for c, s in zip(flight.peak, stage_ids))
    if emb_grad and base + grads_during + a_after + emb_grad > max(before_grads, with_grads):
        with_grads, a_grads, transient = base + grads_during + a_after + emb_grad, a_after, emb_grad
    in_flight = {s: c for c, s in zip(flight.peak, stage_ids)}
    gathered_less = 0.0  # of ``gathered``, what the peak's moment does not hold
    if pp == 1 and dims.fsdp_shard > 1:
        drop, gathered_less, less = _loss_moment_without_blocks(j, acts[0], params[0], gathered)
        before_grads -= drop
        # The gradient-syncing microbatch's backward, block by block; the first's is before_grads.
        fb = _fsdp_backward_moment(j, acts[0], params[0], less)
        if base + fb.activations + fb.transient + fb.grads - fb.gathered_less >= before_grads:
            with_grads = base + fb.activations + fb.transient + fb.grads - fb.gathered_less
            a_grads, transient, freed, grads_during = fb.activations, fb.transient, 0.0, fb.grads
            gathered_less = fb.gathered_less
    elif gathered and pp == 1 and n == 1:  # one rank under autocast: ``gathered`` is its weight copies
        with_grads -= (casts := _autocast_freed(params, gathered))
        gathered_less = casts if with_grads >= before_grads else 0.0
    if pp > 1 and j.rule is not None and j.rule.stages_per_rank != 1:
        # Several stages per rank (interleaved, zero-bubble, DualPipeV): the peak's moment found
        # by walking the rank's actions, each stage's backward with what is in flight then, and
        # what stays from each input-gradient step to its weight-gradient step (_zero_bubble_peak).
        zb = _zero_bubble_peak(j, pp_rank, stage_ids, acts, params, grads_during)
        before_grads = with_grads = base + zb.activations + zb.transient + zb.grads
        a_peak = a_grads = zb.activations
        transient, freed, in_flight, grads_during = zb.transient, zb.freed, zb.in_flight, zb.grads
    fwd_bwd = max(before_grads, with_grads)
    optim = (0.0 if j.offload else param_b + grads_after + opt_b) + pipe + buffers
    peak, phase = (fwd_bwd, "forward_backward") if fwd_bwd >= optim else (optim, "optimizer")
    peak_grads = grads_during if with_grads >= before_grads else 0.0
    off, plans = j.offload, []
    act_mb = {s: int(acts[s].kept) for s in stage_ids}
    by_mode = {k: int(x * j.tokens / j.tp) for k, x in act_modes.items()}
    for rank, through in _listed_ranks(dims, pp_rank):
        plans.append(RankPlan(
            rank=rank, coords=dims.coords(rank), through=through, stages=stage_ids,
            parameters=int(0 if off else param_b),
            gradients=int(0 if off else grads_after),
            optimizer_state={cfg.optimizer.name: int(0 if off else opt_b)},
            fsdp_unsharded_params=int(gathered - (gathered_less if phase == "forward_backward" else 0.0)),
            fsdp_unsharded_grads=int(grads_during if dims.fsdp_shard > 1 else 0),
            activations_per_microbatch=dict(act_mb), in_flight=dict(in_flight),
            activations=int(a_peak if before_grads >= with_grads else a_grads),
            activations_by_ac_mode=dict(by_mode),
            expert_buffers=int(sum(c * acts[s].experts for c, s in zip(flight.peak, stage_ids))),
            pipeline_buffers=int(pipe), buffers=int(buffers), transient=int(transient),
            peak=int(peak), peak_phase=phase,
            offloaded=int(param_b + grads_after + opt_b) if off else 0,
            activations_offloaded=int(sum(c * acts[s].offloaded for c, s in zip(flight.peak, stage_ids))),
            offload_bytes_per_step=int(n * sum(acts[s].offloaded for s in stage_ids)),
            peak_grads=int(peak_grads if phase == "forward_backward" else grads_after),
            activations_freed_at_peak=int(min(freed, a_peak if before_grads >= with_grads else a_grads)),
        ))
    return plans


def _autocast_freed(params: dict[int, _StageParams], gathered: float) -> float:
    """Of autocast's bf16 weight copies (``gathered``, bytes; one rank without FSDP2), those gone
    when a lone microbatch's backward ends: autocast's region ends with the forward, so from then
    on each block's copies live only in the tensors its backward saved, and go with them; the
    first block's remain. (An H200, the 1B shape under full AC: counting them all there put the
    plan 1.7 GiB above the measured peak; benchmarks/results/2026-11-28-gpu-levers-h200.md.)"""
    keep = 2.0 * max((g.local for p in params.values() for g in [*p.blocks.values(), *p.experts.values()]), default=0)
    return gathered - keep


def _loss_moment_without_blocks(j: _Job, acts: Any, params: Any, gathered: float) -> tuple[float, float, float]:
    """FSDP2 without PP: at the loss's backward FSDP2 has gathered none of the blocks yet (each
    resharded after forward; the last block's pre-backward gathers it, and prefetches the one
    before, only after the head's backward). Returns ``(drop, gathered_less, less)``: how much
    lower the forward/backward peak before gradients is where the loss's moment was the largest
    of the stage's scan (bytes), the gathered bytes that moment does not hold (0 where the peak
    is another moment), and the blocks' gathered bytes at the loss (``_blocks_gathered_at_loss``)."""
    less = _blocks_gathered_at_loss(j, params, gathered)
    if not less:
        return 0.0, 0.0, less
    moments = [(k + t, layer) for k, t, layer in acts.scan]
    top = max(m for m, _ in moments)
    top_less = max(m - (less if layer < 0 else 0.0) for m, layer in moments)
    if top_less >= top:  # the loss's moment was not the largest
        return 0.0, 0.0, less
    at_loss = top_less == max(m - less for m, layer in moments if layer < 0)
    return top - top_less, less if at_loss else 0.0, less


def _listed_ranks(dims: ParallelDims, pp_rank: int) -> list[tuple[int, int | None]]:
    """The plans to make for pipeline rank ``pp_rank``: ``(rank, None)`` for each of its ranks, or
    one ``(first, last)`` span on a mesh over :data:`LISTED_RANKS` ranks."""
    per_pp = dims.world_size // dims.pp  # pp is the mesh's outermost axis: a pp rank's ranks are one block
    first, last = pp_rank * per_pp, (pp_rank + 1) * per_pp - 1
    if dims.world_size > LISTED_RANKS:
        return [(first, last if last > first else None)]
    return [(rank, None) for rank in range(first, last + 1)]


def _blocks_gathered_at_loss(j: _Job, p: _StageParams, gathered: float) -> float:
    """Bytes of ``gathered`` (FSDP2's unsharded parameters, one stage without PP) that the loss's
    backward does not hold: the blocks' (two: the running and the prefetched), where FSDP2
    reshards them after forward; only the root group (final norm, head) is gathered then. 0 with
    tensor parallel or multi-token prediction (not measured) or without resharding. Measured on
    the simulated GPU (Llama 3.1 8B, FSDP over dp_shard × cp = 8, bf16, full AC, the peak at the
    loss's backward: the head's bf16 weight alone, ``forward:resize_`` 1.05 GB)."""
    if j.tp > 1 or not j.reshard or j.cfg.model.mtp_layers:
        return 0.0
    return max(0.0, gathered - j.e * p.root.full)


@dataclass
class _Moment:
    """The peak's moment of a zero-bubble rank (:func:`_zero_bubble_peak`), bytes: the kept
    activations, the transient (what input-gradient steps hold for their weight-gradient steps
    and the running step's own), the part of ``activations`` a full backward has freed by then,
    the gradients, and the microbatches in flight per stage."""

    activations: float
    transient: float
    freed: float
    grads: float
    in_flight: dict[int, int]
    gathered_less: float = 0.0  # of FSDP2's gathered parameters, what this moment does not hold


def _fsdp_backward_moment(j: _Job, a: _StageActivations, p: _StageParams, at_loss_less: float = 0.0) -> _Moment:
    """The most memory above the resident states while FSDP2 (no PP) runs the backward of the
    microbatch that syncs gradients (the last; the only one with one microbatch), from the head
    to the first block (``a.scan``): what is still kept up to the block, its transient, the
    gradients, and the reduce-scatter's buffers of the block finished just before (its gradient
    in the parameter dtype and the fp32 copy reduced, ``(e + 4)·G`` for the largest block ``G``;
    from the second block on: the head's groups are reduced last, with the root). Gradients: with
    several microbatches the accumulated unsharded ones (fp32) less what the finished blocks'
    reduce-scatters freed (their shards stay, on the host under CPU offload); with one, the
    finished blocks' shards and the root's unsharded ones. Measured on the simulated GPU
    (``ray-titan dry-run``, 2026-11-26): the peak at a checkpointed block's recomputation, the
    buffers ``(e + 4)·G`` of the block after it beside it (fsdp2 bf16 full AC, HSDP fp32
    selective layer). ``at_loss_less``: the gathered bytes the loss's moment does not hold
    (:func:`_blocks_gathered_at_loss`)."""
    n, pe = j.cfg.parallelism.microbatches, j.e
    biggest = max((g.full for g in [*p.blocks.values(), *p.experts.values()]), default=0)
    extra = a.kept - (a.scan[-1][0] if a.scan else 0.0)  # kept outside the blocks (the token ids)
    groups = dict(p.blocks)
    total_full = sum(g.full for g in p.groups()) + p.unmanaged
    best: _Moment | None = None
    finished: list[int] = []
    for kept, t, layer in reversed(a.scan):
        done = [groups[x] for x in finished if x in groups]
        shards = 0.0 if j.offload else _F32 * sum(g.local for g in done)  # CPU offload: on the host
        if n > 1:
            grads = _F32 * (total_full - sum(g.full for g in done)) + shards
        else:
            grads = shards + pe * (p.root.full - _root_grads_later(j, layer))
        rs = (pe + _F32) * biggest if done else 0.0
        m = _Moment(kept + extra, t + rs, 0.0, grads, {0: 1}, at_loss_less if layer < 0 else 0.0)
        if best is None or (m.activations + m.transient + m.grads - m.gathered_less
                            > best.activations + best.transient + best.grads - best.gathered_less):
            best = m
        if layer >= 0:
            finished.append(layer)
    assert best is not None
    return best


def _root_grads_later(j: _Job, layer: int) -> float:
    """Elements of the root group's unsharded gradients (one stage without PP: embedding, final
    norm, head) not yet computed at the backward moment of ``layer`` (-1: the loss's), one
    microbatch: an untied embedding's, computed last; at the loss's moment the head's too, unless
    the chunked loss has summed earlier chunks' head gradients (the simulated GPU, 2026-11-27:
    none at the plain loss's backward, the head's at a block's)."""
    head = j.vocab * j.args.dim / j.tp
    later = 0.0 if j.args.tie_word_embeddings else head  # the untied embedding
    if layer < 0 and j.cfg.training.loss_chunk_tokens <= 0:
        later += head
    return later


def _zero_bubble_peak(j: _Job, pp_rank: int, stage_ids: list[int], acts: dict[int, _StageActivations],
                      params: dict[int, _StageParams], grads_during: float) -> _Moment:
    """Walk pp rank ``pp_rank``'s actions of one step as torch orders them
    (``ray_titan.parallel.schedules.rank_actions``) and return the moment of the most memory
    above the resident states: a forward adds its stage's kept activations; an input-gradient
    step ``I`` of a stage that is not the first runs its transient and then keeps ``held`` until
    its ``W``; ``W`` (on the first stage a full backward) and a full backward ``B`` run theirs and
    end the microbatch. Gradients count from a stage's first ``W`` or ``B`` on (a full backward's
    from its end, when its transient is gone; a ``W``'s beside what it keeps at its end): FSDP2's
    unsharded accumulation of that stage (more than one microbatch), else its sharded ones
    (:class:`~ray_titan.preflight.plan_activations._StageActivations`,
    :func:`~ray_titan.preflight.plan_activations._zero_bubble_terms`)."""
    from ray_titan.parallel.schedules import rank_actions

    dims, n = j.dims, j.cfg.parallelism.microbatches
    fsdp_acc = dims.fsdp_shard > 1 and n > 1

    def stage_grads(s: int) -> float:
        p = params[s]
        return _F32 * (p.full + p.unmanaged) if fsdp_acc else _F32 * p.local

    per_stage = {s: stage_grads(s) for s in stage_ids}
    scale = grads_during / max(1.0, sum(per_stage.values()))  # FSDP2 with one microbatch: its own count
    in_flight, held = dict.fromkeys(stage_ids, 0), dict.fromkeys(stage_ids, 0)
    done: set[int] = set()
    best = _Moment(0.0, 0.0, 0.0, 0.0, dict(in_flight))

    def moment(t: float, freed: float = 0.0) -> None:
        nonlocal best
        kept = sum(in_flight[x] * acts[x].kept for x in stage_ids)
        grads = sum(per_stage[x] for x in done) * (1.0 if fsdp_acc or dims.fsdp_shard == 1 else scale)
        transient = t + sum(held[x] * acts[x].held for x in stage_ids)
        if kept + transient + grads > best.activations + best.transient + best.grads:
            best = _Moment(kept, transient, min(freed, kept), grads, dict(in_flight))

    for kind, s, _ in rank_actions(j.cfg.parallelism.pipeline_schedule, dims.pp, dims.stages_per_rank, n, pp_rank):
        a, first = acts[s], s == 0
        if kind == "F":
            in_flight[s] += 1
            moment(0.0)
        elif kind == "I":
            moment(0.0 if first else a.input_transient)
            held[s] += 0 if first else 1
        elif kind == "W" and not first:
            # W consumes the held gradients as it makes the weight gradients: at its start the
            # one, at its end the other and (checkpointed blocks) the recomputations it keeps.
            moment(0.0)
            held[s] -= 1
            done.add(s)
            moment(a.weight_transient)
            in_flight[s] -= 1
        else:  # a full backward (B, or W of the first stage): its weight gradients come at its end
            moment(a.transient, a.freed)
            in_flight[s] -= 1
            done.add(s)
            moment(0.0)
    return best
