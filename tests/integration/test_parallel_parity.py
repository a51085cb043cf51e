"""Tensor, sequence and loss parallel, HSDP, and the pipeline schedules (GPipe and Interleaved1F1B
with FSDP, the zero-bubble and V-shaped ones; 1F1B is the main job's, on Ray, in
tests/integration/test_main_job.py), each equal to one worker (fp32, gloo, no Ray): the step losses the
collector assembles and the gradient norms, over 10 steps, within 1e-4 relative of one shared
one-process run per model; a checkpoint resharded across tp and dp_replicate resumes the same curve,
and one with multi-token prediction resumes it on another pipeline layout.

Each composition runs its ranks as processes of the session's forkserver (``tests/support/ranks.py``),
which imported torch and ray_titan once (the train loop, its reporter and the collector are those
``python -m ray_titan.launch`` runs under torchrun; only the per-process start-up is shared), at
most 4 at a time.
"""

from __future__ import annotations

import faulthandler
import json
import os
import traceback
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest
import torch
import torch.distributed as dist

from ray_titan.config import load_config, merge_overrides
from ray_titan.config.schema import ConfigError
from ray_titan.metrics.collector.collector import MetricsCollector
from ray_titan.metrics.reading.steps import read_steps
from ray_titan.metrics.worker.report import JsonlReporter, rank_reports_path, read_rank_reports
from ray_titan.parallel.dims import ParallelDims
from ray_titan.parallel.pipeline import SCHEDULES, stage_placement
from ray_titan.preflight.checks import validate_job
from ray_titan.trainer.build import parallel_dims
from tests.conftest import REPO
from tests.support.ranks import forkserver, join_all, rendezvous_store

STEPS = 10
RTOL = 1e-4
# Small steps (4 sequences of 32 tokens): parity is about the arithmetic, not the model's size.
# One microbatch where the schedule allows it: each forward costs the same DTensor dispatch
# whatever its size, and accumulation does not change the mean gradient.
COMMON = ["--training.global_batch_size=4", "--training.seq_len=32", "--parallelism.microbatches=1",
          "--training.threads_per_worker=1", "--metrics.enable_tensorboard=false", "--metrics.log_freq=1000",
          "--checkpoint.enable=false", "--parallelism.pp=1", "--parallelism.dp_shard=1", "--memory.breakdown_step=0"]
CHUNKED = "--training.loss_chunk_tokens=24"
V_SHAPED = ["--parallelism.pp=2", "--parallelism.stages_per_rank=2", "--parallelism.microbatches=4"]

