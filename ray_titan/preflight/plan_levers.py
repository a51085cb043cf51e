"""The levers of the memory plan ("Levers" in :mod:`ray_titan.preflight.memory_plan`): the changes
to a job that lower its peak, each re-planned alone and ranked by what it costs, and the cheapest
set of them that fits."""

from __future__ import annotations

import itertools

from ray_titan.config.schema import ConfigError, JobConfig, apply_overrides
from ray_titan.config.units import format_bytes
from ray_titan.preflight.plan_ranks import _plan_ranks
from ray_titan.preflight.plan_types import Lever, MemoryPlan

# (key, group, cost): levers in cost order, cheapest first. One lever per group at a time.
_LEVERS = [
    ("microbatches", "microbatches",
     "smaller microbatches: no extra compute or devices; smaller matmuls run less efficiently"),
    ("activation_offload", "act_offload", "saved activations to pinned host memory and back, hidden behind compute"),
    ("selective_op", "ac",
     "recomputes every 2nd matmul of a block and the cheap ops (norms, rotary embeddings, activation "
     "functions) in backward (torchtitan's op policy; ~+13% step time measured on CPU)"),
    ("selective_layer", "ac", "recomputes every 2nd block's forward in backward (~+17% compute)"),
    ("full_ac", "ac", "recomputes every block's forward in backward (~+33% compute)"),
    ("activation_offload_exposed", "act_offload", "saved activations to pinned host memory and back, slower than "
                                                  "the compute they overlap"),
    ("reshard", "reshard", "all-gathers each block again in backward (more communication)"),
    ("cpu_offload", "offload", "parameters, gradients and optimizer state in host memory: host-device copies "
                               "every step, optimizer on the CPU (much slower steps)"),
    ("dp_shard", "dp_shard", "2× the devices (FSDP shards model states over twice as many ranks)"),
    ("tp", "tp", "2× the devices (tensor parallel splits matrices and, with sequence parallel, activations)"),
    ("pp", "pp", "2× the devices (twice the pipeline stages) and a longer pipeline bubble"),
    ("cp", "cp", "2× the devices (context parallel splits every sequence: activations ÷ 2; each attention "
                 "all-gathers the keys and values, whose gradients are reduce-scattered back)"),
]


