"""Training FLOPs per token, MFU, and the peak FLOP/s MFU is measured against.

Formula (PaLM, Chowdhery et al. 2022, arXiv:2204.02311, Appendix B), per token of a training
step (forward + backward):

    flops_per_token = 6 · N + 12 · L · H · Q · T

- ``6 · N``: every weight matrix of ``N`` parameters costs 2 FLOPs per parameter per token in
  the forward pass (one multiply, one add) and 4 in the backward pass (gradients of the input
  and of the weight). ``N`` is the number of *non-embedding* parameters: the token-embedding
  lookup is a gather, not a matmul, so it is excluded, while the output head (a matmul) is
  included. For a mixture-of-experts model ``N`` is the *activated* non-embedding parameters:
  the shared parameters plus the ``top_k`` routed experts a token visits (plus shared experts),
  not all experts.
- ``12 · L · H · Q · T``: the two attention matmuls (``Q·Kᵀ`` and ``scores·V``) of each of ``L``
  layers, ``H`` heads of dimension ``Q`` over a context of ``T`` tokens: 2 FLOPs × 2 matmuls ×
  3 (forward + backward). ``H · Q`` is the attention width. Where queries/keys and values have
  different head dimensions (DeepSeek-V2's multi-head latent attention: 192 and 128), the two
  matmuls cost ``6 · L · H · (d_qk + d_v) · T``, so pass ``H · (d_qk + d_v) / 2``. By convention the causal mask's
  half-empty score matrix is not discounted and activation recomputation is not counted, so MFU
  stays comparable across trainers (torchtitan and the PaLM paper count the same way).

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

__all__ = [
    "GPU_PEAK_FLOPS",
    "deepseek_flops_per_token",
    "gpt_oss_flops_per_token",
    "gpu_peak_flops",
    "llama_flops_per_token",
    "llama_non_embedding_params",
    "measure_matmul_peak_flops",
    "mfu",
    "model_flops_per_token",
    "qwen3_moe_flops_per_token",
    "transformer_flops_per_token",
]

# Dense bf16 tensor-core peak, FLOP/s, from NVIDIA's datasheets (sparsity excluded).
GPU_PEAK_FLOPS: dict[str, float] = {
    "H200": 989.4e12,  # H200 SXM
    "H100 NVL": 835.5e12,
    "H100 PCIe": 756.5e12,
    "H100": 989.4e12,  # H100 SXM
    "A100": 312e12,
    "L40S": 362.05e12,
}


def transformer_flops_per_token(
    non_embedding_params: int, n_layers: int, attention_dim: int, seq_len: int
) -> int:
    """Training FLOPs per token, ``6·N + 12·L·(H·Q)·T`` (PaLM, Appendix B; module docstring).

    ``non_embedding_params`` (N): parameters that take part in matmuls for one token, i.e. all
    parameters minus the token embedding; for MoE the *activated* ones (shared + ``top_k``
    routed + shared experts). ``attention_dim``: heads × head dimension (``H·Q``), or
    ``H·(d_qk + d_v)/2`` when query/key and value head dimensions differ (MLA). ``seq_len`` (T):
    tokens of context each token attends over. Raises ``ValueError`` for a negative argument.
    """
    args = dict(non_embedding_params=non_embedding_params, n_layers=n_layers,
                attention_dim=attention_dim, seq_len=seq_len)
    for name, value in args.items():
        if value < 0:
            raise ValueError(f"{name} = {value} must be >= 0")
    return 6 * non_embedding_params + 12 * n_layers * attention_dim * seq_len


def llama_non_embedding_params(args: Any) -> int:
    """Parameters of a :class:`ray_titan.models.llama.args.LlamaArgs` model minus its token embedding
    (attention, SwiGLU feed-forward, RMSNorm weights, final norm, untied output head), counted
    from the arguments alone."""
    hd, d = args.head_dim, args.dim
    attention = d * args.n_heads * hd * 2 + d * args.n_kv_heads * hd * 2  # wq, wo; wk, wv
    ffn = 3 * d * args.ffn_hidden_dim  # w1, w2, w3
    per_layer = attention + ffn + 2 * d  # two RMSNorms
    return args.n_layers * per_layer + d + d * args.vocab_size  # final norm, output head


def llama_flops_per_token(args: Any, seq_len: int) -> int:
    """Training FLOPs per token of a dense Llama (:class:`~ray_titan.models.llama.args.LlamaArgs`)
    at sequence length ``seq_len``: :func:`transformer_flops_per_token` with
    N = :func:`llama_non_embedding_params`, L = ``n_layers``, H·Q = ``n_heads × head_dim``."""
    return transformer_flops_per_token(
        llama_non_embedding_params(args), args.n_layers, args.n_heads * args.head_dim, seq_len
    )


def deepseek_flops_per_token(args: Any, seq_len: int) -> int:
    """Training FLOPs per token of a DeepSeek-V2-style MoE
    (:class:`~ray_titan.models.deepseek_v2.args.DeepSeekV2Args`) at ``seq_len``:
    :func:`transformer_flops_per_token` with N = the *activated* non-embedding parameters
    (:func:`ray_titan.models.deepseek_v2.model.activated_parameters`, counted on the meta device: shared
    parameters, the shared experts and ``top_k`` of the routed experts), L = ``n_layers`` and the
    MLA attention width ``H·(d_qk + d_v)/2``."""
    import torch

    from ray_titan.models.deepseek_v2.model import DeepSeekV2, activated_parameters

    with torch.device("meta"):
        n = activated_parameters(DeepSeekV2(args))
    width = args.n_heads * (args.qk_head_dim + args.v_head_dim) // 2
    return transformer_flops_per_token(n, args.n_layers, width, seq_len)


def qwen3_moe_flops_per_token(args: Any, seq_len: int) -> int:
    """Training FLOPs per token of a Qwen3-MoE model
    (:class:`~ray_titan.models.qwen3_moe.args.Qwen3MoeArgs`) at ``seq_len``:
    :func:`transformer_flops_per_token` with N = the activated non-embedding parameters (DeepSeek's
    count, :func:`ray_titan.models.deepseek_v2.model.activated_parameters`, on the meta device:
    attention, dense layers, routers and ``top_k`` of the routed experts, output head),
    L = ``n_layers`` and H·Q = ``n_heads × head_dim``."""
    import torch

    from ray_titan.models.deepseek_v2.model import activated_parameters
    from ray_titan.models.qwen3_moe.model import Qwen3Moe

    with torch.device("meta"):
        n = activated_parameters(Qwen3Moe(args))
    return transformer_flops_per_token(n, args.n_layers, args.n_heads * args.head_dim, seq_len)


def gpt_oss_flops_per_token(args: Any, seq_len: int) -> int:
    """Training FLOPs per token of a gpt-oss model (:class:`~ray_titan.models.gpt_oss.args.GptOssArgs`)
    at ``seq_len``: ``6·N`` with N its activated non-embedding parameters
    (:func:`ray_titan.models.gpt_oss.activated_parameters`, on the meta device), plus
    ``12·(H·Q)·T`` for each full-attention layer and ``12·(H·Q)·min(T, sliding_window)`` for
    each sliding-window one (its queries see at most the window; the sink column is negligible)."""
    import torch

    from ray_titan.models.gpt_oss.model import GptOss, activated_parameters

    with torch.device("meta"):
        n = activated_parameters(GptOss(args))
    context = sum(min(seq_len, args.sliding_window) if args.is_sliding(i) else seq_len for i in range(args.n_layers))
    return transformer_flops_per_token(n, 0, 0, seq_len) + 12 * args.n_heads * args.head_dim * context


def model_flops_per_token(args: Any, seq_len: int) -> int:
    """:func:`deepseek_flops_per_token` for DeepSeek MoE model arguments (MLA's ``kv_lora_rank``),
    :func:`gpt_oss_flops_per_token` for gpt-oss's (``sliding_window``), :func:`qwen3_moe_flops_per_token`
    for Qwen3-MoE's, :func:`llama_flops_per_token` for dense ones."""
    if hasattr(args, "n_routed_experts"):
        if hasattr(args, "kv_lora_rank"):
            return deepseek_flops_per_token(args, seq_len)
        if hasattr(args, "sliding_window"):
            return gpt_oss_flops_per_token(args, seq_len)
        return qwen3_moe_flops_per_token(args, seq_len)
    return llama_flops_per_token(args, seq_len)


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