DENSE = {
    # A memory snapshot too: the profiler's step peak per rank works under DTensor.
    "tp2": (2, ["--parallelism.tp=2", "--memory.snapshot_steps=[2]"]),
    "tp2_pp2_1F1B": (4, ["--parallelism.tp=2", "--parallelism.pp=2", "--parallelism.microbatches=2"]),
    "tp2_dp_shard2": (4, ["--parallelism.tp=2", "--parallelism.dp_shard=2"]),
    "dp_replicate2_dp_shard2": (4, ["--parallelism.dp_replicate=2", "--parallelism.dp_shard=2"]),
    "pp2_dp_shard2_GPipe": (4, ["--parallelism.pp=2", "--parallelism.dp_shard=2", "--parallelism.microbatches=2",
                                "--parallelism.pipeline_schedule=GPipe"]),
    "pp2_dp_shard2_Interleaved1F1B": (4, ["--parallelism.pp=2", "--parallelism.dp_shard=2",
                                          "--parallelism.stages_per_rank=2", "--parallelism.microbatches=2",
                                          "--parallelism.pipeline_schedule=Interleaved1F1B"]),
    "pp2_ZBVZeroBubble": (2, [*V_SHAPED, "--parallelism.pipeline_schedule=ZBVZeroBubble"]),
    "pp2_DualPipeV": (2, [*V_SHAPED, "--parallelism.pipeline_schedule=DualPipeV"]),
    "pp2_InterleavedZeroBubble": (2, ["--parallelism.pp=2", "--parallelism.stages_per_rank=2",
                                      "--parallelism.microbatches=2",
                                      "--parallelism.pipeline_schedule=InterleavedZeroBubble"]),
    # The chunked loss (training.loss_chunk_tokens; 24 tokens: uneven chunks of a microbatch):
    # under FSDP with tp's loss parallel (Shard(-1) logits per chunk), on a pipeline's last stage
    # with tp, and through a zero-bubble schedule's split backward.
    "chunked_loss_tp2_dp_shard2": (4, ["--parallelism.tp=2", "--parallelism.dp_shard=2", CHUNKED]),
    "chunked_loss_pp2_tp2_1F1B": (4, ["--parallelism.tp=2", "--parallelism.pp=2", "--parallelism.microbatches=2",
                                      CHUNKED]),
    "chunked_loss_pp2_InterleavedZeroBubble": (2, ["--parallelism.pp=2", "--parallelism.stages_per_rank=2",
                                                   "--parallelism.microbatches=2",
                                                   "--parallelism.pipeline_schedule=InterleavedZeroBubble", CHUNKED]),
}
MOE = {
    "tp2_dp_shard2_ep2": (4, ["--parallelism.tp=2", "--parallelism.dp_shard=2", "--parallelism.ep=2"]),
    # Sequence and loss parallel off here (on everywhere else): replicated norms and MoE input,
    # all-gathered logits.
    "pp2_tp2": (4, ["--parallelism.pp=2", "--parallelism.tp=2", "--parallelism.microbatches=2",
                    "--parallelism.sequence_parallel=false", "--parallelism.loss_parallel=false"]),
}
# DeepSeek-V3's twin: sigmoid group routing whose aux-loss-free bias moves every step from the
# load all-reduced over dp_shard, which one worker counts alone.
MOE_V3 = {"pp2_dp_shard2_ep2": (4, ["--parallelism.pp=2", "--parallelism.dp_shard=2", "--parallelism.ep=2",
                                    "--parallelism.microbatches=2"])}
# DeepSeek-V3 with one multi-token-prediction depth over packed documents: the depth's MoE block
# on the last stage with its copy of the embedding (gradients summed with stage 0's), its experts
# over ep, its labels cut at documents; its loss must match too (the mtp_losses column).
MTP_FLAGS = ["--model.mtp_layers=1", "--training.document_mask=true"]
QWEN35_MOE_FLAGS = ["--model.name=qwen3_5_moe", "--model.mtp_layers=1"]
# Under tp with sequence and loss parallel: the depth's norms and projection on the sequence
# shards, its logits vocabulary-sharded; with pp (sequence and loss parallel off: the depth on the
# replicated stream, its logits all-gathered), the last stage's embedding copy split on the vocabulary.
MTP = {"pp2_dp_shard2_ep2": (4, [*MOE_V3["pp2_dp_shard2_ep2"][1], *MTP_FLAGS]),
       "tp2": (2, ["--parallelism.tp=2", *MTP_FLAGS]),
       "tp2_pp2_replicated": (4, ["--parallelism.tp=2", "--parallelism.pp=2", "--parallelism.microbatches=2",
                                  "--parallelism.sequence_parallel=false", "--parallelism.loss_parallel=false",
                                  *MTP_FLAGS]),
       # GLM-4.5's depth: its own block (GQA with q/k/v biases, partial rotary, q/k norms) around the same machinery.
       "glm4_moe_pp2_dp_shard2_ep2": (4, [*MOE_V3["pp2_dp_shard2_ep2"][1], *MTP_FLAGS]),
       "glm4_moe_tp2": (2, ["--parallelism.tp=2", *MTP_FLAGS]),
       # Qwen3.5-MoE's depth (a full-attention MoE block with zero-centred norms, fed the normed
       # output) with its experts over ep (the reference: the dp ranks' batches as microbatches, for
       # the pooled balance loss, as QWEN35's). The dense twin's depth is the same code without the
       # experts (tests/unit/test_mtp.py); under pp the depths' machinery is DeepSeek's and GLM's.
       "qwen3_5_moe_dp_shard2_ep2": (2, [*QWEN35_MOE_FLAGS, "--parallelism.dp_shard=2", "--parallelism.ep=2"])}
