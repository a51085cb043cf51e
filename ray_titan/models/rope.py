"""Rotary position embeddings: the frequency table and its scaling variants.

One small pure function per rope-scaling kind, each returning ``(inv_freq, attention_factor)``
as Hugging Face transformers' ``modeling_rope_utils.py`` does, so a checkpoint's ``rope_scaling``
means here exactly what it means there:

- ``"default"``: RoFormer's frequencies ``θ^(-2i/d)`` (Su et al. 2021, arXiv:2104.09864).
- ``"llama3"``: Llama 3.1's scaling (Meta, ``llama-models`` ``apply_scaling``; Dubey et al. 2024,
  arXiv:2407.21783): wavelengths longer than ``original_max_position_embeddings /
  low_freq_factor`` are divided by ``factor``, shorter than ``... / high_freq_factor`` kept,
  and the band between interpolated smoothly.
- ``"yarn"``: YaRN (Peng et al. 2023, arXiv:2309.00071) as DeepSeek-V2's reference code
  (``DeepseekV2YarnRotaryEmbedding``) applies it: a linear ramp between interpolated and
  extrapolated frequencies over the dimensions whose rotation counts lie between ``beta_slow``
  and ``beta_fast`` at ``original_max_position_embeddings``; cos/sin scaled by
  ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``; with ``truncate`` false
  (gpt-oss) the correction range keeps its fractional bounds, as transformers'
  ``_compute_yarn_parameters`` does. DeepSeek also multiplies the
  attention softmax scale by ``mscale(factor, mscale_all_dim)²`` (:func:`softmax_scale_factor`).

The tables use Meta's interleaved-pair layout (:func:`ray_titan.models.decoder.apply_rope`);
the frequencies do not depend on the layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["RopeScaling", "inv_frequencies", "softmax_scale_factor", "yarn_mscale"]


@dataclass(frozen=True)
class RopeScaling:
    """A rope-scaling variant and its parameters, named as in a Hugging Face ``config.json``'s
    ``rope_scaling`` (``rope_parameters`` in transformers 5).

    ``kind``: ``"llama3"`` uses ``factor``, ``low_freq_factor``, ``high_freq_factor`` and
    ``original_max_position_embeddings``; ``"yarn"`` uses ``factor``,
    ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``, ``mscale`` and
    ``mscale_all_dim`` (0 = not given) and ``truncate``: whether the correction range's bounds are
    rounded to whole dimensions (floor / ceil, the YaRN paper's and DeepSeek's; transformers'
    default) or kept fractional (gpt-oss's ``"truncate": false``).
    """

    kind: Literal["llama3", "yarn"]
    factor: float
    original_max_position_embeddings: int
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True


def _default(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def _llama3(head_dim: int, theta: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    inv_freq = _default(head_dim, theta)
    old_len = s.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_len / s.low_freq_factor, old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 · mscale · ln(factor) + 1`` (1 for ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(head_dim: int, theta: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    def correction_dim(rotations: float) -> float:
        positions = s.original_max_position_embeddings
        return head_dim * math.log(positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    # transformers' _compute_yarn_parameters (find_correction_range): rounded unless truncate is false.
    low: float = correction_dim(s.beta_fast)
    high: float = correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    inv_freq = interpolated * (1 - keep) + extrapolated * keep
    if s.mscale and s.mscale_all_dim:
        attention_factor = yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(s.factor)
    return inv_freq, attention_factor


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """``(inv_freq (head_dim // 2,) fp32, attention_factor)``: the rotary frequencies of a head of
    ``head_dim`` rotated dimensions with base ``theta``, and the factor cos and sin are multiplied
    by (1 except for YaRN). Raises ``ValueError`` for an unknown ``scaling.kind``."""
    if scaling is None:
        return _default(head_dim, theta), 1.0
    if scaling.kind == "llama3":
        return _llama3(head_dim, theta, scaling)
    if scaling.kind == "yarn":
        return _yarn(head_dim, theta, scaling)
    raise ValueError(f"rope scaling {scaling.kind!r} is unknown; valid: 'llama3', 'yarn'")


def softmax_scale_factor(scaling: RopeScaling | None) -> float:
    """What DeepSeek's attention multiplies its softmax scale ``1/sqrt(qk_head_dim)`` by: under
    YaRN with ``mscale_all_dim``, ``yarn_mscale(factor, mscale_all_dim)²`` (DeepSeek-V2's
    ``DeepseekV2Attention``; V2-Lite: ×1.59); otherwise 1."""
    if scaling is None or scaling.kind != "yarn" or not scaling.mscale_all_dim:
        return 1.0
    return yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2
