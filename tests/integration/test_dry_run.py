"""``ray-titan dry-run``: ranks of a mesh trained on the simulated CUDA device (child processes,
a C++ library built once): what it reports, and that its NCCL check catches a host-tensor
collective in ray_titan's own code."""

from __future__ import annotations

import pytest
import torch

from ray_titan.config import load_config
from ray_titan.dry_run import DryRunError, dry_run, format_results, representative_ranks
from tests.conftest import REPO

LLAMA = str(REPO / "configs" / "debug_llama.toml")
# The plan is fitted to the CPU build's kernels; a CUDA build of torch (no GPU needed) runs the
# fused RMSNorm a GPU runs and simulates a lower peak (docs/memory.md, "The plan against the run").
CPU_BUILD_KERNELS = pytest.mark.skipif(torch.version.cuda is not None,
                                       reason="plan vs simulated peak within 10 %: fitted to the CPU build's kernels")
MESH = ["--parallelism.pp=2", "--parallelism.dp_shard=2", "--parallelism.tp=2"]


def test_ranks_of_a_pp_fsdp_tp_mesh_train_on_the_simulated_device():
    """The first rank of the first stage and the last of the last (pp=2 × dp_shard=2 × tp=2,
    --ranks all's ends) run two steps: every rank's coordinates and stage, the host syncs of the
    step by site (one: the step's scalars copied to the host together, on the first stage as on
    the last, which has the loss; there were 3.5 and 4.5), the collectives, and a device peak
    above what the built rank holds (activations, gathered parameters)."""
    cfg = load_config(LLAMA, MESH)
    assert representative_ranks(cfg) == [0, 3, 4, 7]
    first, last = dry_run(LLAMA, MESH, ranks=[0, 7], steps=2)
    assert (first.coords, first.stages, last.coords, last.stages) == (
        {"pp": 0, "dp_shard": 0, "tp": 0}, [0], {"pp": 1, "dp_shard": 1, "tp": 1}, [1])
    for r in (first, last):
        assert r.steps == 2 and r.collectives > 100
        assert r.peak_device_bytes > r.device_bytes_after_build > 0
        assert r.plan_peak_bytes and r.plan_peak_bytes > 0
        ((site, n),) = r.host_syncs_per_step.items()
        assert n == 1 and site.startswith("trainer/step.py:") and site.endswith("(tolist)")  # _to_host
    table = format_results([first, last])
    assert "pp=1, dp_shard=1, tp=1" in table and "host synchronisations per step" in table


def test_the_dry_run_simulates_the_job_memory_fit_auto_makes(capsys):
    """With ``memory.fit = "auto"`` a run trains the plan's choice, so the dry run simulates that
    job, not the one given: the debug Llama without AC (12.1 MiB planned) on 11 MiB trains with
    8 microbatches; its simulated peak is that job's, below the usable 10.1 MiB. It simulated the
    given job's 12 MiB before."""
    flags = ["--activation_checkpoint.mode=none", "--memory.fit=auto", '--memory.device_memory="11MiB"']
    (r,) = dry_run(LLAMA, flags, steps=2)  # the second step holds the optimizer state
    assert "training with --parallelism.microbatches=8" in capsys.readouterr().out
    assert r.plan_peak_bytes is not None and r.peak_device_bytes < 0.92 * 11 * 2**20
    assert abs(r.peak_device_bytes / r.plan_peak_bytes - 1) < 0.1


def test_a_host_tensor_on_an_nccl_group_is_named_with_its_op_and_frame():
    """memory.cpu_offload keeps FSDP2's shards and gradients on the host: the gradient norm's
    all-reduce then reduces a host tensor. On NCCL-only groups (what ray_titan made before
    process_group_backend) the dry run fails naming the op, the device and grad_norm.py; with
    the job's own groups (cuda:nccl,cpu:gloo under cpu_offload) the same rank runs."""
    overrides = ["--parallelism.pp=1", "--parallelism.dp_shard=2", "--memory.cpu_offload=true"]
    with pytest.raises(DryRunError, match=r"all_reduce.* on a cpu tensor .* issued at parallel/grad_norm\.py:\d+"):
        dry_run(LLAMA, overrides, steps=1, host_backend=False)
    (ok,) = dry_run(LLAMA, overrides, steps=1)
    assert ok.steps == 1


