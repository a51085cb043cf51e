"""GPU rows of the benchmark: the train loop without Ray on one CUDA GPU (``python -m
benchmarks.run gpu``).

Two jobs, each one process, one rank, in this process: the debug Llama in fp32, and a ~1 B
Llama with the shape of Llama 3.2 1B (dim 2048, 16 layers, 32 heads, 8 KV heads, SwiGLU hidden
8192; 0.97 B non-embedding parameters with the byte vocabulary) with ``training.mixed_precision =
"bf16"`` (one rank, no FSDP: ``torch.autocast``; fp32 weights and optimizer state, bf16 matmuls).
Reports tokens/s, MFU against the GPU's datasheet dense bf16 peak (or the measured bf16 matmul peak for a GPU not in
``ray_titan.metrics.flops.GPU_PEAK_FLOPS``), and the peak memory the caching allocator reserved.
"""

from __future__ import annotations

import dataclasses

import pyarrow.compute as pc

from benchmarks.stats import Row, fmt_si

__all__ = ["LLAMA_1B", "gpu_rows"]

MiB = 2**20


def _llama_1b():
    from ray_titan.models.llama import LlamaArgs

    # Llama 3.2 1B (huggingface.co/meta-llama/Llama-3.2-1B, config.json).
    return LlamaArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128_256,
                     multiple_of=256, ffn_dim_multiplier=1.5, rope_theta=500_000.0, max_seq_len=8192)


LLAMA_1B = "bench_1B"


def _run(bench, flavor: str, batch: int, seq_len: int, bf16: bool, device=None) -> dict:
    import torch

    from ray_titan.metrics.collector import MetricsCollector
    from ray_titan.metrics.flops import gpu_peak_flops, measure_matmul_peak_flops
    from ray_titan.metrics.report import LocalReporter
    from ray_titan.metrics.sinks import read_steps
    from ray_titan.models.llama.costs import llama_flops_per_token
    from ray_titan.models.registry import get_model_args
    from ray_titan.preflight import validate_job
    from ray_titan.run_dir import make_run_dir
    from ray_titan.trainer import train_loop

    steps = bench.steps("gpu")
    cfg = bench.job("gpu", f"--model.flavor={flavor}", "--parallelism.pp=1", "--parallelism.dp_shard=1",
                    "--parallelism.microbatches=1", f"--training.global_batch_size={batch}",
                    f"--training.seq_len={seq_len}", f"--training.steps={steps}",
                    "--metrics.enable_tensorboard=false", f"--training.mixed_precision={'bf16' if bf16 else 'fp32'}")
    validate_job(cfg)
    run_dir = make_run_dir(cfg)
    collector = MetricsCollector(str(run_dir), 1, [0], steps, 10**9, 20, False)
    device = device or torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    summary = train_loop(cfg, LocalReporter(collector), device)
    collector.finish()
    rows = read_steps(run_dir)
    peak_reserved = pc.max(rows["device_peak_reserved_bytes"]).as_py()
    tps = batch * seq_len * summary["steady_steps"] / summary["steady_time_s"]
    args = dataclasses.replace(get_model_args("llama", flavor), vocab_size=258)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    peak = gpu_peak_flops(name) if bf16 else None
    peak_src = "datasheet bf16 dense"
    if peak is None:
        dtype = torch.bfloat16 if bf16 else torch.float32
        peak = measure_matmul_peak_flops(device, dtype, n=8192, repeats=5)
        peak_src = f"measured {str(dtype).split('.')[-1]} matmul"
    mfu = tps * llama_flops_per_token(args, seq_len) / peak
    return {"gpu": name, "tokens_per_s": tps, "mfu": mfu, "peak_flops": peak, "peak_source": peak_src,
            "peak_reserved_bytes": peak_reserved, "final_loss": summary["last_loss"], "steps": steps}


def gpu_rows(bench) -> list[Row]:
    """Rows for the debug model (fp32, 64 × 512 tokens per step) and the ~1 B model (bf16,
    4 × 2048 tokens per step) on CUDA device 0."""
    from ray_titan.models.registry import MODELS

    MODELS["llama"].flavors.setdefault(LLAMA_1B, _llama_1b())  # a benchmark-only flavor, this process only
    out = []
    for label, flavor, batch, seq, bf16 in (("debug Llama, fp32", "debug", 64, 512, False),
                                            ("~1 B Llama (Llama 3.2 1B shape), bf16", LLAMA_1B, 4, 2048,
                                             True)):
        try:
            r = _run(bench, flavor, batch, seq, bf16)
        except Exception as e:  # e.g. out of memory on a small GPU: say so, keep the other row
            out.append(Row(f"GPU: {label}", "failed", f"{type(e).__name__}: {str(e)[:200]}"))
            continue
        out.append(Row(
            f"GPU ({r['gpu']}): {label}, train loop without Ray", "tokens/s, MFU, peak reserved",
            f"{fmt_si(r['tokens_per_s'], 'tok/s')}, MFU {100 * r['mfu']:.1f}% "
            f"(peak {fmt_si(r['peak_flops'], 'FLOP/s')}, "
            f"{r['peak_source']}), {r['peak_reserved_bytes'] / MiB:.0f} MiB",
            note=f"{batch} × {seq} tokens per step, {r['steps']} steps", data=r,
        ))
    return out