# The model of each MTP case (the others: deepseek_v3_mtp).
MTP_MODEL = {"glm4_moe_pp2_dp_shard2_ep2": "glm4_moe_mtp", "glm4_moe_tp2": "glm4_moe_mtp",
             "qwen3_5_moe_dp_shard2_ep2": "qwen3_5_moe_mtp"}
# Qwen3-MoE under tensor parallel (per-head q/k norms on each rank's heads, experts split by
# hidden units) with experts over ep; gpt-oss (sinks, sliding windows, expert biases sharded
# over ep; tp refused) with experts over ep. Both families' balance loss (transformers') pools the
# router statistics of one forward's batch, so it is not linear in the batch: the one worker runs
# the dp ranks' batches as as many microbatches (a one-worker run of one microbatch differs by
# 1e-3 relative by step 10 on gpt-oss, 1e-7 with load_balance = "none"). No pp: a stage can
# only approximate the loss pooled over all MoE layers (ray_titan.models.qwen3_moe.model).
MOE_2026 = {"qwen3_moe": (4, ["--parallelism.tp=2", "--parallelism.dp_shard=2", "--parallelism.ep=2"]),
            "gpt_oss": (2, ["--parallelism.dp_shard=2", "--parallelism.ep=2"]),
            # GLM-4.5 under tp with sequence parallel (q/k/v biases and partial rotary on each
            # rank's heads, the shared expert split by hidden units) with experts over ep; its
            # aux-loss-free bias moves from the load all-reduced over dp_shard, as DeepSeek-V3's.
            "glm4_moe": (4, ["--parallelism.tp=2", "--parallelism.dp_shard=2", "--parallelism.ep=2"]),
            # MiniMax-M2 (q/k norms over all heads, every layer MoE; tp refused) with experts over ep.
            "minimax_m2": (2, ["--parallelism.dp_shard=2", "--parallelism.ep=2"])}
# Qwen3.5 (Gated DeltaNet; tp refused): FSDP with pipeline stages splitting DeltaNet from full
# attention layers; its MoE twin with experts over ep (the reference runs the dp ranks' batches
# as microbatches: the pooled balance loss, as Qwen3-MoE's).
QWEN35 = {"qwen3_5": (4, ["--model.name=qwen3_5", "--parallelism.pp=2", "--parallelism.dp_shard=2",
                          "--parallelism.microbatches=2"]),
          "qwen3_5_moe": (2, ["--model.name=qwen3_5_moe", "--parallelism.dp_shard=2", "--parallelism.ep=2"])}
# A tied head under tp: the vocab-parallel embedding's gradient and the head's, summed on one weight.
TIED = {"qwen3": (2, ["--model.name=qwen3", "--parallelism.tp=2"]),
        "qwen3_chunked_loss": (2, ["--model.name=qwen3", "--parallelism.tp=2", CHUNKED])}
REFERENCE_FLAGS = {"qwen3": ["--model.name=qwen3"], "qwen3_moe": ["--parallelism.microbatches=2"],
                   "deepseek_v3_mtp": [*MTP_FLAGS, "--checkpoint.interval=10"],  # saved at 10, for MTP_RESUMES
                   "glm4_moe_mtp": MTP_FLAGS, "qwen3_5_moe_mtp": [*QWEN35_MOE_FLAGS, "--parallelism.microbatches=2"],
                   "gpt_oss": ["--parallelism.microbatches=2"], "qwen3_5": ["--model.name=qwen3_5"],
                   "qwen3_5_moe": ["--model.name=qwen3_5_moe", "--parallelism.microbatches=2"]}
CONFIGS = {"llama": "debug_llama.toml", "qwen3": "debug_llama.toml",
           "deepseek_v2": "debug_deepseek.toml", "deepseek_v3": "debug_deepseek_v3.toml",
           "deepseek_v3_mtp": "debug_deepseek_v3.toml", "glm4_moe_mtp": "debug_glm4_moe.toml",
           "qwen3_5_moe_mtp": "debug_llama.toml",
           "qwen3_moe": "debug_qwen3_moe.toml", "gpt_oss": "debug_gpt_oss.toml", "glm4_moe": "debug_glm4_moe.toml",
           "minimax_m2": "debug_minimax_m2.toml", "qwen3_5": "debug_llama.toml", "qwen3_5_moe": "debug_llama.toml"}