def test_the_moe_job_with_expert_parallelism_syncs_once_per_dispatch_and_runs_grouped_gemm():
    """The MoE job's last rank (pp=2 × dp_shard=2 × ep=2, bf16 by default on CUDA), two steps:
    the all-to-all's split sizes (both directions) are read on the host once per MoE layer and
    microbatch, plus the step's one copy of its scalars (there were 22: the sizes twice, the
    routing counts, the loss, norm and flags apart); the routed experts run torch._grouped_mm,
    3 GEMMs forward and 6 backward per layer and microbatch. Its simulated peak is within 10 % of
    the memory plan's (10.8 % above it before the plan counted the bf16 MoE and MLA terms)."""
    (r,) = dry_run(str(REPO / "configs" / "debug_deepseek.toml"), [], ranks=[3], steps=2)
    assert r.coords == {"pp": 1, "dp_shard": 1, "ep": 1} and r.stages == [1]
    layers_times_microbatches = 2 * 4  # 2 MoE layers on the stage × 4 microbatches
    splits = {site: n for site, n in r.host_syncs_per_step.items() if site.startswith("parallel/expert.py:")}
    ((site, n),) = splits.items()
    assert n == layers_times_microbatches and site.endswith("(tolist)")
    assert sum(r.host_syncs_per_step.values()) == layers_times_microbatches + 1
    assert r.grouped_mm_per_step == (3 + 6) * layers_times_microbatches
    assert r.plan_peak_bytes is not None
    assert abs(r.peak_device_bytes / r.plan_peak_bytes - 1) < 0.10, (r.peak_device_bytes, r.plan_peak_bytes)


# CI's compatibility job reruns this rank on torch 2.11 and 2.15 (CUDA wheels, no GPU). Not the plan
# comparisons: a CUDA build runs rms_norm fused, as a GPU does, and simulates a peak ~12 % below the
# plan, which is fitted to the CPU build's unfused one (docs/memory.md).
@pytest.mark.compat
def test_a_one_rank_mesh_trains_and_plans_its_checkpoint():
    """One rank, no process group to shard over: no FSDP2 materialises the fake parameters, and
    torch's ``Module.to_empty`` could not swap them (a fake tensor's weakref). The rank runs a
    step, and the checkpoint DCP plans after it (nothing written) copies every byte of the rank's
    parameters and optimizer state from the device, only the generator states from the host, and
    plans reading every key back on resume."""
    (r,) = dry_run(LLAMA, ["--parallelism.pp=1", "--parallelism.dp_shard=1"], steps=1)
    assert (r.coords, r.stages, r.steps) == ({"pp": 0, "dp_shard": 0}, [0], 1)
    assert r.checkpoint_bytes["cuda"] == r.held_bytes["parameters"] + r.held_bytes["optimizer_state"] > 0
    assert 0 < r.checkpoint_bytes["cpu"] < 64 << 10  # rng.rank0.cpu and rng.rank0.cuda
    assert r.resume_read_items == r.checkpoint_keys > 100


@CPU_BUILD_KERNELS
def test_the_simulated_peak_matches_the_memory_plan_on_a_long_sequence_tp_rank():
    """seq 1024 on pp=2 × dp_shard=2 × tp=2, rank 0: the simulated peak is within 10 % of the
    plan's. It read 8.4× the plan before: attention took the math path on the fake device
    (``seq²`` probabilities saved), and DTensor's shape propagation on global-shape fakes was
    counted as device memory; and the plan split the all-gathered projection inputs and the
    pipeline buffers wrongly under tensor / sequence parallel."""
    overrides = [*MESH, "--training.seq_len=1024", "--training.global_batch_size=8"]
    (r,) = dry_run(LLAMA, overrides, ranks=[0], steps=1)
    assert r.plan_peak_bytes is not None
    assert abs(r.peak_device_bytes / r.plan_peak_bytes - 1) < 0.10, (r.peak_device_bytes, r.plan_peak_bytes)


