"""The benchmark runner's statistics and table, and the FLOPs-per-token formula (no timing)."""

from __future__ import annotations

import pytest

from benchmarks.stats import Row, alternate, format_table, ratio_stats, slope
from ray_titan.metrics.flops import gpu_peak_flops, mfu
from ray_titan.models.costs import transformer_flops_per_token
from ray_titan.models.llama import Llama, LlamaArgs
from ray_titan.models.llama.costs import llama_flops_per_token, llama_non_embedding_params
from ray_titan.models.registry import build_model


def test_ratio_stats_median_min_max_of_paired_ratios():
    st = ratio_stats([90.0, 100.0, 99.0], [100.0, 100.0, 90.0])  # ratios 0.9, 1.0, 1.1
    assert (st.median, st.min, st.max, st.n) == pytest.approx((1.0, 0.9, 1.1, 3))
    assert (st.median_a, st.median_b) == (99.0, 100.0)
    with pytest.raises(ValueError, match="equal"):
        ratio_stats([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="zero"):
        ratio_stats([1.0], [0.0])


def test_alternate_runs_sides_in_abba_order_and_table_shows_ratio():
    order = []
    a, b = alternate(lambda: order.append("A") or len(order), lambda: order.append("B") or len(order), 3)
    assert order == ["A", "B", "B", "A", "A", "B"]
    assert a == [1, 4, 5] and b == [2, 3, 6]
    table = format_table([Row("x", "A", "1", "B", "2", ratio_stats([1.0, 3.0], [2.0, 2.0]), "≥ 0.97", "a|b")])
    assert "| 1.000 [0.500, 1.500] n=2 |" in table and "a/b" in table


def test_slope_recovers_a_linear_trend():
    assert slope([1, 2, 3, 4], [10, 12, 14, 16]) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        slope([1, 1], [2, 3])


def test_dense_flops_match_a_hand_count():
    # 2 layers, dim 8, 2 heads of 4, 1 kv head, SwiGLU hidden 32, vocab 10, no tied head.
    args = LlamaArgs(dim=8, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=10, multiple_of=32,
                     ffn_dim_multiplier=None, max_seq_len=16)
    assert args.ffn_hidden_dim == 32
    per_layer = 8 * 8 + 8 * 4 + 8 * 4 + 8 * 8 + 3 * 8 * 32 + 2 * 8  # wq wk wv wo, w1 w2 w3, norms
    n = 2 * per_layer + 8 + 8 * 10  # final norm, output head
    assert llama_non_embedding_params(args) == n == 2040
    # PaLM appendix B: 6N + 12·L·H·Q·T with T = 16.
    assert llama_flops_per_token(args, 16) == 6 * 2040 + 12 * 2 * 2 * 4 * 16 == 15_312


@pytest.mark.parametrize("flavor", ["debug", "8B"])
def test_non_embedding_count_matches_the_model(flavor):
    import torch

    with torch.device("meta"):
        model = build_model("llama", flavor)
    assert isinstance(model, Llama)
    total = sum(p.numel() for p in model.parameters())
    assert llama_non_embedding_params(model.args) == total - model.tok_embeddings.weight.numel()


def test_moe_is_one_call_with_activated_parameters_and_mfu():
    # A MoE layer stack with 1e9 activated non-embedding parameters, 27 layers, attention width
    # 16 heads × 192, 4096 tokens of context.
    assert transformer_flops_per_token(10**9, 27, 16 * 192, 4096) == 6 * 10**9 + 12 * 27 * 3072 * 4096
    with pytest.raises(ValueError, match="seq_len"):
        transformer_flops_per_token(1, 1, 1, -1)
    assert mfu(1000.0, 6e9, 1e13) == pytest.approx(0.6)
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert gpu_peak_flops("NVIDIA H100 NVL") == 835.5e12
    assert gpu_peak_flops("Tesla T4") is None


def test_subprocess_flags_reproduce_the_config():
    """The torchrun comparison passes the job to its ranks as flags: every section, scalars,
    lists and strings, must come back equal (the [[callbacks]] array has no flag form)."""
    from benchmarks.harness import subprocess_flags as _flags
    from ray_titan.config.schema import Callback, load_config
    from tests.conftest import REPO

    cfg = load_config(REPO / "configs" / "debug_deepseek.toml", ["--training.steps=7", "--memory.snapshot_steps=[3]"])
    assert load_config(None, _flags(cfg)) == cfg
    with_cb = cfg.model_copy(update={"callbacks": [Callback(target="a.b:c")]})
    with pytest.raises(ValueError, match="callbacks: 1 entries"):
        _flags(with_cb)




def test_worker_side_cost_reads_the_runs_own_metrics_time():
    from types import SimpleNamespace

    import pyarrow as pa

    from benchmarks.main_job import worker_side_cost

    def run(costs, step_s):
        t = pa.table({"rank": [0, 1] * len(costs), "metrics_time_s": [c for c in costs for _ in (0, 1)],
                      "step_time_s": [step_s] * 2 * len(costs)})
        return {"result": SimpleNamespace(steps=t)}

    c = worker_side_cost([run([None, 0.001, 0.001], 0.2), run([None, 0.001, 0.005], 0.2)])
    # The first step of a run has no figure; a cost is a mean, the rare dear step included.
    assert c["per_step_us"] == pytest.approx(2000) and c["median_us"] == pytest.approx(1000)
    assert c["fraction_of_step"] == pytest.approx(0.01)


def test_the_runner_lists_every_registered_benchmark_and_docs_say_how_to_run_each(capsys):
    """``python -m benchmarks.run --help`` names every benchmark of the registry (and ``gpu``), an
    unknown name is refused naming the valid ones, and docs/benchmarks.md has a command for each."""
    from benchmarks.registry import ALL_NAMES, BENCHMARKS, CPU_NAMES, STEPS
    from benchmarks.run import main
    from tests.conftest import REPO

    assert CPU_NAMES == ["collector", "bare", "torchrun", "ray_train", "memory", "startup"]
    assert ALL_NAMES[:len(CPU_NAMES)] == CPU_NAMES and set(STEPS) == set(BENCHMARKS) == set(ALL_NAMES)
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and all(f"  {n} " in out for n in [*ALL_NAMES, "gpu"])
    with pytest.raises(SystemExit) as e:
        main(["collector", "nope"])
    assert e.value.code == 2 and "unknown benchmark(s) ['nope']" in capsys.readouterr().err
    doc = (REPO / "docs" / "benchmarks.md").read_text()
    assert [n for n in [*ALL_NAMES, "gpu"] if f"python -m benchmarks.run {n}" not in doc] == []


def test_gpu_run_without_cuda_says_why_runs_the_environment_stage_and_exits_1(tmp_path, monkeypatch):
    """`python -m benchmarks.run gpu --out DIR` where torch sees no CUDA device (a driver older
    than the wheel's CUDA, the likeliest first-contact failure): a fact with the build's CUDA and
    the device count, then the environment stage alone (driver, nvidia-smi), exit 1. The stage's
    process is replaced here (the unit tier starts none)."""
    import torch

    from benchmarks import gpu
    from benchmarks.facts import read_facts
    from benchmarks.run import main

    ran = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu, "run_stage", lambda stage, timeout, out, args, log: ran.append(stage.name) or "ok")
    assert main(["gpu", "--out", str(tmp_path)]) == 1
    assert ran == ["environment"]
    facts = read_facts(tmp_path)
    assert [(f["stage"], f["name"]) for f in facts][:2] == [("run", "started"), ("run", "cuda available")]
    note = facts[1]["note"]
    assert facts[1]["value"] is False and "built for CUDA" in note and "--device cpu --small" in note


