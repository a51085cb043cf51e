"""The memory plan: every rank's memory predicted before any worker starts, whether the job fits
its devices, and the levers that would make it fit, ranked by what they cost.

``memory_plan(cfg)`` (and ``ray-titan memory plan --config X``) builds the model on the meta
device (nothing allocated), cuts it into the job's pipeline stages and, for every rank of the
mesh (by its coordinates), adds up:

====================  ===========================================================================
part                  bytes
====================  ===========================================================================
parameters            this rank's shards, fp32: ``4·Ψ_r``, Ψ_r the elements it holds. FSDP2
                      shards dim 0 over ``dp_shard`` (padded to a multiple of it); expert
                      parallel splits the routed experts over ``ep`` first, and FSDP shards them
                      over what is left (``dp_shard / ep``).
gradients             ``4·Ψ_r`` (fp32, as the parameters).
optimizer state       AdamW / Adam: ``8·Ψ_r`` (``exp_avg``, ``exp_avg_sq``); SGD with momentum:
                      ``4·Ψ_r``. These three rows are ZeRO's model-state count (Rajbhandari et al.
                      2020, arXiv:1910.02054, §3.1: ``2Ψ + 2Ψ + 12Ψ`` for mixed-precision Adam;
                      here fp32 weights, so ``4Ψ + 4Ψ + 8Ψ``), with FSDP2 = ZeRO-3 sharding.
FSDP unsharded        while a stage computes, FSDP2 holds the all-gathered parameters of the blocks
                      in use: under PP the whole stage (the pipeline keeps them gathered, and
                      ``reshard_after_forward`` only re-gathers per microbatch), otherwise the
                      root group plus two blocks (the current and the prefetched one) with
                      ``reshard_after_forward`` and every block without it; and, with more than
                      one microbatch, the stage's unsharded gradients, accumulated without
                      reduce-scatter until the last microbatch's backward. Under
                      ``training.mixed_precision = "bf16"`` the gathered parameters are bf16
                      (2 bytes) and the gradients are accumulated and reduced in fp32; without
                      FSDP, ``torch.autocast`` caches a bf16 copy of every weight (2 bytes)
                      for the forward; each block's backward frees its own.
activations           per microbatch of ``T = (global batch / dp / microbatches) × seq_len``
                      tokens, the tensors autograd saves for backward (below), times the
                      microbatches the pipeline schedule keeps in flight on the stage
                      (``ray_titan.parallel.schedules``).
pipeline buffers      receive buffers a pipeline stage allocates once per microbatch: the
                      activations it receives (non-first stages) and the gradients it receives
                      (non-last stages), ``4·T·d`` each.
transient             the largest short-lived allocation of the step: the loss's gradient over
                      the vocabulary on the last stage, a block's backward, the block that
                      activation checkpointing recomputes, the optimizer's gradient temporaries.
                      Zero-bubble schedules (split backwards): what each input-gradient step
                      keeps until its weight-gradient step, and the recomputations a weight step
                      of checkpointed blocks keeps, at the moment found by walking the rank's
                      actions in torch's order (``plan_ranks._zero_bubble_peak``,
                      ``plan_activations._zero_bubble_terms``).
peak                  ``max`` of the forward/backward phase (everything above) and the optimizer
                      phase (parameters, gradients, optimizer state).
====================  ===========================================================================

**Activations per layer.** Each family's formula (bytes per token a block saves for backward,
counted the way of Korthikanti et al. 2022, arXiv:2205.05198, §4.1) is its ``ModelSpec``'s
``block_activations``, in ``ray_titan/models/<family>/costs.py`` (``ray_titan.models.costs``);
``e`` is the activation element size (4 in fp32, 2 under ``training.mixed_precision = "bf16"``).
The plan applies, for every family:

- Activation checkpointing (``[activation_checkpoint]``): ``full`` keeps each block's input
  (``4·d``) and recomputes one block at a time in backward (a transient of one block's
  activations); ``selective``/``op`` keeps the block input and the outputs of attention and of
  every second matrix multiplication (torchtitan's policy: ``ray_titan.parallel.ac``,
  :func:`ray_titan.models.costs.op_sac_saved`) and recomputes the rest; ``selective``/``layer``
  checkpoints every ``layer_freq``-th block fully.
- The last stage keeps the logits ``e·V`` of every microbatch in flight (pipelining holds a
  stage's output until its backward) and the loss's log-softmax ``4·V``; other stages keep their
  output ``4·d``. With ``training.loss_chunk_tokens = c`` it keeps neither (its output is the
  final-normed hidden state ``e·d``), and the loss's backward holds one chunk's log-softmax and
  gradients, ``3·4·V·c``, and a chunk's head-weight gradient ``e·V·d``, instead of ``2·4·V`` per
  token of the microbatch (``plan_activations._loss_backward``).

**Microbatches in flight.** Each pipeline schedule's rule (the microbatches whose forward ran and
whose backward has not, at a rank's peak, per local stage) is its ``in_flight`` in
:data:`ray_titan.parallel.schedules.SCHEDULES`, beside its other properties.

**Checked against measurement.** On CPU (fp32) the plan's peak is compared with the torch
profiler's peak of all tensors during step 2 (the run's memory breakdown,
``memory.breakdown_step``) for the debug Llama and DeepSeek over pp, dp_shard, ep, schedules and
AC modes: ``tests/integration/test_memory_plan.py`` (a handful) and ``python -m benchmarks.memory_plan`` (the
full table), within 15 %. On GPUs the caching allocator adds its own reserve and fragmentation
on top (``device_reserved`` − ``device_allocated``); bf16 figures are estimates.

**Levers.** When a rank does not fit ``device_memory``, the plan re-plans the job with each lever
and ranks them by cost: more microbatches (smaller ones; no extra compute), selective then full
activation checkpointing (recomputation), activation offloading (host copies: before the
recomputation where they hide behind the forward, after it where they do not),
``reshard_after_forward`` (more all-gathers), CPU offload (host traffic, optimizer on the CPU),
then more devices: a larger ``dp_shard``, tensor parallel where the mesh has it, more pipeline
stages. The recommendation is the cheapest prefix of those levers, applied together, that fits.
``lever_groups`` restricts both to some groups of levers: ``memory.fit = "auto"`` asks for the
cheapest fitting set of microbatches, activation offloading and activation checkpointing alone
(:data:`FIT_GROUPS`), which keep the devices and the model states on them, and applies it
(:func:`ray_titan.preflight.prepare.fit_memory`).

**Where each part is.** This module is the entry (:func:`memory_plan`, :func:`write_memory_plan`;
the names below are importable from it too). The job as the plan reads it (mesh, model on meta,
element sizes): :mod:`~ray_titan.preflight.plan_job`; the rows parameters to FSDP unsharded:
:mod:`~ray_titan.preflight.plan_states`; activations, pipeline buffers and transient:
:mod:`~ray_titan.preflight.plan_activations`; every rank's peak and the microbatches in flight:
:mod:`~ray_titan.preflight.plan_ranks`; the levers: :mod:`~ray_titan.preflight.plan_levers`; the
result types (:class:`MemoryPlan`, :class:`RankPlan`, :class:`Lever`) and the byte sizes
(:func:`parse_bytes`, :func:`format_bytes`): :mod:`~ray_titan.preflight.plan_types`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ray_titan import storage
from ray_titan.config.schema import ConfigError, JobConfig
from ray_titan.config.units import format_bytes, parse_bytes
from ray_titan.metrics.reading.memory_plan import PLAN_FILE, planned_rank
from ray_titan.preflight.plan_levers import FIT_GROUPS, LEVER_GROUPS, _add_levers
from ray_titan.preflight.plan_ranks import LISTED_RANKS, _plan_ranks
from ray_titan.preflight.plan_types import (
    Lever,
    MemoryPlan,
    RankPlan,
    _groups,
    _rank_list,
)

__all__ = [
    "FIT_GROUPS",
    "LEVER_GROUPS",
    "LISTED_RANKS",
    "PLAN_FILE",
    "Lever",
    "MemoryPlan",
    "RankPlan",
    "format_bytes",
    "memory_plan",
    "parse_bytes",
    "planned_rank",
    "write_memory_plan",
]



def _detect_device_memory() -> tuple[int | None, str]:
    import torch

    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        return total, f"detected: {torch.cuda.get_device_name(0)}"
    return None, "no CUDA device here; pass --device-memory, e.g. 80GiB"


def memory_plan(
    cfg: JobConfig, device_memory: int | str | None = None, device: str | None = None,
    routing_imbalance: float = 1.0, vocab_size: int | None = None, levers: bool = True,
    margin: float | None = None, lever_groups: tuple[str, ...] | None = None,
) -> MemoryPlan:
    """Plan every rank's memory for ``cfg`` without starting anything (module docstring).

    ``device_memory``: bytes (or ``"80GiB"``) each rank's device has; default: the detected CUDA
    device's, else unknown (no fit verdict). ``device``: ``"cuda"`` (any accelerator) or ``"cpu"``;
    default ``cuda`` when ``ray.use_gpu`` or a device capacity is given, else ``cpu``. It decides
    the attention kernel (PyTorch's CPU kernel saves ``s × s`` probabilities where query and value
    head dimensions differ) and whether CPU offload frees device memory. ``routing_imbalance``:
    MoE only, max over mean of the tokens an expert-parallel rank's experts receive (>= 1).
    ``vocab_size``: default the tokenizer's, as the trainer builds the model (the flavor's where the
    tokenizer file is not here). ``levers``: also rank the levers when the job does not fit.
    ``lever_groups``: only the levers of these groups
    (:data:`~ray_titan.preflight.plan_levers.LEVER_GROUPS`), so ``recommendation`` is the cheapest
    fitting set among them; default all. ``margin``: share of the capacity kept free for what the
    plan does not count (the CUDA context, NCCL buffers, the caching allocator's fragmentation);
    default 0.08 on ``cuda`` (PyTorch's own context and NCCL take ~1-3 GiB of an 80 GiB device,
    fragmentation a few % more), 0 on ``cpu``.

    Raises :class:`ConfigError` for a job that is not valid (mesh, batch, schedule) or a bad
    argument (a lever group not in ``LEVER_GROUPS`` among them).
    """
    from ray_titan.checkpoint import resolve_hf_job
    from ray_titan.preflight.checks import validate_job

    cfg = resolve_hf_job(cfg)  # a Hugging Face job's family and sizes are its config.json's
    if not 1 <= routing_imbalance < math.inf:  # NaN too
        raise ConfigError(f"routing imbalance = {routing_imbalance}: a finite number >= 1 (max over mean "
                          "load of an expert-parallel rank; 1 is balanced)")
    if vocab_size is not None and not 1 <= vocab_size <= 2**31 - 1:  # token ids are int32 at most
        raise ConfigError(f"vocab size = {vocab_size}: a positive number of tokens (at most 2^31 - 1), or leave "
                          "it unset for the tokenizer's")
    if lever_groups is not None and not set(lever_groups) <= set(LEVER_GROUPS):
        raise ConfigError(f"lever groups = {list(lever_groups)}: some of {list(LEVER_GROUPS)}")
    try:
        capacity = parse_bytes(device_memory) if device_memory is not None else None
    except ValueError as e:
        raise ConfigError(f"device memory: {e}") from None
    validate_job(cfg, check_data=False)
    source = "given"
    if capacity is None:
        capacity, source = _detect_device_memory()
    device = device or ("cuda" if cfg.ray.use_gpu or capacity is not None else "cpu")
    if device not in ("cuda", "cpu"):
        raise ConfigError(f"device = {device!r}: 'cuda' (any accelerator) or 'cpu'")
    job, ranks = _plan_ranks(cfg, device, routing_imbalance, vocab_size)
    if margin is None:
        margin = 0.08 if device == "cuda" else 0.0
    if not 0 <= margin < 1:
        raise ConfigError(f"margin = {margin}: a share of the device memory in [0, 1)")
    plan = MemoryPlan(job=job, ranks=ranks, device_memory=capacity, device_memory_source=source, margin=margin)
    if job["dtype"] != "fp32" and (job["model"] != "llama" or not job["dtype"].startswith("bf16 (FSDP2")):
        # Checked against what autograd saves: fp32 blocks of every family, and bf16 Llama blocks
        # with bf16 weights (tests/integration/test_memory_plan.py).
        plan.notes.append("bf16 activations are estimated (the formulas are checked against fp32 runs, "
                          "and bf16 Llama blocks under FSDP2 mixed precision)")
    if levers and plan.fits is False:
        _add_levers(plan, cfg, device, routing_imbalance, job["vocab_size"], lever_groups)
    return plan


def write_memory_plan(plan: MemoryPlan, run_dir: Path | str) -> dict[str, Any]:
    """Write a run's ``plan`` to ``<run_dir>/memory_plan.json`` (``run_dir`` a local path or a URI)
    and print each rank group's predicted peak; returns the plan as a dict. The plan is made before
    anything starts (:func:`ray_titan.preflight.prepare.prepare_job`)."""
    from ray_titan.run_dir import under

    data = plan.to_dict()
    storage.write_text(under(run_dir, PLAN_FILE), json.dumps(data, indent=1))
    peaks = ", ".join(f"ranks {_rank_list(ranks)} {format_bytes(r.peak)}" for ranks, r in _groups(plan.ranks))
    print(f"ray_titan: memory plan: predicted peak {peaks} ({under(run_dir, PLAN_FILE)})", flush=True)
    return data
