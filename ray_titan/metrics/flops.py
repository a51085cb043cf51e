"""Training FLOPs per token, MFU, and the peak FLOP/s MFU is measured against.

FLOPs per token: ``6·N + 12·L·H·Q·T`` (PaLM, Chowdhery et al. 2022, arXiv:2204.02311, Appendix B;
:func:`ray_titan.models.costs.transformer_flops_per_token`), each family's ``N`` and attention
width in its ``ray_titan/models/<family>/costs.py`` (:func:`model_flops_per_token` finds it).

MFU = achieved model FLOP/s ÷ peak FLOP/s of the hardware that ran it. GPUs: the datasheet's
dense (no sparsity) peak for the training dtype (:data:`GPU_PEAK_FLOPS`). CPUs have no useful
datasheet number, so :func:`measure_matmul_peak_flops` measures the best FLOP/s of a large
square matmul with the worker's thread count, which is the ceiling a transformer's matmuls can
reach on that machine.
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["GPU_PEAK_FLOPS", "gpu_peak_flops", "measure_matmul_peak_flops", "mfu", "model_flops_per_token"]

# Dense bf16 tensor-core peak, FLOP/s, from NVIDIA's datasheets (sparsity excluded).
GPU_PEAK_FLOPS: dict[str, float] = {
    "H200": 989.4e12,  # H200 SXM
    "H100 NVL": 835.5e12,
    "H100 PCIe": 756.5e12,
    "H100": 989.4e12,  # H100 SXM
    "A100": 312e12,
    "L40S": 362.05e12,
}


def model_flops_per_token(args: Any, seq_len: int) -> int:
    """Training FLOPs per token of the model with arguments ``args`` at ``seq_len``: its family's
    ``flops_per_token`` (``ray_titan/models/<family>/costs.py``, found by the arguments' class).
    Raises ``KeyError`` for arguments no family takes."""
    from ray_titan.models.registry import spec_for_args

    return spec_for_args(args).flops_per_token(args, seq_len)


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation, a fraction in [0, 1] for a sane measurement: ``tokens_per_s ×
    flops_per_token / peak_flops``. ``tokens_per_s`` and ``peak_flops`` must describe the same
    hardware (all devices of the job, or one device and its share of the tokens). Raises
    ``ValueError`` for a non-positive peak."""
    if peak_flops <= 0:
        raise ValueError(f"peak_flops = {peak_flops} must be > 0")
    return tokens_per_s * flops_per_token / peak_flops


def gpu_peak_flops(device_name: str) -> float | None:
    """Datasheet dense bf16 peak FLOP/s of the GPU named ``device_name`` (as
    ``torch.cuda.get_device_name`` gives it), ``None`` for an unknown GPU."""
    for key in sorted(GPU_PEAK_FLOPS, key=len, reverse=True):  # "H100 NVL" before "H100"
        if key in device_name:
            return GPU_PEAK_FLOPS[key]
    return None


def measure_matmul_peak_flops(
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    n: int = 1024,
    repeats: int = 10,
    threads: int | None = None,
) -> float:
    """Best achieved FLOP/s of an ``n × n`` by ``n × n`` matmul (``2·n³`` FLOPs) over
    ``repeats`` timed runs after one warm-up, on ``device`` in ``dtype``, with ``threads``
    intra-op threads (``torch.set_num_threads``, restored afterwards; default: unchanged).
    The maximum, not the mean, since the peak is a ceiling and noise only slows a run down."""
    device = torch.device(device)
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        best = float("inf")
        for i in range(repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            torch.mm(a, b)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:  # the first run is the warm-up
                best = min(best, time.perf_counter() - t0)
        return 2 * n**3 / best
    finally:
        torch.set_num_threads(old_threads)
