"""The memory plan against the simulated GPU over the composition matrix:
``python -m benchmarks.run dry_run_matrix [--quick] [--json PATH]`` (or ``python -m
benchmarks.dry_run_matrix [--quick] [--filter S] [--json PATH]``).

For the debug Llama (untied) and the debug Qwen3 (tied embeddings, per-head q/k norms) it runs
``ray-titan dry-run`` (:func:`ray_titan.dry_run.dry_run`: each rank built and trained for two
steps on fake CUDA tensors) over a covering design of the composition matrix, not its cross
product: every value of every axis (pp × dp_replicate × dp_shard × tp with sequence parallel,
every pipeline schedule of ``ray_titan.parallel.schedules.SCHEDULES``, activation checkpointing
none / selective op / selective layer / full, ``memory.cpu_offload``, tied embeddings, bf16 and
fp32) appears at least once beside realistic companions. Per case it simulates the first rank
and the last (first and last pipeline stage, last shard and tp rank) and compares the live
device storages at the simulated peak, by the plan's categories (parameters, gradients,
optimizer state, activations, temporaries), with the memory plan of that rank
(``RankPlan.categories``).

Error of a category: (planned − simulated) / the simulated peak, so every row of the plan is
judged against the rank's measured peak; the case PASSes when every category's and the
total's error is within 10 %. Sequences are short (the fake tensors cost nothing per element,
but the plan's terms must all be visible), two steps (the plan is of a steady step: AdamW's
state exists from the first optimizer step on). ``--quick``: four cases, first rank only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray_titan.config.units import MiB

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "configs" / "debug_llama.toml")
THRESHOLD = 0.10
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")


@dataclass(frozen=True)
class Case:
    """One composition: a short ``name``, the overrides on ``config`` (default
    ``configs/debug_llama.toml``) and the simulated ``steps``."""

    name: str
    overrides: tuple[str, ...]
    config: str = CONFIG
    steps: int = 2


def _case(name: str, *, model: str = "llama", flavor: str = "debug", pp: int = 1, dp_rep: int = 1, dp: int = 1,
          tp: int = 1, ep: int = 1, cp: int = 1, sched: str = "1F1B", v: int = 1, n: int = 1, ac: str = "none",
          offload: bool = False, bf16: bool = False, seq: int = 256, mb: int = 2, steps: int = 2,
          extra: tuple[str, ...] = ()) -> Case:
    """A :class:`Case`: model and flavor, mesh sizes, schedule, ``v`` stages per rank, ``n``
    microbatches of ``mb`` sequences of ``seq`` tokens, AC mode (``none``, ``op``, ``layer``,
    ``full``), ``steps`` simulated. The debug MoE flavors run on their own configs
    (``configs/debug_<model>.toml``: load balancing as their users run it)."""
    ac_over = {"none": ["--activation_checkpoint.mode=none"], "full": ["--activation_checkpoint.mode=full"],
               "op": ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_option=op"],
               "layer": ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_option=layer",
                         "--activation_checkpoint.layer_freq=2"]}[ac]
    over = [f"--model.name={model}", f"--model.flavor={flavor}", f"--parallelism.pp={pp}",
            f"--parallelism.dp_replicate={dp_rep}", f"--parallelism.dp_shard={dp}", f"--parallelism.tp={tp}",
            f"--parallelism.ep={ep}", f"--parallelism.cp={cp}",
            f"--parallelism.pipeline_schedule={sched}", f"--parallelism.stages_per_rank={v}",
            f"--parallelism.microbatches={n}", f"--training.seq_len={seq}",
            f"--training.global_batch_size={mb * n * dp * dp_rep}",
            f"--training.mixed_precision={'bf16' if bf16 else 'fp32'}", f"--memory.cpu_offload={str(offload).lower()}",
            *ac_over, *extra]
    moe_config = REPO / "configs" / f"debug_{'deepseek' if model == 'deepseek_v2' else model}.toml"
    config = str(moe_config) if flavor == "debug" and model != "llama" and moe_config.exists() else CONFIG
    return Case(name, tuple(over), config, steps)


# The covering design: every value of every axis at least once, with realistic companions.
CASES: list[Case] = [
    _case("fsdp2 fp32", dp=2),
    _case("fsdp2 bf16 full-AC", dp=2, bf16=True, ac="full"),
    _case("fsdp4 tp2 bf16 sel-op", dp=4, tp=2, bf16=True, ac="op"),
    _case("hsdp 2x2 fp32 sel-layer n2", dp_rep=2, dp=2, n=2, ac="layer"),
    _case("fsdp2 bf16 cpu-offload", dp=2, bf16=True, offload=True),
    _case("tp2 fp32 (no FSDP)", tp=2),
    _case("1 rank bf16 (autocast)", bf16=True),
    _case("pp2 dp2 GPipe fp32", pp=2, dp=2, sched="GPipe", n=2),
    _case("pp2 dp2 1F1B bf16", pp=2, dp=2, n=4, bf16=True),
    _case("pp2 dp2 tp2 1F1B bf16 sel-op", pp=2, dp=2, tp=2, n=2, bf16=True, ac="op"),
    _case("pp2 v2 dp2 Interleaved1F1B fp32 full-AC", pp=2, dp=2, sched="Interleaved1F1B", v=2, n=2, ac="full"),
    _case("pp2 v2 dp2 InterleavedZeroBubble bf16", pp=2, dp=2, sched="InterleavedZeroBubble", v=2, n=2,
          bf16=True),
    _case("pp2 dp2 ZBVZeroBubble fp32 sel-layer", pp=2, dp=2, sched="ZBVZeroBubble", v=2, n=4, ac="layer"),
    _case("pp2 dp2 DualPipeV bf16", pp=2, dp=2, sched="DualPipeV", v=2, n=4, bf16=True),
    _case("pp2 hsdp 2x2 1F1B bf16", pp=2, dp_rep=2, dp=2, n=2, bf16=True),
    _case("pp4 1F1B fp32 (no FSDP)", pp=4, n=4),
    _case("pp2 dp2 tp2 replicated loss bf16", pp=2, dp=2, tp=2, n=2, bf16=True,
          extra=("--parallelism.loss_parallel=false",)),
    _case("pp2 dp2 1F1B bf16 cpu-offload full-AC", pp=2, dp=2, n=2, bf16=True, offload=True, ac="full"),
    _case("qwen3 tied fsdp2 fp32", model="qwen3", dp=2),
    _case("qwen3 tied fsdp2 tp2 bf16 sel-op", model="qwen3", dp=2, tp=2, bf16=True, ac="op"),
    _case("qwen3 tied pp2 dp2 1F1B bf16", model="qwen3", pp=2, dp=2, n=2, bf16=True),
    _case("qwen3 tied pp2 dp2 GPipe fp32 full-AC", model="qwen3", pp=2, dp=2, sched="GPipe", n=2, ac="full"),
    # memory.activation_offload: saved activations in host memory, back one block ahead of backward.
    _case("fsdp2 bf16 act-offload", dp=2, bf16=True, extra=("--memory.activation_offload=all",)),
    _case("fsdp2 tp2 bf16 act-offload", dp=2, tp=2, bf16=True, extra=("--memory.activation_offload=all",)),
    _case("pp2 dp2 1F1B bf16 full-AC act-offload", pp=2, dp=2, n=4, bf16=True, ac="full",
          extra=("--memory.activation_offload=all",)),
    _case("qwen3 tied fsdp2 tp2 bf16 sel-op act-offload 2", model="qwen3", dp=2, tp=2, bf16=True, ac="op",
          extra=("--memory.activation_offload=2",)),
    # Context parallel: the sequence split over cp ranks (activations ÷ cp, the gathered keys and
    # values kept by each attention), parameters sharded over dp_shard × cp.
    _case("cp2 fsdp2 bf16", cp=2, dp=2, bf16=True, seq=512),
    _case("cp4 tp2 bf16 sel-op", cp=4, tp=2, bf16=True, ac="op", seq=1024),
    _case("cp8 fp32 document mask", cp=8, seq=1024, extra=("--training.document_mask=true",)),
    _case("cp2 pp2 1F1B bf16 full-AC", cp=2, pp=2, n=2, bf16=True, ac="full", seq=512),
    _case("deepseek cp2 fsdp2 bf16", model="deepseek_v2", cp=2, dp=2, bf16=True, seq=512),
    # Expert parallel under cp: tokens exchanged within a cp rank, experts sharded over dp_shard / ep × cp.
    _case("deepseek_v3 cp2 dp2 ep2 bf16", model="deepseek_v3", cp=2, dp=2, ep=2, bf16=True, seq=512),
    # MoE under tensor parallel: the routed experts' tokens gathered from the sequence-parallel
    # shards. An MoE block's recomputed and backward tensors are mostly whole on every tp rank
    # (BlockActivations.transient_unsplit; before 2026-11-28 the plan divided them by tp: op SAC
    # temporaries 5.85 MiB planned, 9.19 simulated, full AC 6.68 and 9.50).
    _case("deepseek tp2 dp2 ep2 bf16", model="deepseek_v2", tp=2, dp=2, ep=2, bf16=True, seq=512),
    _case("deepseek_v3 tp2 dp2 ep2 bf16 sel-op", model="deepseek_v3", tp=2, dp=2, ep=2, bf16=True, ac="op", seq=512),
    _case("deepseek_v3 tp2 dp2 ep2 bf16 full-AC", model="deepseek_v3", tp=2, dp=2, ep=2, bf16=True, ac="full",
          seq=512),
    _case("deepseek cp2 tp2 ep2 bf16", model="deepseek_v2", cp=2, tp=2, dp=2, ep=2, bf16=True, seq=512),
]
# One realistic mesh per flavor of every family, bf16, 1F1B, no activation checkpointing, one
# sequence per microbatch: the meshes of the MoE flavors' and the 70B / 8B rows before it
# (benchmarks/results/2026-11-26-moe-families-plan.md, 2026-11-26-simulated-gpu-vs-plan.md). The
# debug dense flavors are the composition matrix's (CASES).
_MOE_DEBUG = dict(pp=2, dp=2, ep=2, n=4, seq=128, bf16=True)
FLAVOR_CASES: list[Case] = [
    *[_case(f"{m} debug pp2 dp2 ep2", model=m, **_MOE_DEBUG)  # type: ignore[arg-type]
      for m in ("deepseek_v2", "deepseek_v3", "qwen3_moe", "gpt_oss", "glm4_moe", "minimax_m2")],
    # Qwen3.5: Gated DeltaNet's chunked activations (tensor parallel is refused).
    _case("qwen3_5 debug pp2 dp2 bf16", model="qwen3_5", pp=2, dp=2, n=2, seq=256, bf16=True),
    _case("qwen3_5 27B pp4 dp8 seq1024", model="qwen3_5", flavor="27B", pp=4, dp=8, n=4, mb=1, seq=1024,
          bf16=True),
    _case("qwen3_5_moe debug pp2 dp2 ep2", model="qwen3_5_moe", **_MOE_DEBUG),  # type: ignore[arg-type]
    # Multi-token prediction's depth: a full-attention block with the family's feed-forward.
    _case("qwen3_5 debug pp2 dp2 bf16 mtp1", model="qwen3_5", pp=2, dp=2, n=2, seq=256, bf16=True,
          extra=("--model.mtp_layers=1",)),
    _case("qwen3_5_moe debug pp2 dp2 ep2 mtp1", model="qwen3_5_moe", **_MOE_DEBUG,  # type: ignore[arg-type]
          extra=("--model.mtp_layers=1",)),
    _case("qwen3_5_moe 397B-A17B pp8 dp16 ep16 seq1024", model="qwen3_5_moe", flavor="397B-A17B", pp=8, dp=16,
          ep=16, n=8, mb=1, seq=1024, bf16=True),
    _case("qwen3 0.6B fsdp8 seq4096", model="qwen3", flavor="0.6B", dp=8, seq=4096, mb=1, bf16=True),
    _case("qwen3 1.7B fsdp8 seq4096", model="qwen3", flavor="1.7B", dp=8, seq=4096, mb=1, bf16=True),
    _case("llama 3.2-1B pp2 dp4 tp2 seq2048", model="llama", flavor="3.2-1B", pp=2, dp=4, tp=2, n=4, mb=1,
          seq=2048, bf16=True),
    _case("llama 3.2-3B pp2 dp4 tp2 seq2048", model="llama", flavor="3.2-3B", pp=2, dp=4, tp=2, n=4, mb=1,
          seq=2048, bf16=True),
    _case("qwen3 4B pp2 dp4 tp2 seq4096", model="qwen3", flavor="4B", pp=2, dp=4, tp=2, n=4, mb=1, seq=4096,
          bf16=True),
    _case("qwen3 8B pp2 dp4 tp2 seq4096", model="qwen3", flavor="8B", pp=2, dp=4, tp=2, n=4, mb=1, seq=4096,
          bf16=True),
    _case("llama 3.1-8B pp2 dp2 tp2 seq2048", model="llama", flavor="3.1-8B", pp=2, dp=2, tp=2, n=4, mb=2,
          seq=2048, bf16=True, extra=("--parallelism.loss_parallel=false",)),
    # The chunked loss (training.loss_chunk_tokens) on the 8B row of issue 41 (torchtitan's peak
    # 82.4 GiB there): the head's logits and their gradient a chunk of 2048 tokens at a time.
    _case("llama 3.1-8B fsdp8 seq8192 sel-op chunked loss", model="llama", flavor="3.1-8B", dp=8, mb=2, seq=8192,
          bf16=True, ac="op", extra=("--training.loss_chunk_tokens=2048",)),
    # Issue 42: one 131,072-token sequence per data-parallel rank over dp_shard × cp = 8 (cp=2 at
    # 65,536 tokens: torch's CausalBias reserves 32 GiB of host memory at 131,072, more than a
    # 24 GiB host; benchmarks/results/2026-11-28-rope-tables-and-cp-plan.md).
    _case("llama 3.1-8B cp8 seq131072 full-AC", model="llama", flavor="3.1-8B", cp=8, mb=1, seq=131072,
          bf16=True, ac="full"),
    _case("llama 3.1-8B cp8 seq131072 sel-op", model="llama", flavor="3.1-8B", cp=8, mb=1, seq=131072,
          bf16=True, ac="op"),
    _case("llama 3.1-8B cp4 dp2 seq131072 full-AC", model="llama", flavor="3.1-8B", cp=4, dp=2, mb=1,
          seq=131072, bf16=True, ac="full"),
    _case("llama 3.1-8B cp2 dp4 seq65536 full-AC", model="llama", flavor="3.1-8B", cp=2, dp=4, mb=1,
          seq=65536, bf16=True, ac="full"),
    _case("gpt_oss 20B pp2 dp4 ep4 seq2048", model="gpt_oss", flavor="20B", pp=2, dp=4, ep=4, n=2, mb=1,
          seq=2048, bf16=True),
    _case("deepseek_v2 V2-Lite pp2 dp8 ep8 seq4096", model="deepseek_v2", flavor="V2-Lite", pp=2, dp=8, ep=8,
          n=2, mb=1, seq=4096, bf16=True),
    _case("deepseek_v3 16B pp2 dp8 ep8 seq4096", model="deepseek_v3", flavor="16B", pp=2, dp=8, ep=8, n=2,
          mb=1, seq=4096, bf16=True),
    # Multi-token prediction: the last stage's MTP block, its copy of the embedding, and a second
    # set of (4096 × 102,400) logits with their fp32 log-softmax.
    _case("deepseek_v3 16B pp2 dp8 ep8 seq4096 mtp1", model="deepseek_v3", flavor="16B", pp=2, dp=8, ep=8, n=2,
          mb=1, seq=4096, bf16=True, extra=("--model.mtp_layers=1",)),
    _case("deepseek_v3 debug pp2 dp2 ep2 mtp1", model="deepseek_v3", **_MOE_DEBUG,  # type: ignore[arg-type]
          extra=("--model.mtp_layers=1", "--training.document_mask=true")),
    # GLM-4.5's depth: its own block (GQA, partial rotary, q/k norms; an MoE feed-forward).
    _case("glm4_moe debug pp2 dp2 ep2 mtp1", model="glm4_moe", **_MOE_DEBUG,  # type: ignore[arg-type]
          extra=("--model.mtp_layers=1", "--training.document_mask=true")),
    # ... under tensor parallel with sequence and loss parallel: the depth's norms and projection
    # on the sequence shards, its logits vocabulary-sharded, the embedding copy split on the vocabulary.
    _case("deepseek_v3 debug pp2 dp2 tp2 ep2 mtp1", model="deepseek_v3", tp=2, **_MOE_DEBUG,  # type: ignore[arg-type]
          extra=("--model.mtp_layers=1", "--training.document_mask=true")),
    _case("deepseek_v3 16B pp2 dp4 tp2 ep4 seq4096 mtp1", model="deepseek_v3", flavor="16B", pp=2, dp=4, tp=2, ep=4,
          n=2, mb=1, seq=4096, bf16=True, extra=("--model.mtp_layers=1",)),
    _case("qwen3_moe 30B-A3B pp4 dp8 ep8 seq4096", model="qwen3_moe", flavor="30B-A3B", pp=4, dp=8, ep=8, n=8,
          mb=1, seq=4096, bf16=True),
    _case("glm4_moe 106B-A12B pp4 dp8 ep8 seq4096", model="glm4_moe", flavor="106B-A12B", pp=4, dp=8, ep=8, n=8,
          mb=1, seq=4096, bf16=True),
    _case("minimax_m2 230B-A10B pp8 dp16 ep16 seq4096", model="minimax_m2", flavor="230B-A10B", pp=8, dp=16,
          ep=16, n=8, mb=1, seq=4096, bf16=True),
    _case("gpt_oss 120B pp4 dp8 ep8 seq2048", model="gpt_oss", flavor="120B", pp=4, dp=8, ep=8, n=4, mb=1,
          seq=2048, bf16=True),
    # The byte tokenizer's 258 tokens do not split over tp=8 (pre-flight refuses loss parallel).
    _case("llama 3.1-70B pp8 dp64 tp8 seq8192", model="llama", flavor="3.1-70B", pp=8, dp=64, tp=8, n=8, mb=1,
          seq=8192, bf16=True, extra=("--parallelism.loss_parallel=false",)),
    _case("qwen3_moe 235B-A22B pp8 dp16 ep16 seq4096", model="qwen3_moe", flavor="235B-A22B", pp=8, dp=16,
          ep=16, n=8, mb=1, seq=4096, bf16=True),
    _case("glm4_moe 355B-A32B pp8 dp16 ep16 seq4096", model="glm4_moe", flavor="355B-A32B", pp=8, dp=16,
          ep=16, n=8, mb=1, seq=4096, bf16=True),
    _case("deepseek_v2 V2 pp8 dp16 ep16 seq4096", model="deepseek_v2", flavor="V2", pp=8, dp=16, ep=16, n=8,
          mb=1, seq=4096, bf16=True),
    _case("deepseek_v3 671B pp16 dp64 ep64 seq4096", model="deepseek_v3", flavor="671B", pp=16, dp=64, ep=64,
          n=16, mb=1, seq=4096, bf16=True),
    _case("deepseek_v3 kimi_k2 pp16 dp64 ep64 seq4096", model="deepseek_v3", flavor="kimi_k2", pp=16, dp=64,
          ep=64, n=16, mb=1, seq=4096, bf16=True),
]
# Flavors that are another flavor's shape (same LlamaArgs but RoPE scaling, which allocates
# nothing per step) share its row.
FLAVOR_ALIASES = {("llama", "3-8B"): ("llama", "3.1-8B"), ("llama", "8B"): ("llama", "3.1-8B")}


def flavors_uncovered() -> list[tuple[str, str]]:
    """The ``(family, flavor)`` pairs of the model registry that neither :data:`FLAVOR_CASES` nor
    (for the debug dense flavors) :data:`CASES` measures; empty when every flavor has a row."""
    from ray_titan.models.registry import MODELS

    def key(case: Case) -> tuple[str, str]:
        opts = dict(o.removeprefix("--").split("=", 1) for o in case.overrides)
        return opts["model.name"], opts["model.flavor"]

    covered = {key(c) for c in [*CASES, *FLAVOR_CASES]}
    return [(m, f) for m, spec in MODELS.items() for f in spec.flavors
            if FLAVOR_ALIASES.get((m, f), (m, f)) not in covered]


QUICK = ["fsdp2 fp32", "pp2 dp2 1F1B bf16", "pp2 dp2 tp2 1F1B bf16 sel-op", "qwen3 tied fsdp2 tp2 bf16 sel-op"]


def _ranks(case: Case, quick: bool) -> list[int]:
    """The first rank and the last of ``case``'s mesh (the first only with ``quick``)."""
    from ray_titan.config import load_config

    world = load_config(case.config, list(case.overrides)).world_size
    return [0] if quick or world == 1 else [0, world - 1]