def _rank_main(rank: int, nproc: int, config: str, overrides: list[str], run_dir: str,
               save: bool, env: dict[str, str] | None = None) -> None:
    """One rank of a composition: what ``ray_titan.launch`` does under torchrun, minus the CLI."""
    from ray_titan.checkpoint import LocalCheckpointStorage
    from ray_titan.trainer import train_loop

    os.environ.update(env or {})  # the forkserver's environment is that of its first use
    # A native crash (no Python exception) leaves the rank's Python stacks here instead.
    crash = open(Path(run_dir) / f"crash-rank{rank}.txt", "w")  # stays open until the process exits
    faulthandler.enable(crash, all_threads=True)
    try:
        if nproc > 1:
            dist.init_process_group("gloo", rank=rank, world_size=nproc)  # env:// on rendezvous_store's
        cfg = load_config(REPO / "configs" / config, overrides)
        storage = LocalCheckpointStorage(Path(run_dir) / "checkpoints", 0) if save else None
        train_loop(cfg, JsonlReporter(rank_reports_path(run_dir, rank)), torch.device("cpu"), run_dir,
                   checkpoint_storage=storage)
        if nproc > 1:
            dist.destroy_process_group()
    except BaseException:
        (Path(run_dir) / f"error-rank{rank}.txt").write_text(traceback.format_exc())
        raise


def _failure(run_dir: Path, exitcodes: list[int | None]) -> str:
    """Why a composition failed: every rank's exit code, then the first rank's error that is not
    a peer's lost connection (a rank that crashed takes its peers' sockets down with it), or the
    Python stacks of a rank that died natively."""
    errors = {int(f.stem.rsplit("rank", 1)[1]): f.read_text() for f in run_dir.glob("error-rank*.txt")}
    crashes = {int(f.stem.rsplit("rank", 1)[1]): f.read_text() for f in run_dir.glob("crash-rank*.txt")}
    root = [e for _, e in sorted(errors.items()) if "by peer" not in e] or [
        f"rank {r} died natively:\n{c}" for r, c in sorted(crashes.items()) if c.strip()] or list(errors.values())
    return f"exit codes {exitcodes}\n" + (root[0][-3000:] if root else "")


def _run(tmp: Path, model: str, nproc: int, overrides: list[str], steps: int = STEPS, save: bool = False,
         env: dict[str, str] | None = None):
    """Run one composition on ``nproc`` processes (``env`` added to each one's environment) and
    assemble its reports as the launcher does; returns ``(collector summary, steps table, ParallelDims)``."""
    ctx = forkserver()
    flags = merge_overrides(["--parallelism.ep=1"] if model != "llama" else [], COMMON, [
        f"--training.steps={steps}", f"--data.cache_dir={tmp.parent / 'corpus'}",
        f"--checkpoint.enable={str(save).lower()}"], overrides)
    run_dir = tmp / "run"
    run_dir.mkdir(parents=True)
    with rendezvous_store() as store_env:
        procs = [ctx.Process(target=_rank_main, args=(r, nproc, CONFIGS[model], flags, str(run_dir), save,
                                                      {**store_env, **(env or {})}))
                 for r in range(nproc)]
        for p in procs:
            p.start()
        join_all(procs, 300)
    assert all(p.exitcode == 0 for p in procs), _failure(run_dir, [p.exitcode for p in procs])
    cfg = load_config(REPO / "configs" / CONFIGS[model], flags)
    dims = parallel_dims(cfg)
    collector = MetricsCollector(str(run_dir), nproc, dims.last_stage_ranks(), steps, enable_tensorboard=False)
    for r in range(nproc):
        collector.report(read_rank_reports(run_dir, r))
    summary = collector.finish()
    steps_table = read_steps(run_dir)
    return summary, steps_table, dims


def _curve(steps_table, column="step_loss"):
    rank0 = steps_table.filter(pc.equal(steps_table["rank"], 0)).sort_by("step")
    return np.array(rank0[column].to_pylist())


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, corpus_cache):
    # The corpus materialised once for the session, where _run's cache_dir points.
    root = tmp_path_factory.mktemp("parity")
    (root / "corpus").symlink_to(corpus_cache)
    return root


