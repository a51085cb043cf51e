"""Activation offloading (``memory.activation_offload``) on the simulated GPU (``ray-titan
dry-run``): the offloaded blocks' saved tensors leave the device, and the plan follows. The hooks
themselves, parity, and the plan's lever: tests/unit/test_activation_offload.py."""

from __future__ import annotations

from tests.conftest import REPO

CONFIG = str(REPO / "configs" / "debug_llama.toml")
SMALL = ["--parallelism.pp=1", "--parallelism.dp_shard=2", "--parallelism.microbatches=1",
         "--training.global_batch_size=4", "--training.seq_len=256", "--training.mixed_precision=bf16"]


def test_the_dry_run_counts_less_device_memory_with_offloading_and_the_plan_follows():
    """The debug Llama (fsdp2, bf16, no AC) on the simulated GPU: offloading lowers the simulated
    peak (the blocks' saved tensors leave the fake device between forward and backward), and the
    plan's peak stays within 10 % of it."""
    from ray_titan.dry_run import dry_run

    (plain,) = dry_run(CONFIG, SMALL, steps=2)
    (moved,) = dry_run(CONFIG, [*SMALL, "--memory.activation_offload=all"], steps=2)
    print(f"simulated peak {plain.peak_device_bytes / 2**20:.2f} MiB -> {moved.peak_device_bytes / 2**20:.2f} MiB")
    assert moved.peak_device_bytes < 0.9 * plain.peak_device_bytes
    assert moved.plan_peak_bytes is not None
    assert abs(moved.plan_peak_bytes - moved.peak_device_bytes) <= 0.1 * moved.peak_device_bytes