def run_case(case: Case, ranks: list[int] | None = None, steps: int | None = None) -> list[dict[str, Any]]:
    """Dry-run ``case``'s ``ranks`` (default: the first and the last) for ``steps`` steps (default
    the case's); one
    dict per rank: ``case``, ``rank``, ``stages``, ``simulated`` and ``planned`` bytes by category
    (and ``peak``), ``error`` by category and ``total`` ((planned − simulated) / simulated peak),
    ``worst`` (the category with the largest |error|), ``passed`` (every |error| ≤ 10 %),
    ``top_ops`` (the largest makers of each simulated category), ``seconds``. Raises
    ``DryRunError`` where the simulation fails."""
    from ray_titan.dry_run import dry_run

    results = dry_run(case.config, list(case.overrides), ranks if ranks is not None else _ranks(case, False),
                      steps=case.steps if steps is None else steps)
    rows = []
    for r in results:
        sim = {c: r.peak_by_category.get(c, 0) for c in CATEGORIES}
        plan = {c: r.plan_by_category.get(c, 0) for c in CATEGORIES}
        peak = max(1, sum(sim.values()))
        error = {c: (plan[c] - sim[c]) / peak for c in CATEGORIES}
        error["total"] = ((r.plan_peak_bytes or 0) - r.peak_device_bytes) / max(1, r.peak_device_bytes)
        worst = max(error, key=lambda c: abs(error[c]))
        rows.append({"case": case.name, "rank": r.rank, "stages": r.stages,
                     "simulated": sim | {"peak": r.peak_device_bytes},
                     "planned": plan | {"peak": r.plan_peak_bytes}, "error": error, "worst": worst,
                     "passed": abs(error[worst]) <= THRESHOLD, "top_ops": r.peak_top_ops,
                     "seconds": r.seconds, "overrides": list(case.overrides)})
    return rows