@pytest.fixture(scope="module")
def references(corpus):
    """One worker per model, run on first use; two extra steps for the resumed run to continue."""
    cache = {}

    def get(model: str):
        if model not in cache:
            cache[model] = _run(corpus / f"ref_{model}", model, 1, REFERENCE_FLAGS.get(model, []), steps=STEPS + 2,
                                save=model == "deepseek_v3_mtp")
        return cache[model]

    return get


def _check_parity(name, run, ref, grad_rtol=RTOL):
    summary, table, dims = run
    assert summary["errors"] == [], summary["errors"]
    np.testing.assert_allclose(_curve(table), _curve(ref[1])[:STEPS], rtol=RTOL, err_msg=f"{name}: step loss")
    np.testing.assert_allclose(_curve(table, "grad_norm"), _curve(ref[1], "grad_norm")[:STEPS], rtol=grad_rtol,
                               err_msg=f"{name}: gradient norm")
    # Every DP rank's batch counted once: tp ranks hold the same tokens and loss.
    assert set(table["step_tokens"].to_pylist()) == {4 * 32}
    # The loss came from the ranks the stage mapping names, on the pp rank it names.
    last = table.filter(table["is_last_stage"])
    assert set(last["rank"].to_pylist()) == set(dims.last_stage_ranks())
    assert set(last["pp"].to_pylist()) == {dims.stage_to_pp_rank(dims.num_stages - 1)}
    assert last.num_rows == STEPS * len(dims.last_stage_ranks()) and None not in last["loss"].to_pylist()


@pytest.fixture(scope="module")
def dense_runs(corpus):
    out = {}

    def get(name):
        if name not in out:  # tp2_dp_shard2 also saves a checkpoint, for the reshard test
            out[name] = _run(corpus / name, "llama", *DENSE[name], save=name == "tp2_dp_shard2")
        return out[name]

    return get


# CI's compatibility job (.ci/compat) reruns one of each multi-stage schedule family and pp × ep.
COMPAT = {"pp2_dp_shard2_Interleaved1F1B", "pp2_ZBVZeroBubble", "pp2_dp_shard2_ep2"}


def _cases(names):
    return [pytest.param(n, marks=pytest.mark.compat) if n in COMPAT else n for n in names]


@pytest.mark.parametrize("name", _cases(DENSE))
def test_dense_composition_matches_one_worker(name, corpus, dense_runs, references):
    run = dense_runs(name)
    _check_parity(name, run, references("llama"))
    if "tp" in name:
        assert {"tp"} <= set(run[1].column_names) and set(run[1]["tp"].to_pylist()) == {0, 1}
    if name == "tp2":  # each rank's snapshot summary holds its own step peak
        summaries = [json.loads(f.read_text()) for f in sorted((corpus / name).glob("run/memory/rank*-summary.json"))]
        assert [s["coords"] for s in summaries] == [{"pp": 0, "dp_shard": 0, "tp": t} for t in (0, 1)]
        assert all(s["peak_bytes"] > s["peak_above_step_start_bytes"] > 100_000 for s in summaries)
    if name.startswith("pp2_") and stage_placement(name.rsplit("_", 1)[-1]) == "v":
        assert run[2].last_stage_ranks() == [0]  # V shape: the last stage is back on pp rank 0


@pytest.mark.parametrize("name", list(MOE))
def test_moe_composition_matches_one_worker(name, corpus, references):
    _check_parity(name, _run(corpus / f"moe_{name}", "deepseek_v2", *MOE[name]), references("deepseek_v2"))


@pytest.mark.parametrize("name", _cases(MOE_V3))
def test_deepseek_v3_composition_matches_one_worker(name, corpus, references):
    _check_parity(name, _run(corpus / f"v3_{name}", "deepseek_v3", *MOE_V3[name]), references("deepseek_v3"))


