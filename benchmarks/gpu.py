"""The GPU acceptance run (``python -m benchmarks.run gpu``) on one CUDA GPU: throughput rows
beside torchtitan's, then the correctness checks only a GPU can make (``benchmarks/gpu_checks.py``).

Throughput: the main job's model (the debug Llama, 64 × 512 tokens per step) and Llama 3.2 1B
(flavor ``3.2-1B``: dim 2048, 16 layers, 32 heads, 8 KV heads, SwiGLU hidden 8192; 0.97 B
non-embedding parameters with the byte vocabulary; 4 × 2048 tokens per step), one rank,
``training.mixed_precision = "bf16"`` (one rank, no FSDP: ``torch.autocast``, fp32 weights and
optimizer state, bf16 matmuls), the train loop without Ray. Each model eager against torchtitan
0.3.0 at the same shape, batch, sequence length and dtype (its single-device bf16 is autocast
too: ``mixed_precision_param``), alternately, and with ``training.compile = true``. Tokens/s over
the steps after warm-up; MFU by the PaLM formula (``ray_titan.metrics.flops``) against the GPU's
datasheet dense bf16 peak, or the measured bf16 matmul peak for a GPU not in
``ray_titan.metrics.flops.GPU_PEAK_FLOPS``; the peak memory the caching allocator reserved.
ray_titan's 3.2-1B ties its embeddings and scales its rotary frequencies, torchtitan's model here
does neither: the same FLOPs per token, 0.5 M more parameters on torchtitan's side.
"""

from __future__ import annotations

from typing import Any

import pyarrow.compute as pc

from benchmarks.gpu_checks import Check, run_checks, train_here
from benchmarks.stats import Row, alternate, fmt_si, ratio_stats

__all__ = ["MODELS", "check_rows", "gpu_rows", "throughput_rows"]

MiB = 2**20
MODELS = (("the main job's model (debug Llama)", "debug", 64, 512),
          ("Llama 3.2 1B shape", "3.2-1B", 4, 2048))
"""(label, Llama flavor, sequences per step, sequence length) of the throughput rows."""


def _peak(device) -> tuple[float, str]:
    """The bf16 peak FLOP/s MFU is measured against, and where it comes from."""
    import torch

    from ray_titan.metrics.flops import gpu_peak_flops, measure_matmul_peak_flops

    peak = gpu_peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    if peak is not None:
        return peak, "datasheet bf16 dense"
    n = 8192 if device.type == "cuda" else 512  # a CPU (the suite's check of this code) is slow at bf16
    return measure_matmul_peak_flops(device, torch.bfloat16, n=n, repeats=5), "measured bf16 matmul"


def _ours(cfg, device) -> dict[str, Any]:
    """One ray_titan run of ``cfg`` in this process: tokens/s, peak reserved bytes, last loss."""
    from benchmarks.run import tokens_per_s

    run = train_here(cfg, device)
    reserved = run["steps"]["device_peak_reserved_bytes"]
    return {"tokens_per_s": tokens_per_s(cfg, [run["summary"]]), "last_loss": run["summary"]["last_loss"],
            "peak_reserved_bytes": pc.max(reserved).as_py() if reserved.null_count < len(reserved) else None}


def _mfu_text(tps: float, fpt: int, peak: float) -> str:
    return f"{fmt_si(tps, 'tok/s')} (MFU {100 * tps * fpt / peak:.1f}%)"


def throughput_rows(bench, device, models=MODELS, compile: bool = True) -> list[Row]:
    """Per model: ray_titan eager vs torchtitan 0.3.0 (alternately, ``bench.repeats`` pairs, the
    ratio of tokens/s), and with ``compile`` ray_titan with ``training.compile = true`` (one run).
    ``device``: a ``torch.device`` (CUDA; CPU only to try this code, with torchtitan's CPU shims)."""
    from benchmarks.run import flops_per_token, run_torchtitan

    peak, source = _peak(device)
    rows = []
    for label, flavor, batch, seq in models:
        flags = (f"--model.flavor={flavor}", "--parallelism.pp=1", "--parallelism.dp_shard=1",
                 "--parallelism.microbatches=1", f"--training.global_batch_size={batch}",
                 f"--training.seq_len={seq}", "--training.mixed_precision=bf16", "--metrics.enable_tensorboard=false",
                 "--checkpoint.enable=false")
        cfg = bench.job("gpu", *flags)
        fpt = flops_per_token(cfg)
        try:
            a, b = alternate(lambda cfg=cfg: _ours(cfg, device),
                             lambda cfg=cfg: run_torchtitan(bench, cfg, device.type), bench.repeats)
            st = ratio_stats([x["tokens_per_s"] for x in a], [x["tokens_per_s"] for x in b])
            rows.append(Row(f"GPU, {label}, bf16, eager, vs torchtitan 0.3.0", "ray_titan (no Ray)",
                            _mfu_text(st.median_a, fpt, peak), "torchtitan Trainer (torchrun)",
                            _mfu_text(st.median_b, fpt, peak), st, "A/B ≥ 1.0",
                            f"{batch} × {seq} tokens per step, {bench.steps('gpu')} steps; peak "
                            f"{fmt_si(peak, 'FLOP/s')} ({source}); ray_titan peak reserved "
                            f"{_mib(a[0]['peak_reserved_bytes'])}",
                            data={"a": a, "b": b, "stats": st.as_dict(), "flops_per_token": fpt, "peak_flops": peak}))
        except Exception as e:  # e.g. out of memory on a small GPU: say so, keep the other rows
            rows.append(Row(f"GPU, {label}, bf16, eager, vs torchtitan 0.3.0", "failed", _why(e)))
        if not compile:
            continue
        try:
            c = _ours(bench.job("gpu", *flags, "--training.compile=true"), device)
            rows.append(Row(f"GPU, {label}, bf16, training.compile = true", "ray_titan (no Ray)",
                            _mfu_text(c["tokens_per_s"], fpt, peak),
                            note=f"one run; peak reserved {_mib(c['peak_reserved_bytes'])}", data=c))
        except Exception as e:
            rows.append(Row(f"GPU, {label}, bf16, training.compile = true", "failed", _why(e)))
    return rows


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / MiB:.0f} MiB"


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


def check_rows(checks: list[Check]) -> list[Row]:
    """One table row per check: PASS or FAIL and its reason."""
    return [Row(f"GPU check: {c.name}", "PASS" if c.passed else "FAIL", c.reason, data={"passed": c.passed, **c.data})
            for c in checks]


def gpu_rows(bench) -> list[Row]:
    """The whole acceptance run on CUDA device 0: throughput rows, then one row per check."""
    import torch

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    steps = 40 if bench.quick else 200  # the long run's steps (--quick: checks the runner, not the GPU)
    return throughput_rows(bench, device) + check_rows(run_checks(bench.work / "checks", "cuda", steps=steps))