@CPU_BUILD_KERNELS
def test_the_plan_matches_the_simulated_peak_by_category_on_matrix_cases():
    """Cases of ``python -m benchmarks.dry_run_matrix`` through its own function: every category
    of the plan's peak (parameters, gradients, optimizer state, activations, temporaries) within
    10 % of the simulated peak. fsdp2 fp32 read −17 % on temporaries before: the CPU build's
    math form of ``silu_backward`` (six f-wide temporaries a GPU's kernel never makes) on the
    simulated side, a SwiGLU backward of 2 f-wide gradients (not 4) and the whole head counted as
    activations at a block's backward on the plan's; the bf16 rank without FSDP read −11 % on
    activations, autocast's bf16 weight copies counted as activations, not parameters."""
    from benchmarks.dry_run_matrix import CASES, run_case

    cases = {c.name: c for c in CASES}
    rows = [*run_case(cases["fsdp2 fp32"], [0]), *run_case(cases["1 rank bf16 (autocast)"], [0])]
    for row in rows:
        assert row["passed"], (row["case"], row["error"], row["simulated"], row["planned"])


@CPU_BUILD_KERNELS
def test_the_block_inputs_ac_keeps_are_planned_in_the_residual_streams_dtype():
    """Llama 3.2 1B, FSDP2 over 2, bf16, full AC, 4,096 tokens, rank 0 (~15 s): the peak is the
    loss's backward, with every block's checkpointed input kept, bf16 (FSDP2's bf16 parameters
    make the residual stream bf16), and no block's parameters gathered yet. The plan's
    activations and parameters are within 0.5 % of the simulated peak; before 2026-11-28 they
    read +1.8 % (the inputs counted fp32; Llama 3.1 8B at cp = 8, 16,384 tokens a rank: +4 GiB,
    the plan +11.9 % in total; issue 42) and +1.7 % (two blocks' gathered parameters counted at
    the loss's backward)."""
    from benchmarks.dry_run_matrix import _case, run_case

    job = _case("1B fsdp2 bf16 full-AC", model="llama", flavor="3.2-1B", dp=2, seq=4096, mb=1, bf16=True, ac="full")
    (row,) = run_case(job, [0])
    assert abs(row["error"]["activations"]) < 0.005, (row["error"], row["simulated"], row["planned"])
    assert abs(row["error"]["parameters"]) < 0.005, (row["error"], row["simulated"], row["planned"])
    assert abs(row["error"]["total"]) < 0.05, (row["error"], row["simulated"], row["planned"])


@CPU_BUILD_KERNELS
def test_an_moe_blocks_recomputation_and_backward_under_tp_are_planned_whole():
    """DeepSeek-V3 debug under tp = dp_shard = ep = 2, bf16, op SAC, rank 0 (~10 s): the peak is
    an MoE block's backward, whose recomputed router input, dispatched and received rows,
    all-gathered MoE input and the combine's gradients are rows of the whole sequence on every tp
    rank (only the experts' hidden units are split). The plan's temporaries and total are within
    8 % of the simulated peak (2026-11-28: −5.5 % and +0.4 %); before, they read −18 % and −29 %
    (the plan divided all of them by tp; and op SAC's saved all-to-all outputs were not counted:
    activations −10 %). The full-AC twin is a row of ``benchmarks/dry_run_matrix.py``."""
    from benchmarks.dry_run_matrix import CASES, run_case

    (job,) = [c for c in CASES if c.name == "deepseek_v3 tp2 dp2 ep2 bf16 sel-op"]
    (row,) = run_case(job, [0])
    assert row["passed"], (row["error"], row["simulated"], row["planned"])
    assert abs(row["error"]["temporaries"]) < 0.08, (row["error"], row["simulated"], row["planned"])
    assert abs(row["error"]["total"]) < 0.08, (row["error"], row["simulated"], row["planned"])
