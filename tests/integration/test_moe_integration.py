"""The DeepSeek MoE through the driver and collector on the shared Ray cluster: parity of
pp=2 × ep=2 and of ep=2 with one worker, flat host memory over 300 steps, and balanced experts.

The README's MoE job (pp=2 × ep=2 with the balance loss) runs once on Ray, for 300 steps: its
first 10 are the parity run's, since they fall in the LR warm-up (20 steps), whose rates do not
depend on the run's length. The other meshes, whose subject is the mesh and not Ray, run through
the launcher (torchrun's ranks forked from the session's forkserver, ``tests/support/ranks.py``), whose
collector writes the same Parquet rows and TensorBoard scalars."""

from __future__ import annotations

import numpy as np
import pytest

import ray_titan
from ray_titan.allocator import jemalloc_library
from ray_titan.config import load_config
from ray_titan.metrics.reading.moe_stats import expert_load, expert_shares, memory_slopes
from tests.conftest import REPO, LaunchRun

pytestmark = pytest.mark.ray

STEPS = 10
MESHES = {
    # The field's leaking configuration (docs/design.md, lesson 2): configs/debug_deepseek.toml as is,
    # the long run's first steps.
    "pp2_ep2": [],
    "ep2": ["--parallelism.pp=1", "--parallelism.dp_shard=2", "--parallelism.ep=2"],
    # Auxiliary-loss-free balancing: the router bias follows the all-reduced global load.
    "pp2_ep2_aux_free": ["--model.load_balance=aux_free"],
}
ONE_WORKER = ["--parallelism.pp=1", "--parallelism.dp_shard=1", "--parallelism.ep=1"]


def _run(tmp_path_factory, corpus_cache, name, *overrides, steps=STEPS):
    cfg = load_config(REPO / "configs" / "debug_deepseek.toml", [
        f"--job.name={name}", f"--job.dump_folder={tmp_path_factory.mktemp(name)}",
        f"--data.cache_dir={corpus_cache}", f"--training.steps={steps}",
        "--metrics.log_freq=1000", "--memory.breakdown_step=0", *overrides,
    ])
    return ray_titan.train(cfg)


@pytest.fixture(scope="module")
def moe_references(tmp_path_factory, corpus_cache):
    """One process without Ray (all experts local, no PP, no FSDP) per balancing mode, run on
    first use."""
    cache = {}

    def get(mode: str):
        if mode not in cache:
            cache[mode] = LaunchRun(REPO / "configs" / "debug_deepseek.toml", [
                f"--job.name=moe_ref_{mode}", f"--data.cache_dir={corpus_cache}", f"--training.steps={STEPS}",
                "--metrics.log_freq=1000", "--memory.breakdown_step=0", *ONE_WORKER, f"--model.load_balance={mode}",
            ], tmp_path_factory.mktemp(f"moe_ref_{mode}"))
        return cache[mode]

    return get


@pytest.fixture(scope="module", params=list(MESHES))
def moe_run(request, tmp_path_factory, corpus_cache):
    name = request.param
    if name == "pp2_ep2":
        return name, request.getfixturevalue("long_moe_run")
    nproc = 2 if name == "ep2" else 4
    return name, LaunchRun(REPO / "configs" / "debug_deepseek.toml", [
        f"--job.name=moe_{name}", f"--data.cache_dir={corpus_cache}", f"--training.steps={STEPS}",
        "--metrics.log_freq=1000", "--memory.breakdown_step=0", *MESHES[name],
    ], tmp_path_factory.mktemp(f"moe_{name}"), nproc)


@pytest.fixture
def moe_reference(moe_run, moe_references):
    return moe_references("aux_free" if moe_run[0].endswith("aux_free") else "aux_loss")


def _col(result, column):
    return np.array(result.step_column(column), dtype=float)


def test_moe_parity_with_one_worker(moe_run, moe_reference):
    name, run = moe_run
    assert run.errors == [] and moe_reference.errors == []
    ref = _col(moe_reference, "step_loss")
    assert len(ref) == STEPS
    np.testing.assert_allclose(_col(run, "step_loss")[:STEPS], ref, rtol=1e-4, err_msg=name)
    np.testing.assert_allclose(_col(run, "grad_norm")[:STEPS], _col(moe_reference, "grad_norm"), rtol=1e-4,
                               err_msg=name)
    # The same routing decisions on every mesh, and dropless: every token routed top-k times.
    for step in (1, STEPS):
        ref_load = _load(moe_reference, step)
        assert sorted(ref_load) == [1, 2, 3]
        load = _load(run, step)
        assert all(sum(c) == 16 * 128 * 2 for c in load.values())  # batch × seq_len × top-k
        # Float differences of 1e-7 between meshes may flip a near-tie: allow a few tokens.
        for layer, counts in load.items():
            assert np.abs(np.subtract(counts, ref_load[layer])).max() <= 4, (name, step, layer)


def _load(run, step):
    rows = run.steps.select(["step", "moe_layers", "expert_load"]).to_pylist()
    return expert_load([r for r in rows if r["step"] == step])


def test_moe_rows_carry_coordinates_and_balance_loss(moe_run):
    name, run = moe_run
    t = run.steps
    ranks = sorted(set(t["rank"].to_pylist()))
    first = [r for r in t.to_pylist() if r["step"] == 1]
    assert [r["ep"] for r in first] == [r["dp_shard"] % 2 for r in first]
    assert all(r["moe_layers"] for r in first)  # every stage holds MoE layers (layer 0 is dense)
    if name.endswith("aux_free"):
        assert all(r["aux_loss"] is None for r in first)
    else:  # a positive balance loss for the rank's layers (1 = perfectly balanced, × α)
        assert all(r["aux_loss"] is not None and r["aux_loss"] > 0 for r in first)
    assert len(ranks) == (2 if name == "ep2" else 4)