def run(quick: bool = False, name_filter: str = "", workers: int = 2, flavors: bool = False) -> list[dict[str, Any]]:
    """Every case of :data:`CASES` (``flavors``: of :data:`FLAVOR_CASES`; ``quick``: :data:`QUICK`
    or the debug flavors, first rank; ``name_filter``: those whose name contains it), ``workers``
    cases at a time; rows as :func:`run_case`'s, a failed simulation as a row with ``error`` a
    message and ``passed`` False."""
    quick_names = [c.name for c in FLAVOR_CASES if " debug " in c.name] if flavors else QUICK  # the debug MoE ones
    cases = [c for c in (FLAVOR_CASES if flavors else CASES)
             if (not quick or c.name in quick_names) and name_filter in c.name]

    def one(case: Case) -> list[dict[str, Any]]:
        try:
            return run_case(case, _ranks(case, quick))
        except Exception as e:  # one broken composition must not lose the others' rows
            return [{"case": case.name, "rank": None, "error": f"{type(e).__name__}: {str(e)[:400]}",
                     "passed": False, "overrides": list(case.overrides)}]

    with ThreadPoolExecutor(max_workers=workers) as pool:  # each rank is its own child process
        return [row for rows in pool.map(one, cases) for row in rows]


def format_rows(rows: list[dict[str, Any]]) -> str:
    """One line per case and rank: simulated / planned MiB by category, the worst error, PASS/FAIL."""
    short = {"parameters": "params", "gradients": "grads", "optimizer_state": "optim", "activations": "acts",
             "temporaries": "temps"}
    head = (f"{'case':<42} {'rank':>4}  " + " ".join(f"{short[c]:>13}" for c in CATEGORIES)
            + f" {'peak':>13}  {'worst':>16}  verdict")
    lines = [head, "(MiB simulated/planned; error = (planned - simulated) / simulated peak)"]
    for r in rows:
        if r.get("rank") is None:
            lines.append(f"{r['case']:<42} {'-':>4}  FAIL: {r['error']}")
            continue
        cells = " ".join(f"{r['simulated'][c] / MiB:>6.2f}/{r['planned'][c] / MiB:<6.2f}"
                         for c in [*CATEGORIES, "peak"])
        worst = f"{r['worst']} {r['error'][r['worst']]:+.1%}"
        lines.append(f"{r['case']:<42} {r['rank']:>4}  {cells}  {worst:>16}  {'PASS' if r['passed'] else 'FAIL'}")
    passed = sum(1 for r in rows if r["passed"])
    lines.append(f"{passed} of {len(rows)} rows within {THRESHOLD:.0%}")
    return "\n".join(lines)