def test_gpu_run_skips_every_stage_that_the_deadline_leaves_no_time_for(tmp_path, capsys):
    """A deadline below every stage's minimum: each stage is recorded as skipped for lack of
    time (none started), the run exits 1; every fact also printed as it was written."""
    from benchmarks.facts import read_facts
    from benchmarks.gpu import STAGES, main

    assert main(["--out", str(tmp_path), "--device", "cpu", "--small", "--deadline", "3"]) == 1
    outcomes = {f["stage"]: f["value"] for f in read_facts(tmp_path) if f["name"] == "outcome"}
    assert list(outcomes) == [s.name for s in STAGES]
    assert all(v.startswith("skipped: not enough time left") for v in outcomes.values())
    assert "[compile] outcome: skipped" in capsys.readouterr().out


def test_stage_timeout_keeps_the_later_stages_minimums():
    """A stage gets min(cap, time left − the later stages' minimums), and is skipped below its own
    minimum; a cap set by hand (even below the minimum) is honoured."""
    from benchmarks.gpu import Stage, plan_timeout

    a, b, c = Stage("a", "", 100, 20), Stage("b", "", 50, 30), Stage("c", "", 50, 40)
    assert plan_timeout(a, 500, [b, c]) == 100  # room for everything: the cap
    assert plan_timeout(a, 150, [b, c]) == 80  # 150 − 30 − 40: b and c keep their minimums
    assert plan_timeout(a, 85, [b, c]) is None  # 15 < a's minimum of 20: skipped, the time left to b and c
    assert plan_timeout(a, 500, [b, c], cap_s=1) == 1
    assert plan_timeout(c, 10, []) is None