@pytest.fixture(scope="module")
def mtp_runs(corpus):
    out = {}

    def get(name):
        if name not in out:  # pp2_dp_shard2_ep2 also saves a checkpoint, for MTP_RESUMES
            out[name] = _run(corpus / f"mtp_{name}", MTP_MODEL.get(name, "deepseek_v3_mtp"), *MTP[name],
                             save=name == "pp2_dp_shard2_ep2")
        return out[name]

    return get


def _depth_curve(table):
    """The MTP depth 1 loss per step: the mean of the last stage's data-parallel ranks'."""
    last = table.filter(table["is_last_stage"]).to_pylist()
    by_step: dict[int, list[float]] = {}
    for row in last:
        by_step.setdefault(row["step"], []).append(row["mtp_losses"][0])
    return np.array([np.mean(by_step[s]) for s in sorted(by_step)])


@pytest.mark.parametrize("name", list(MTP))
def test_mtp_composition_matches_one_worker(name, corpus, mtp_runs, references):
    """The step loss (the main loss alone), the gradient norm and the MTP depth's loss (the mean
    of the last stage's data-parallel ranks, each over its equal share of tokens) against one
    worker's."""
    model = MTP_MODEL.get(name, "deepseek_v3_mtp")
    run, ref = mtp_runs(name), references(model)
    _check_parity(name, run, ref)
    got, want = _depth_curve(run[1]), _depth_curve(ref[1])[:STEPS]
    assert want[0] > 1.0 and not np.allclose(want, _curve(ref[1])[:STEPS])  # a loss of its own
    np.testing.assert_allclose(got, want, rtol=RTOL, err_msg=f"{name}: MTP depth 1 loss")


# A checkpoint with multi-token prediction resumed on another pipeline layout: the MTP block and
# the last stage's copy of the embedding (mtp_embeddings) move between ranks, and a layout whose
# last stage holds no embedding needs that copy (weights and optimizer state) from a checkpoint
# that has only the embedding. Saved by: "pp2" the MTP case pp2_dp_shard2_ep2 (1F1B, 2 stages),
# "pp1" the one worker; resumed by (ranks, flags).
MTP_RESUMES = {
    "pp2_to_pp1": ("pp2", 1, []),
    "pp1_to_pp2_1F1B": ("pp1", 2, ["--parallelism.pp=2", "--parallelism.microbatches=2"]),
    # 4 stages in a V: rank 0 holds the first and the last, with the embedding and its copy.
    "pp2_to_pp2_ZBVZeroBubble": ("pp2", 2, [*V_SHAPED, "--parallelism.pipeline_schedule=ZBVZeroBubble"]),
    "pp1_to_pp2_ZBVZeroBubble": ("pp1", 2, [*V_SHAPED, "--parallelism.pipeline_schedule=ZBVZeroBubble"]),
}


@pytest.mark.parametrize("name", list(MTP_RESUMES))
def test_mtp_checkpoint_resumes_on_another_pipeline_layout(name, corpus, mtp_runs, references):
    """Steps 11 and 12 resumed from step 10's checkpoint continue the one worker's curves: the
    step loss and the MTP depth's loss."""
    ref = references("deepseek_v3_mtp")
    saved, nproc, flags = MTP_RESUMES[name]
    if saved == "pp2":
        assert mtp_runs("pp2_dp_shard2_ep2")[0]["errors"] == []
        ckpt = corpus / "mtp_pp2_dp_shard2_ep2" / "run" / "checkpoints" / "step-00000010"
    else:
        ckpt = corpus / "ref_deepseek_v3_mtp" / "run" / "checkpoints" / "step-00000010"
    assert ckpt.is_dir()
    summary, table, _ = _run(corpus / f"mtp_resume_{name}", "deepseek_v3_mtp", nproc,
                             [*MTP_FLAGS, *flags, f"--checkpoint.load_path={ckpt}"], steps=STEPS + 2)
    assert summary["errors"] == []
    assert sorted(set(table["step"].to_pylist())) == [STEPS + 1, STEPS + 2]
    np.testing.assert_allclose(_curve(table), _curve(ref[1])[STEPS:], rtol=RTOL, err_msg=f"{name}: step loss")
    np.testing.assert_allclose(_depth_curve(table), _depth_curve(ref[1])[STEPS:], rtol=RTOL,
                               err_msg=f"{name}: MTP depth 1 loss")