def _lever_candidates(cfg: JobConfig, device: str) -> list[tuple[str, str, list[str]]]:
    """(key, name, overrides) of every lever that applies to ``cfg``, in cost order."""
    par, ac = cfg.parallelism, cfg.activation_checkpoint
    out = []
    local = cfg.training.global_batch_size // (par.dp_shard * par.microbatches)
    if par.pipeline_schedule != "GPipe" and local % 2 == 0:
        out.append(("microbatches", f"microbatches {par.microbatches} → {2 * par.microbatches}",
                    [f"--parallelism.microbatches={2 * par.microbatches}"]))
    if ac.mode == "none":
        out.append(("selective_op", "activation checkpointing selective/op",
                    ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_option=op"]))
        out.append(("selective_layer", "activation checkpointing selective/layer (every 2nd)",
                    ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_option=layer",
                     "--activation_checkpoint.layer_freq=2"]))
    if ac.mode != "full":
        out.append(("full_ac", "activation checkpointing full", ["--activation_checkpoint.mode=full"]))
    if device == "cuda" and cfg.memory.activation_offload != "all":
        # Ranked by whether its copies hide behind compute (:func:`_offload_cost`), decided once
        # the variant is planned: the key here is the hidden one's.
        out.append(("activation_offload", "activation offload (all blocks)", ["--memory.activation_offload=all"]))
    if par.dp_shard > 1 and par.pp == 1 and par.fsdp_reshard_after_forward == "never":
        out.append(("reshard", "fsdp_reshard_after_forward always",
                    ["--parallelism.fsdp_reshard_after_forward=always"]))
    if par.dp_shard > 1 and not cfg.memory.cpu_offload and device != "cpu":
        out.append(("cpu_offload", "CPU offload", ["--memory.cpu_offload=true"]))
    gbs = cfg.training.global_batch_size
    # More devices keep each rank's batch where the global batch cannot be split further.
    dp_more = [f"--parallelism.dp_shard={2 * par.dp_shard}"]
    dp_name = f"dp_shard {par.dp_shard} → {2 * par.dp_shard}"
    if gbs % (2 * par.dp_shard * par.microbatches):
        dp_more.append(f"--training.global_batch_size={2 * gbs}")
        dp_name += f" (global batch {gbs} → {2 * gbs})"
    out.append(("dp_shard", dp_name, dp_more))
    if hasattr(par, "tp"):  # tensor parallel, where the mesh has it
        tp = par.tp
        out.append(("tp", f"tp {tp} → {2 * tp}", [f"--parallelism.tp={2 * tp}"]))
    pp_more = [f"--parallelism.pp={2 * par.pp}"]
    pp_name = f"pp {par.pp} → {2 * par.pp}"
    if par.pp == 1:
        pp_more.append("--parallelism.pipeline_schedule=1F1B")
    n = max(par.microbatches, 2 * par.pp)  # 1F1B and the interleaved schedules need n >= pp
    if n != par.microbatches:
        pp_more.append(f"--parallelism.microbatches={n}")
        pp_name += f", microbatches {par.microbatches} → {n}"
    g = gbs
    while g % (par.dp_shard * n):
        g *= 2
    if g != gbs:
        pp_more.append(f"--training.global_batch_size={g}")
        pp_name += f" (global batch {gbs} → {g})"
    out.append(("pp", pp_name, pp_more))
    if cfg.training.seq_len % (4 * par.cp) == 0:  # the balancer's 2·cp chunks, at twice the cp
        out.append(("cp", f"cp {par.cp} → {2 * par.cp}", [f"--parallelism.cp={2 * par.cp}"]))
    return out


def _variant(cfg: JobConfig, overrides: list[str]) -> JobConfig | None:
    """``cfg`` with ``overrides``, or None when the result is not a valid job (the checks the
    driver runs before workers start, without the data ones)."""
    from ray_titan.preflight.checks import validate_job

    data = cfg.model_dump()
    data["ray"]["num_workers"] = None  # a lever may change the worker count
    try:
        new = JobConfig.from_dict(apply_overrides(data, overrides))
        validate_job(new, check_data=False)
    except (ConfigError, ValueError):
        return None
    return new


LEVER_GROUPS = tuple(dict.fromkeys(group for _, group, _ in _LEVERS))
"""The groups of levers, cheapest first: ``microbatches``, ``act_offload`` (activation offloading),
``ac`` (activation checkpointing), ``reshard``, ``offload``, ``dp_shard``, ``tp``, ``pp``, ``cp``."""

FIT_GROUPS = ("microbatches", "act_offload", "ac")
"""The groups ``memory.fit = "auto"`` may apply: they keep the job's devices and its model states on
them. Activation offloading is ranked as for the plan's list (:func:`_offload_cost`): right after
more microbatches where its copies hide behind the forward's compute, after full AC where they do
not. An H200 (2026-11-28, the Llama 3.2 1B shape at 4 × 2,048 tokens, bf16, one rank;
``benchmarks/results/2026-11-28-gpu-levers-h200.md``) bore out both sides of that test: offloading
every block without AC, which the plan calls not hidden with up to ~475 ms more per step, took
490 ms more (0.616 s against 0.126 s); under full AC, where the plan calls the block inputs' copies
hidden, it cost nothing measurable (0.795 × no AC's tokens/s against full AC's 0.797). Its copies
run on one side stream, so they took at least 0.548 s (34.5 GB at PCIe 5.0 x16's 63 GB/s): at least
46 % of the step's 0.126 s of compute ran under them (docs/memory.md)."""

HOST_LINK_BYTES_PER_S = 50e9
"""Host-device copy bandwidth per direction the activation-offload lever assumes, bytes/s: an H100
SXM's PCIe Gen5 x16 link, 64 GB/s per direction by the PCIe 5.0 specification, of which pinned
``cudaMemcpyAsync`` copies reach ~50 GB/s (NVIDIA's ``nvbandwidth`` figures for Gen5 hosts). An
H200 offloading every block of the 1B shape moved 17.26 GB each way in a 0.616 s step: 56 GB/s
if all of the step's compute hid under the copies, and the step this figure predicts (0.601 s) is
2.5 % short of it (:data:`FIT_GROUPS`)."""

ASSUMED_MFU = 0.4
"""Model FLOPs utilisation the lever assumes to turn a step's FLOPs into seconds of compute on an
H100's dense bf16 peak (``ray_titan.metrics.flops.GPU_PEAK_FLOPS``): a well-tuned job's share."""


def _offload_cost(variant: JobConfig, device: str, rho: float, vocab: int, host_bytes: int) -> tuple[bool, str]:
    """Whether activation offloading's copies hide behind compute, and its cost in words: each
    offloaded byte crosses the host link once each way per step (to the host during forward,
    back during backward, :data:`HOST_LINK_BYTES_PER_S`), against the forward's compute, a third
    of the step's FLOPs (``6·N`` per token: 2 forward, 4 backward; PaLM's count,
    ``ray_titan.models.costs``) at :data:`ASSUMED_MFU` of an H100. ``host_bytes``: one step's
    offloaded bytes of the busiest rank."""
    from ray_titan.metrics.flops import GPU_PEAK_FLOPS
    from ray_titan.preflight.plan_job import _job

    j = _job(variant, device, rho, vocab)
    par = variant.parallelism
    step_tokens = j.tokens * par.microbatches
    flops = j.spec.flops_per_token(j.args, variant.training.seq_len) * step_tokens / (j.dims.pp * j.tp)
    forward_s = flops / 3 / (GPU_PEAK_FLOPS["H100"] * ASSUMED_MFU)
    copy_s = host_bytes / HOST_LINK_BYTES_PER_S
    hidden = copy_s <= forward_s  # to the host during forward; back during backward (twice the compute)
    exposed = max(0.0, copy_s - forward_s) + max(0.0, copy_s - 2 * forward_s)
    text = (f"copies {format_bytes(host_bytes)} of saved activations per step to pinned host memory and back "
            f"(~{copy_s * 1e3:.3g} ms each way at {HOST_LINK_BYTES_PER_S / 1e9:g} GB/s, an H100's PCIe Gen5 "
            f"link) beside ~{forward_s * 1e3:.3g} ms of forward compute ({ASSUMED_MFU:.0%} MFU of an H100): ")
    text += ("hidden behind compute, no extra compute; host memory up by as much" if hidden else
             f"not hidden: up to ~{exposed * 1e3:.3g} ms more per step; host memory up by as much")
    return hidden, text


def _add_levers(plan: MemoryPlan, cfg: JobConfig, device: str, rho: float, vocab: int,
                groups: tuple[str, ...] | None = None) -> None:
    """Each lever alone (those that lower the peak) into ``plan.levers``, and the cheapest set of
    levers that fits into ``plan.recommendation``: the one whose dearest lever is cheapest, then
    with the fewest and cheapest levers (one activation checkpointing mode at a time).
    ``groups``: only the levers of these groups (:data:`LEVER_GROUPS`); None: all."""
    usable = plan.usable
    assert usable is not None
    order = {key: (i, group, cost) for i, (key, group, cost) in enumerate(_LEVERS)}
    for key, name, overrides in _lever_candidates(cfg, device):
        if groups is not None and order[key][1] not in groups:
            continue
        variant = _variant(cfg, overrides)
        if variant is None:
            continue
        ranks = _plan_ranks(variant, device, rho, vocab)[1]
        peak = max(r.peak for r in ranks)
        if peak >= plan.max_peak:
            continue  # does not lower the peak (e.g. more microbatches under GPipe)
        rank, _, cost = order[key]
        if key == "activation_offload":
            hidden, cost = _offload_cost(variant, device, rho, vocab,
                                         max(r.offload_bytes_per_step for r in ranks))
            rank = rank if hidden else order["activation_offload_exposed"][0]
        plan.levers.append(Lever(name, overrides, peak, peak <= usable, cost, rank))
    plan.levers.sort(key=lambda lv: lv.rank)  # activation offload's place depends on its variant
    best: tuple | None = None
    for n in range(1, len(plan.levers) + 1):
        for combo in itertools.combinations(plan.levers, n):
            combo_groups = [_LEVERS[lv.rank][1] for lv in combo]
            if len(set(combo_groups)) < len(combo_groups):
                continue
            cost_key = (max(lv.rank for lv in combo), n, sum(lv.rank for lv in combo))
            if best is not None and cost_key >= best[0]:
                continue
            overrides = [o for lv in sorted(combo, key=lambda lv: lv.rank) for o in lv.overrides]
            variant = _variant(cfg, overrides)
            if variant is None:
                continue
            if max(r.peak for r in _plan_ranks(variant, device, rho, vocab)[1]) <= usable:
                best = (cost_key, overrides)
    if best is not None:
        plan.recommendation = best[1]