def test_fact_log_appends_one_line_per_fact_readable_at_once(tmp_path):
    """Each fact is on disk the moment it is added (a second reader sees it), non-finite floats
    become strings, and a torn last line (a kill mid-write) is left out by the reader."""
    from benchmarks.facts import FACTS, FactLog, read_facts

    log = FactLog(tmp_path, "s")
    log.add("tokens/s", 12.5, "tok/s", note="n")
    assert read_facts(tmp_path)[0] | {"time": None} == {"stage": "s", "name": "tokens/s", "value": 12.5,
                                                        "unit": "tok/s", "time": None, "note": "n"}
    log.add("loss", float("nan"))
    with open(tmp_path / FACTS, "a") as f:
        f.write('{"stage": "s", "na')
    facts = read_facts(tmp_path)
    assert [f["value"] for f in facts] == [12.5, "nan"]


def test_host_sync_count_per_step_from_profiler_events():
    """Host reads, blocking CUDA calls and device-to-host copies, per profiled step."""
    from benchmarks.gpu_stages import count_host_syncs

    names = ["aten::_local_scalar_dense"] * 4 + ["cudaStreamSynchronize"] * 2 + ["cudaDeviceSynchronize"] * 2 + [
        "Memcpy DtoH (Device -> Pinned)"] * 6 + ["Memcpy HtoD (Pinned -> Device)", "cudaLaunchKernel", "aten::mm"]
    assert count_host_syncs(names, 2) == {"host_reads": 2, "sync_calls": 2, "dtoh_copies": 3,
                                          "cudaDeviceSynchronize": 1, "cudaStreamSynchronize": 1}