def rows_for_runner(quick: bool, flavors: bool = False) -> list[Any]:
    """The runner's rows (``benchmarks.run``'s table): one per case and rank (``flavors``: of
    :data:`FLAVOR_CASES`, ``quick`` then keeping the debug and the ≤ 8B ones)."""
    from benchmarks.stats import Row

    rows = run(quick, flavors=flavors)
    print(format_rows(rows), file=sys.stderr, flush=True)
    out = []
    for r in rows:
        if r.get("rank") is None:
            out.append(Row(f"dry_run_matrix {r['case']}", "failed", r["error"], data=r))
            continue
        sim, plan = r["simulated"], r["planned"]
        out.append(Row(f"dry_run_matrix {r['case']} rank {r['rank']}", "peak simulated / planned",
                       f"{sim['peak'] / MiB:.2f} / {(plan['peak'] or 0) / MiB:.2f} MiB",
                       target=f"every category within {THRESHOLD:.0%} of the simulated peak",
                       note=f"worst {r['worst']} {r['error'][r['worst']]:+.1%}: {'PASS' if r['passed'] else 'FAIL'}",
                       data=r))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.dry_run_matrix", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="four cases, first rank only")
    ap.add_argument("--flavors", action="store_true",
                    help="one realistic mesh per flavor of every family (FLAVOR_CASES) instead of the matrix")
    ap.add_argument("--filter", default="", help="only the cases whose name contains this")
    ap.add_argument("--workers", type=int, default=2, help="cases simulated at a time (default 2)")
    ap.add_argument("--json", type=Path, default=None, help="where to write the rows")
    args = ap.parse_args(argv)
    t0 = time.time()
    if args.flavors and (missing := flavors_uncovered()):
        print(f"flavors without a row: {missing}", file=sys.stderr)
    rows = run(args.quick, args.filter, args.workers, args.flavors)
    print(format_rows(rows))
    print(f"{time.time() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
