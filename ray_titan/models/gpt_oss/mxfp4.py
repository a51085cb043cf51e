"""MXFP4 expert weights as gpt-oss's released checkpoints store them, dequantised on import.

The OCP Microscaling format (MX v1.0, "OCP Microscaling Formats (MX) Specification", 2023): blocks
of 32 FP4 (E2M1) values sharing one E8M0 scale (a power of two, exponent bias 127). In the
released ``openai/gpt-oss-20b`` / ``-120b`` files (``quantization_config.quant_method =
"mxfp4"``) an expert tensor ``P`` of Hugging Face shape ``(experts, in, out)`` is stored as
``P_blocks (experts, out, in / 32, 16)`` uint8 (two FP4 codes per byte, the low nibble first) and
``P_scales (experts, out, in / 32)`` uint8. :func:`dequantize_mxfp4` is transformers'
``integrations/mxfp4.py`` ``convert_moe_packed_tensors``: the FP4 lookup table, ``ldexp`` by
``scale - 127``, and the transpose of the last two dims back to ``(experts, in, out)``. Every
FP4 value times a power of two is exact in fp32 and bf16, so the result does not depend on the
dtype it is computed in (transformers uses the parameter's).
"""

from __future__ import annotations

import torch

__all__ = ["FP4_VALUES", "SCALE_BIAS", "dequantize_mxfp4", "packed_shapes"]

FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""E2M1 code (4 bits: sign, 2 exponent bits, 1 mantissa bit) -> value (MX spec, table of FP4)."""

SCALE_BIAS = 127
"""E8M0 exponent bias: a scale byte ``s`` means ``2 ** (s - 127)``."""


def packed_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The ``(blocks, scales)`` shapes that hold a tensor of Hugging Face shape ``(experts, in,
    out)``, or None when ``in`` is not a multiple of 32 (not MXFP4-packable)."""
    if len(shape) != 3 or shape[1] % 32:
        return None
    e, n_in, n_out = shape
    return (e, n_out, n_in // 32, 16), (e, n_out, n_in // 32)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``blocks (experts, out, groups, 16)`` uint8 and ``scales (experts, out, groups)`` uint8
    to ``(experts, groups · 32, out)`` of ``dtype``: each byte's low nibble is the even value
    and its high nibble the odd one, both looked up in :data:`FP4_VALUES` and multiplied by
    ``2 ** (scale - 127)``. Raises ``ValueError`` when the shapes do not match."""
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match; valid: "
                         "blocks (experts, out, groups, 16) and scales (experts, out, groups)")
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    blocks = blocks.to(torch.uint8)
    exp = scales.to(torch.int32) - SCALE_BIAS
    out = torch.empty(*blocks.shape[:-1], 32, dtype=dtype)
    out[..., 0::2] = lut[(blocks & 0x0F).long()]
    out[..., 1::2] = lut[(blocks >> 4).long()]
    out = torch.ldexp(out, exp.unsqueeze(-1)).to(dtype)
    e, n_out, groups = scales.shape
    return out.reshape(e, n_out, groups * 32).transpose(1, 2).contiguous()