@pytest.mark.parametrize("model", list(MOE_2026))
def test_2026_moe_composition_matches_one_worker(model, corpus, references):
    _check_parity(model, _run(corpus / f"{model}_mesh", model, *MOE_2026[model]), references(model))


@pytest.mark.parametrize("model", list(QWEN35))
def test_qwen3_5_composition_matches_one_worker(model, corpus, references):
    _check_parity(model, _run(corpus / f"{model}_mesh", model, *QWEN35[model]), references(model))


@pytest.mark.parametrize("model", list(TIED))
def test_tied_head_under_tp_matches_one_worker(model, corpus, references):
    """The first step's gradient norm to 1e-5 (a head or embedding gradient counted wrong would
    be off by far more); later steps to 3e-4: fp32 sums in another order through the tied
    weight's two gradients drift to 1.3e-4 by step 9 (the same figures before the vocab-parallel
    embedding, bit for bit)."""
    family = model.removesuffix("_chunked_loss")
    run, ref = _run(corpus / f"{model}_tied", family, *TIED[model]), references(family)
    np.testing.assert_allclose(_curve(run[1], "grad_norm")[0], _curve(ref[1], "grad_norm")[0], rtol=1e-5)
    _check_parity(model, run, ref, grad_rtol=3e-4)


def test_checkpoint_reshards_across_tp_and_dp_replicate(corpus, dense_runs, references):
    """tp=2 × dp_shard=2 saves at step 10; dp_replicate=2 × dp_shard=2 (no TP) resumes it and
    continues the one-worker curve."""
    saved = dense_runs("tp2_dp_shard2")
    ckpt = corpus / "tp2_dp_shard2" / "run" / "checkpoints"
    assert saved[0]["errors"] == [] and (ckpt / "step-00000010").is_dir()
    summary, table, _ = _run(corpus / "resharded", "llama", 4, [
        "--parallelism.dp_replicate=2", "--parallelism.dp_shard=2", f"--checkpoint.load_path={ckpt}"],
        steps=STEPS + 2)
    assert summary["errors"] == []
    assert sorted(set(table["step"].to_pylist())) == [STEPS + 1, STEPS + 2]
    np.testing.assert_allclose(_curve(table), _curve(references("llama")[1])[STEPS:], rtol=RTOL)


# -- without processes --------------------------------------------------------------------------

def test_coordinates_and_dp_rank_on_the_full_mesh():
    dims = ParallelDims(pp=2, dp_replicate=2, dp_shard=2, tp=2, ep=2)
    assert dims.world_size == 16
    # Row-major (pp, dp_replicate, dp_shard, tp): tp innermost, then dp_shard, dp_replicate, pp.
    assert dims.coords(13) == {"pp": 1, "dp_replicate": 1, "dp_shard": 0, "tp": 1, "ep": 0}
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert dims.last_stage_ranks() == list(range(8, 16))
    assert dims.describe() == "pp=2 × dp_replicate=2 × dp_shard=2 × tp=2, ep=2"
    # Without the new axes: the (pp, dp_shard) layout and messages of before.
    assert ParallelDims(pp=2, dp_shard=2).coords(3) == {"pp": 1, "dp_shard": 1}
    assert ParallelDims(pp=2, dp_shard=2).describe() == "pp=2 × dp_shard=2"


def test_allocation_peak_is_what_the_profiled_code_added():
    from torch.profiler import ProfilerActivity, profile

    from ray_titan.metrics.worker.memory import live_storages
    from ray_titan.metrics.worker.profiling import allocation_peak

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        kept = torch.ones(1 << 20)  # 4 MiB kept by an earlier profiled step: alive before, counted once
    # Without gradients: the function takes those out at the start (zero_grad frees them), and
    # tests before this one may have left modules with gradients alive in this process.
    census = {k: v for k, v in live_storages().items() if not v["grad"]}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        a = torch.ones(1 << 18)  # 1 MiB
        b = torch.ones(1 << 19)  # 2 MiB, both alive: the peak
        del a, b
        c = torch.ones(1 << 19)  # 2 MiB after the others went
    alive = sum(v["bytes"] for v in census.values() if v["device"] == "cpu")
    assert alive >= 4 << 20
    peak = allocation_peak(prof, census, torch.device("cpu"))["peak_bytes"]
    assert alive + (3 << 20) <= peak < alive + (3 << 20) + 65536
    del kept, c


