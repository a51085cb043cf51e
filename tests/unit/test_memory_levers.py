"""The train loop in this process (no Ray): activation checkpointing modes against none (equal
losses, lower measured peak), memory snapshots, a simulated OOM, callbacks and on_leak = "stop"."""

from __future__ import annotations

import json

import pytest
import torch

from ray_titan.callbacks import Callback, InjectLeak, InjectOOM
from ray_titan.config import load_config, merge_overrides
from ray_titan.metrics.collector.collector import MetricsCollector
from ray_titan.metrics.collector.leak import leak_settings
from ray_titan.metrics.outcome import MemoryLeakError
from ray_titan.metrics.reading.steps import read_steps
from ray_titan.metrics.worker.memory import RankOutOfMemoryError
from ray_titan.metrics.worker.report import LocalReporter
from ray_titan.trainer import train_loop
from tests.conftest import REPO


def _train(tmp_path, corpus_cache, *overrides, callbacks=None):
    cfg = load_config(REPO / "configs" / "debug_llama.toml", merge_overrides([
        "--parallelism.pp=1", "--parallelism.dp_shard=1", "--training.steps=3",
        f"--data.cache_dir={corpus_cache}", "--training.threads_per_worker=1", "--memory.breakdown_step=0"],
        overrides))
    collector = MetricsCollector(str(tmp_path), 1, [0], cfg.training.steps, log_freq=1000,
                                 enable_tensorboard=False, leak=leak_settings(cfg.memory),
                                 on_leak=cfg.memory.on_leak)
    try:
        out = train_loop(cfg, LocalReporter(collector), torch.device("cpu"), tmp_path, callbacks)
    finally:
        summary = collector.finish()
    return out, summary, read_steps(tmp_path)


AC_MODES = {
    "full": ["--activation_checkpoint.mode=full"],
    "selective_op": ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_option=op"],
    "selective_layer": ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_option=layer",
                        "--activation_checkpoint.layer_freq=2"],
}


def _peak(out):
    (summary,) = [p for p in out["snapshots"] if p.endswith("-summary.json")]
    return json.loads(open(summary).read())["peak_bytes_by_category"]["total"]


@pytest.fixture(scope="module")
def no_ac(tmp_path_factory, corpus_cache):
    return _train(tmp_path_factory.mktemp("ac_none"), corpus_cache, "--memory.snapshot_steps=[2]")


@pytest.mark.parametrize("mode", list(AC_MODES))
def test_activation_checkpointing_keeps_losses_and_lowers_the_peak(no_ac, tmp_path, corpus_cache, mode):
    out, _, steps = _train(tmp_path, corpus_cache, "--memory.snapshot_steps=[2]", *AC_MODES[mode])
    ref_out, _, ref_steps = no_ac
    # fp32 on CPU: the recomputed forward is the same arithmetic, so the losses are identical.
    assert steps["step_loss"].to_pylist() == ref_steps["step_loss"].to_pylist()
    assert steps["grad_norm"].to_pylist() == ref_steps["grad_norm"].to_pylist()
    # The profiler's peak of all tensors alive during step 2 (parameters, gradients, optimizer
    # state and activations; only the activations differ between modes).
    peak, ref_peak = _peak(out), _peak(ref_out)
    print(f"AC {mode}: peak {peak / 2**20:.1f} MiB vs none {ref_peak / 2**20:.1f} MiB")
    assert peak < 0.9 * ref_peak


def test_snapshot_on_request_is_under_run_dir_memory(no_ac, tmp_path):
    out, _, _ = no_ac
    names = sorted(p.rsplit("/", 1)[1] for p in out["snapshots"])
    assert names == ["rank0-step2-summary.json", "rank0-step2.json.gz"]
    assert all("/memory/" in p for p in out["snapshots"])


def test_simulated_oom_leaves_a_snapshot_and_a_clear_error(tmp_path, corpus_cache):
    with pytest.raises(RankOutOfMemoryError) as info:
        _train(tmp_path, corpus_cache, callbacks=[InjectOOM(rank=0, step=2)])
    msg = str(info.value)
    assert msg.startswith("rank 0 (pp=0, dp_shard=0) ran out of memory at step 2: peak host RSS ")
    assert "simulated allocation failure" in msg
    snapshot = tmp_path / "memory" / "rank0-oom-step2.json"
    assert f"memory snapshot: {snapshot}" in msg
    data = json.loads(snapshot.read_text())
    assert data["live_tensors"]["bytes"] > 1 << 20  # parameters, gradients and optimizer state
    assert data["peak_host_rss_bytes"] > 50 << 20


class _Recorder(Callback):
    def __init__(self):
        self.events = []

    def on_train_start(self, ctx):
        self.events.append(("start", ctx.rank, ctx.world_size))

    def on_step_end(self, ctx, step, report):
        self.events.append(("step", step, report.loss is not None))

    def on_train_end(self, ctx, error=None):
        self.events.append(("end", error))


def test_callbacks_from_the_api_and_the_config_run_in_order(tmp_path, corpus_cache):
    rec = _Recorder()
    _train(tmp_path, corpus_cache, "--training.steps=2", callbacks=[rec])
    assert rec.events == [("start", 0, 1), ("step", 1, True), ("step", 2, True), ("end", None)]


def test_on_leak_stop_ends_the_run_naming_the_rank(tmp_path, corpus_cache):
    with pytest.raises(MemoryLeakError, match=r"rank 0 \(pp=0, dp_shard=0\): memory growing \+\d\.\d+ MiB/step"):
        _train(tmp_path, corpus_cache, "--training.steps=200", "--memory.on_leak=stop",
               "--memory.warmup_max_steps=30", callbacks=[InjectLeak(ranks=[0], mib_per_step=4.0)])
    steps = read_steps(tmp_path)
    assert steps.num_rows < 200 and steps["memory_verdict"].to_pylist()[-1] == "growing"


def test_cpu_offload_on_an_accelerator_materializes_fsdp_parameters_on_the_host_and_the_rest_on_the_device():
    """Issue 29: FSDP2's CPUOffloadPolicy refuses, at the first forward, sharded parameters that
    are not on the host. The meta device stands in for CUDA (any device but the CPU is one)."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from ray_titan.parallel.fsdp import fsdp_managed_names, materialize

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Linear(4, 4)
            self.experts = nn.Linear(4, 4, bias=False)  # left out of FSDP, as experts under EP alone
            self.register_buffer("rope", torch.zeros(8), persistent=False)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh, policy = init_device_mesh("cpu", (1,)), CPUOffloadPolicy(pin_memory=False)
        models = []
        for offload in (True, False):
            with torch.device("meta"):
                model = Stage()
            fully_shard(model.block, mesh=mesh, offload_policy=policy)
            fully_shard(model, mesh=mesh, offload_policy=policy, ignored_params=set(model.experts.parameters()))
            assert fsdp_managed_names(model) == {"block.weight", "block.bias"}
            materialize(model, torch.device("meta"), cpu_offload=offload)
            models.append(model)
    finally:
        dist.destroy_process_group()
    offloaded, plain = ({n: t.device.type for n, t in [*m.named_parameters(), *m.named_buffers()]} for m in models)
    assert offloaded == {"block.weight": "cpu", "block.bias": "cpu", "experts.weight": "meta", "rope": "meta"}
    assert set(plain.values()) == {"meta"}