@pytest.fixture(scope="module")
def long_moe_run(ray_cluster, tmp_path_factory, corpus_cache):
    """The README's MoE job as configured (pp=2 × dp_shard=2, ep=2, balance loss), 300 steps,
    logging never (log_freq > steps): the lesson-1 and lesson-2 scenario together."""
    return _run(tmp_path_factory, corpus_cache, "moe_long", steps=LONG_STEPS)


# The 300. Steps 101-300 of two 400-step runs gave the margins of steps 101-400 (malloc
# in-use -0.10 to -0.07 MiB per 100 steps, RSS -0.44 to +0.92 against 2; experts' shares of
# steps 251-300 within 0.80-1.22 × uniform then): 100 steps fewer of the suite's longest run.
LONG_STEPS = 300
WARMUP_STEPS = 100
# What the trainer itself holds on the host: malloc's in-use bytes (CPU tensors are malloc'd).
# The lesson-2 leak (a dispatch all-to-all whose backward never runs keeps every step's routed
# activations: per microbatch and MoE layer 512 token copies × 128 dims × 4 bytes and their
# expert intermediates, MiBs per step) would add hundreds of MiB per 100 steps.
MAX_HEAP_GROWTH_PER_100_STEPS = 1 * 2**20
# RSS. With the workers on jemalloc (memory.allocator = "auto") it grew -0.04 to +1.01 MiB per 100
# steps per rank over steps 101-400 in four runs (the target: < 1;
# benchmarks/moe_balance_memory.py prints it). Two things move it: jemalloc's thread caches
# filling (+0.3 MiB per 100 steps) and the freed pages it has not yet returned (9-20 MiB,
# varying from step to step), which shift a rank's slope by up to ±0.4. The test allows 2 MiB
# so that jitter cannot fail it; glibc's
# malloc reached up to 6 MiB per 100 steps here, and the lesson-2 leak would add hundreds.
MAX_RSS_GROWTH_PER_100_STEPS = 2 * 2**20


def test_moe_host_memory_is_flat_after_warmup(long_moe_run):
    """After a 100-step warm-up (Theil–Sen slope over steps 101–300 of every rank's per-step
    samples), on every rank, each running jemalloc: malloc's in-use bytes grow by less than 1 MiB
    per 100 steps, and RSS (``VmRSS``) by less than 2."""
    run = long_moe_run
    assert run.errors == [] and run.steps.num_rows == LONG_STEPS * 4
    if jemalloc_library() is not None:
        assert {v["allocator"] for k, v in run.timings.items() if k.startswith("rank")} == {"jemalloc"}
    heap = memory_slopes(run.steps, WARMUP_STEPS, "host_heap_in_use_bytes")
    rss = memory_slopes(run.steps, WARMUP_STEPS)
    assert sorted(heap) == sorted(rss) == [0, 1, 2, 3]
    for rank in heap:
        assert heap[rank] * 100 < MAX_HEAP_GROWTH_PER_100_STEPS, (
            f"rank {rank}: malloc in-use {heap[rank] * 100 / 2**10:.0f} KiB per 100 steps")
        assert rss[rank] * 100 < MAX_RSS_GROWTH_PER_100_STEPS, (
            f"rank {rank}: RSS {rss[rank] * 100 / 2**10:.0f} KiB per 100 steps")


# Band for the balance loss on the debug MoE (8 experts, uniform share 12.5%):
# every expert's share of the last 100 steps' tokens within [1/2, 2] × uniform. Fifty steps were
# too few: on a machine whose CPU rounds differently the same code's trajectory (2026-11-25, the
# code of 7346bdb and after alike) had one layer-2 expert dip to 0.44 × uniform over steps 251-300
# and recover (0.82-1.51 over 201-300; the other layers 0.80-1.25).
SHARE_BAND = (0.5 / 8, 2.0 / 8)
SHARE_STEPS = 100


def test_moe_experts_are_balanced_and_it_learns(long_moe_run):
    run = long_moe_run
    shares = expert_shares(run.steps, LONG_STEPS - SHARE_STEPS + 1, LONG_STEPS)
    assert sorted(shares) == [1, 2, 3]
    for layer, s in shares.items():
        assert SHARE_BAND[0] <= min(s) and max(s) <= SHARE_BAND[1], f"layer {layer}: {np.round(s, 3)}"
    loss = _col(run, "step_loss")
    assert loss[-20:].mean() < 3.0 < loss[0]


def test_expert_load_reaches_tensorboard(moe_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    name, run = moe_run
    acc = EventAccumulator(str(run.tensorboard_dir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {f"moe/layer{layer}/expert{e}_share" for layer in (1, 2, 3) for e in range(8)} <= tags
    rows = run.steps.select(["step", "moe_layers", "expert_load"]).to_pylist()
    for step in (1, STEPS):
        counts = expert_load([r for r in rows if r["step"] == step])[2]
        want = max(counts) * len(counts) / sum(counts)
        got = [e.value for e in acc.Scalars("moe/layer2/load_max_over_mean") if e.step == step]
        assert got == [pytest.approx(want, rel=1e-6)], name
    assert ("moe/aux_loss" in tags) != name.endswith("aux_free")