def test_v_shaped_placement_is_the_schedules_own():
    from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

    for pp in (2, 3, 4):
        v = ParallelDims(pp=pp, stages_per_rank=2, pp_style="v")
        assert v.stage_to_rank_mapping() == generate_stage_to_rank_mapping(pp, 2 * pp, style="v")
        assert v.stages_on_pp_rank(0) == [0, 2 * pp - 1] and v.last_stage_ranks() == [0]
        loop = ParallelDims(pp=pp, stages_per_rank=2)
        assert loop.stage_to_rank_mapping() == generate_stage_to_rank_mapping(pp, 2 * pp, style="loop")
        assert loop.last_stage_ranks() == [pp - 1]
    assert {s: stage_placement(s) for s in SCHEDULES} == {
        "GPipe": "loop", "1F1B": "loop", "Interleaved1F1B": "loop", "InterleavedZeroBubble": "loop",
        "ZBVZeroBubble": "v", "DualPipeV": "v"}
    with pytest.raises(ValueError, match="V-shaped stage placement needs stages_per_rank = 2"):
        ParallelDims(pp=2, stages_per_rank=3, pp_style="v")
    with pytest.raises(ValueError, match="ep = 4 must divide dp_shard = 2"):
        ParallelDims(dp_shard=2, tp=2, ep=4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--parallelism.tp=3", "--parallelism.dp_shard=1"],
         r"parallelism.tp = 3 does not divide the model's n_heads = 8 \(llama/debug\).* among \[1, 2, 4, 8\]"),
        (["--parallelism.tp=8", "--parallelism.dp_shard=1", "--parallelism.pp=1"],
         r"parallelism.tp = 8 does not divide the model's n_kv_heads = 4"),
        (["--model.name=deepseek_v2", "--parallelism.tp=3", "--parallelism.dp_shard=1", "--model.flavor=debug"],
         r"parallelism.tp = 3 does not divide the model's n_heads = 4 \(deepseek_v2/debug\)"),
        (["--parallelism.tp=2", "--training.seq_len=127"],
         r"training.seq_len = 127 is not divisible by parallelism.tp = 2: sequence parallel"),
        (["--parallelism.tp=4", "--parallelism.dp_shard=1", "--parallelism.pp=1", "--data.tokenizer=byte",
          "--model.flavor=debug", "--parallelism.microbatches=1"],
         r"parallelism.tp = 4 with parallelism.loss_parallel = true does not divide the vocabulary of 258"),
        (["--ray.num_workers=4", "--parallelism.tp=2"],
         r"ray.num_workers = 4 but the mesh needs parallelism.pp × parallelism.dp_shard × parallelism.tp = "
         r"2 × 2 × 2 = 8"),
        (["--parallelism.pipeline_schedule=ZBVZeroBubble", "--parallelism.stages_per_rank=3"],
         r"stages_per_rank = 3 with pipeline_schedule = 'ZBVZeroBubble': the V-shaped schedule holds exactly 2"),
        (["--parallelism.pipeline_schedule=DualPipeV", "--parallelism.stages_per_rank=2",
          "--parallelism.microbatches=2"],
         r"parallelism.microbatches = 2 with DualPipeV on pp = 2: the schedule needs microbatches >= 4"),
        (["--model.name=deepseek_v2", "--parallelism.tp=2", "--parallelism.ep=4"],
         r"parallelism.ep = 4 must divide parallelism.dp_shard = 2 \(expert parallelism borrows its ranks from "
         r"dp_shard only, never from tp"),
        (["--parallelism.dp_replicate=2", "--training.global_batch_size=12"],
         r"global_batch_size = 12 is not divisible by parallelism.microbatches × parallelism.dp_replicate × "
         r"parallelism.dp_shard = 4 × 2 × 2 = 16"),
    ],
)
def test_invalid_meshes_are_refused_before_any_worker(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_job(load_config(REPO / "configs" / "debug_llama.toml", overrides))