def test_flat_collectives_are_staged_whichever_torch_names_them(monkeypatch):
    """torch 2.11's FSDP2 calls ``all_gather_into_tensor`` (positionally) and
    ``reduce_scatter_tensor`` (by keyword) and has no ``all_gather_single``: staging wraps
    whichever exist, hands the collective host copies and copies the result back."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    from benchmarks import gpu_checks
    from ray_titan.parallel import expert

    for mod, names in ((dist, ("send", "recv", "send_object_list", "recv_object_list", "all_to_all_single")),
                       (schedules, ("_batch_p2p",)), (expert, ("all_to_all_single_autograd",))):
        for name in names:  # restored after the test
            monkeypatch.setattr(mod, name, getattr(mod, name))
    for name in ("all_gather_single", "reduce_scatter_single"):
        monkeypatch.delattr(dist, name, raising=False)
    seen = []

    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        seen.append(("gather", input_tensor.data_ptr(), async_op))
        output_tensor.copy_(torch.cat([input_tensor, input_tensor]))

    def reduce_scatter_tensor(output, input, op=None, group=None, async_op=False):
        seen.append(("scatter", input.data_ptr(), async_op))
        output.copy_(input[:2] + input[2:])

    monkeypatch.setattr(dist, "all_gather_into_tensor", all_gather_into_tensor, raising=False)
    monkeypatch.setattr(dist, "reduce_scatter_tensor", reduce_scatter_tensor, raising=False)
    monkeypatch.setattr(gpu_checks, "STAGED", gpu_checks.Counter())
    gpu_checks.stage_collectives_through_host(force=True)
    x, out = torch.tensor([1.0, 2.0]), torch.zeros(4)
    assert dist.all_gather_into_tensor(out, x, None) is None
    assert out.tolist() == [1, 2, 1, 2]
    small = torch.zeros(2)
    work = dist.reduce_scatter_tensor(output=small, input=out, op=None, group=None, async_op=True)
    assert work.wait() and small.tolist() == [2, 4]
    # Host copies were handed over (not the caller's tensors), run synchronously.
    assert [(k, a) for k, _, a in seen] == [("gather", False), ("scatter", False)]
    assert seen[0][1] != x.data_ptr() and seen[1][1] != out.data_ptr()
    assert gpu_checks.STAGED == {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}


def test_failure_line_finds_the_error_above_torchruns_summary():
    from benchmarks.gpu_checks import failure_line

    err = ("x\n[rank1]: TypeError: Decoder.forward() got an unexpected keyword argument 'loss_kwargs'\n[rank0]: y\n"
           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n=====\n")
    assert failure_line(err).startswith("TypeError: Decoder.forward()")
    assert failure_line("a\nlast\n") == "last" and failure_line("") == "no stderr"


def test_wheelhouse_platform_tags_include_every_older_manylinux():
    from benchmarks.wheelhouse import platform_tags

    tags = platform_tags("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags and "manylinux2014_x86_64" in tags
    assert "manylinux_2_29_x86_64" not in tags and platform_tags("manylinux2014_aarch64")[0] == "manylinux_2_17_aarch64"
    assert platform_tags("win_amd64") == ["win_amd64"]


def test_gpu_check_judges_fail_when_what_they_check_is_broken(tmp_path):
    """Each judge of the GPU acceptance run passes on the intended outcome and fails, with its
    reason, on the broken one: an OOM swallowed or leaving no snapshot, losses apart, device
    memory growing or unrecorded, a growing verdict, idle experts with a gradient."""
    import pyarrow as pa
    import torch

    from benchmarks.gpu_checks import (
        judge_device_fields,
        judge_device_memory_flat,
        judge_experts,
        judge_host_verdict,
        judge_oom,
        judge_parity,
    )

    snap = tmp_path / "rank1-oom-step3.pickle"
    snap.write_bytes(b"x")
    err = ("RankOutOfMemoryError: rank 1 (pp=1, dp_shard=0) ran out of memory at step 3 in the forward of "
           f"pipeline stage 1: peak device allocated 1 MiB; memory snapshot: {snap} (OutOfMemoryError: ...)")
    assert judge_oom(1, err, "cuda").passed
    assert "swallowed" in judge_oom(0, "", "cuda").reason
    assert not judge_oom(1, err, "cpu").passed  # a CPU run leaves a .json snapshot
    assert not judge_oom(1, err.replace(str(snap), str(tmp_path / "missing.pickle")), "cuda").passed
    assert not judge_oom(1, err.replace("stage 1", "stage 0"), "cuda").passed
    assert judge_parity("p", [5.0, 4.0], [5.0, 4.0 * (1 + 1e-4)]).passed
    assert not judge_parity("p", [5.0, 4.0], [5.0, 4.1]).passed
    assert not judge_parity("p", [5.0, None], [5.0, 4.0]).passed
    steps = list(range(1, 201))
    noise = [(s * 7919) % 13 * 4096 for s in steps]  # ±50 KiB of allocator noise, no trend
    assert judge_device_memory_flat(steps, [2**30 + n for n in noise], 100).passed
    growing = judge_device_memory_flat(steps, [2**30 + n + s * 2 * 2**20 // 100 for s, n in zip(steps, noise)], 100)
    assert not growing.passed and growing.data["slope_mib_per_100_steps"] > 1.9
    assert not judge_device_memory_flat(steps, [None] * 200, 100).passed
    full = pa.table({"step": [1, 2], "device_allocated_bytes": [1, 2], "device_ooms": [0, 0]})
    assert judge_device_fields(full).passed
    assert not judge_device_fields(full.set_column(2, "device_ooms", pa.array([0, None], pa.int64()))).passed
    assert judge_host_verdict(["warming_up", "stable"]).passed
    assert not judge_host_verdict(["warming_up", "stable", "growing"]).passed
    y, g = torch.ones(4, 3), torch.ones(4, 2, 3)
    assert judge_experts(y, g * torch.tensor([1.0, 1, 0, 0]).view(4, 1, 1), y, g, 2, 1e-5, "loop", 4).passed
    assert "nonzero" in judge_experts(y, g, y, g, 2, 1e-5, "loop", 4).reason


def test_every_flavor_of_every_family_has_a_dry_run_row(monkeypatch):
    """``python -m benchmarks.dry_run_matrix --flavors`` measures every registered flavor (issue
    29): a flavor added to a family without a row, or whose row is dropped, fails here; the
    debug MoE flavors run on their own configs (their load balancing)."""
    from benchmarks import dry_run_matrix as m
    from ray_titan.models.registry import MODELS

    assert m.flavors_uncovered() == []
    monkeypatch.setitem(MODELS["qwen3"].flavors, "new", MODELS["qwen3"].flavors["8B"])
    assert m.flavors_uncovered() == [("qwen3", "new")]
    debug = {c.name: c for c in m.FLAVOR_CASES}["deepseek_v2 debug pp2 dp2 ep2"]
    assert debug.config.endswith("configs/debug_deepseek.toml")


def test_staged_counts_survive_ranks_writing_into_one_stderr():
    """The ranks of a one-GPU launch share one stderr: a line could run into the next rank's
    ("...=1gpu_checks staged: ..."), which failed the main_mesh stage with a ValueError."""
    from benchmarks.gpu_checks import staged_counts

    err = ("gpu_checks staged: batch_p2p=3 recv_object_list=1gpu_checks staged: batch_p2p=4 send=2\n"
           "[rank1]: other\ngpu_checks staged: \n")
    assert staged_counts(err) == {"batch_p2p": 7, "recv_object_list": 1, "send": 2}


def test_a_bare_cuda_device_gets_the_index_set_device_needs(monkeypatch):
    """The first GPU contact (2026-11-27, H100): four checks handed ``torch.device("cuda")`` to
    ``torch.cuda.set_device``, which refuses a device without an index (ValueError). The index
    check here is torch's own, the one ``set_device`` makes."""
    import torch
    from torch.cuda._utils import _get_device_index

    from benchmarks.gpu_checks import indexed

    with pytest.raises(ValueError, match="specified index"):
        _get_device_index(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert _get_device_index(indexed(torch.device("cuda"))) == 3
    assert indexed(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert indexed(torch.device("cpu")) == torch.device("cpu")


def test_a_runs_device_peak_is_the_largest_step_peak_not_the_counters_after_it():
    """The memory sampler resets the device's peak counters at every sample, so after a run
    they hold only its tail: the run's peak is the largest per-step peak or that tail."""
    import pyarrow as pa

    from benchmarks.gpu_stages import run_peaks

    steps = pa.table({"device_peak_active_bytes": [5, 9, None, 7], "device_peak_reserved_bytes": [8, 12, None, 11]})
    assert run_peaks(steps, (3, 10)) == (9, 12)
    assert run_peaks(steps, (20, 30)) == (20, 30)
    assert run_peaks(pa.table({"step": [1]}), (3, 10)) == (3, 10)
    assert run_peaks(steps, None) == (None, None)


def test_a_snapshots_peak_is_replayed_from_its_events_with_what_was_live_then():
    """peak_owners: the window's largest rise over what was allocated before it (the segments at
    its end less its net change), the owners of what was live at that moment (a block freed only
    once its stream is done, free_completed, still counts), and who made the peak."""
    from benchmarks.gpu_stages import peak_owners

    def frames(path: str, fn: str) -> list[dict]:
        return [{"filename": "/usr/lib/python3/site-packages/torch/nn/functional.py", "name": "linear"},
                {"filename": f"/root/repo/ray_titan/{path}", "name": fn}]

    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": frames("models/llama/model.py", "forward")},
        {"action": "alloc", "addr": 2, "size": 50, "frames": frames("parallel/offload.py", "_prefetch")},
        {"action": "free_requested", "addr": 1, "size": 100},  # still active until completed
        {"action": "alloc", "addr": 3, "size": 30, "frames": []},  # the peak: 180 above the start
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 3, "size": 30},
        {"action": "alloc", "addr": 4, "size": 40, "frames": frames("trainer/step.py", "step")},  # 90 < 180
        {"action": "free_completed", "addr": 99, "size": 20},  # made before the window
        {"action": "free_requested", "addr": 4, "size": 40},
    ]
    # At the end: 1000 of the 1020 from before the window, plus the live 2 and 4 (4's free is
    # pending: another stream may still use it; active until completed).
    segments = [{"device": 0, "blocks": [{"size": 1000, "state": "active_allocated"},
                                         {"size": 50, "state": "active_allocated"},
                                         {"size": 40, "state": "active_pending_free"},
                                         {"size": 500, "state": "inactive"}]}]
    found = peak_owners({"device_traces": [trace], "segments": segments})
    assert found["before_bytes"] == 1020 and found["peak_bytes"] == 1200
    assert found["at"] == 3 and found["events"] == 9 and found["maker"] == "no Python frame"
    assert found["owners"] == [["models/llama/model.py:forward", 100], ["parallel/offload.py:_prefetch", 50],
                               ["no Python frame", 30]]
