"""The model registry: a family name maps to everything the trainer needs of it.

A :class:`ModelSpec` (the role of torchtitan's train spec) holds a family's model class, its
flavors (sizes), its ``parallelize`` step and how the job's ``[model]`` settings become model
arguments. The trainer reaches a family only through its spec, so it never branches on a
family's name; adding a family is adding a package under ``ray_titan/models/`` (its model, flavors,
``parallelize``, state-dict adapter and ``costs.py``: FLOPs and activation memory) and one entry in
:data:`MODELS`.

Flavors: ``debug`` is tiny and CPU-friendly in each family; ``llama/3-8B`` (also ``8B``),
``3.1-8B``, ``3.1-70B``, ``3.2-1B`` and ``3.2-3B`` have the dimensions of Meta's Llama 3.x
models, ``qwen3/0.6B`` ... ``8B`` those of Qwen3 dense, ``deepseek_v2/V2-Lite`` those of
DeepSeek-V2-Lite (15.7 B total, 2.4 B activated), its YaRN rope included, ``deepseek_v2/V2``
those of DeepSeek-V2 (236 B, 21 B; group-limited routing), and ``qwen3_moe/30B-A3B`` and
``235B-A22B`` those of Qwen3-MoE (30.5 B / 3.3 B and 235 B / 22 B), ``gpt_oss/20B`` and
``120B`` those of gpt-oss (21 B / 3.6 B and 117 B / 5.1 B). Every flavor is
constructible on the meta device. Each family's ``hf`` adapter maps it to and from Hugging
Face checkpoints (``ray_titan.models.state_dict_adapter``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ray_titan.config.schema import JobConfig, Model
from ray_titan.models import deepseek_v2, deepseek_v3, gpt_oss, llama, qwen3, qwen3_moe
from ray_titan.models.costs import BlockActivations
from ray_titan.models.decoder import Decoder
from ray_titan.models.deepseek_v2.costs import deepseek_block_activations, deepseek_flops_per_token
from ray_titan.models.deepseek_v2.state_dict_adapter import DeepSeekV2Adapter
from ray_titan.models.gpt_oss.costs import gpt_oss_block_activations, gpt_oss_flops_per_token
from ray_titan.models.llama.costs import llama_block_activations, llama_flops_per_token
from ray_titan.models.llama.state_dict_adapter import LlamaAdapter
from ray_titan.models.qwen3.state_dict_adapter import Qwen3Adapter
from ray_titan.models.qwen3_moe.costs import qwen3_moe_block_activations, qwen3_moe_flops_per_token
from ray_titan.models.state_dict_adapter import StateDictAdapter
from ray_titan.parallel.dims import Meshes, ParallelDims

__all__ = ["MODELS", "ModelSpec", "build_model", "get_model_args", "get_spec", "is_moe", "spec_for_args", "spec_for_hf"]

Parallelize = Callable[[nn.Module, ParallelDims, "Meshes | None", JobConfig], None]
FlopsPerToken = Callable[[Any, int], int]
BlockFormula = Callable[[Any, int, int, int, str, float, int], BlockActivations]


@dataclass(frozen=True)
class ModelSpec:
    """A model family's parts.

    ``model_cls`` builds the whole model from an arguments dataclass; ``flavors`` maps a flavor
    name to its arguments; ``parallelize(stage, dims, meshes, cfg)`` applies the family's
    parallelisms to one pipeline stage module in the fixed order (TP → EP → AC → compile →
    FSDP); ``config_args(cfg.model)`` gives the argument fields the job's ``[model]`` settings
    override (e.g. MoE load balancing); ``moe``: whether it has mixture-of-experts layers;
    ``hf``: its Hugging Face state-dict adapter (``config.json`` ``model_type`` and tensor names);
    ``flops_per_token(args, seq_len)``: training FLOPs per token (MFU's numerator);
    ``block_activations(args, layer, e, seq_len, device, routing_imbalance, ep)``: the bytes per
    token block ``layer`` saves for backward (the memory plan's;
    :class:`~ray_titan.models.costs.BlockActivations`). Both live in the family's ``costs.py``.
    """

    name: str
    model_cls: type[Decoder]
    flavors: dict[str, Any]
    parallelize: Parallelize
    hf: StateDictAdapter
    flops_per_token: FlopsPerToken
    block_activations: BlockFormula
    config_args: Callable[[Model], dict[str, Any]] = lambda m: {}
    moe: bool = False


def _moe_args(m: Model) -> dict[str, Any]:
    # load_balance unset: the flavor's (or the checkpoint family's) own.
    lb = {"load_balance": m.load_balance} if m.load_balance is not None else {}
    return {**lb, "aux_loss_coeff": m.aux_loss_coeff, "bias_update_rate": m.bias_update_rate}


MODELS: dict[str, ModelSpec] = {
    "llama": ModelSpec("llama", llama.Llama, llama.FLAVORS, llama.parallelize_llama, LlamaAdapter(),
                       llama_flops_per_token, llama_block_activations),
    # Qwen3 dense is a Llama with per-head q/k RMSNorm (its flavors set qk_norm).
    "qwen3": ModelSpec("qwen3", llama.Llama, qwen3.FLAVORS, llama.parallelize_llama, Qwen3Adapter(),
                       llama_flops_per_token, llama_block_activations),
    "deepseek_v2": ModelSpec(
        "deepseek_v2", deepseek_v2.DeepSeekV2, deepseek_v2.FLAVORS, deepseek_v2.parallelize_deepseek_v2,
        DeepSeekV2Adapter(), deepseek_flops_per_token, deepseek_block_activations, config_args=_moe_args, moe=True,
    ),
    # DeepSeek-V3 and Kimi K2: DeepSeek-V2's model with V3's router (its flavors set it).
    "deepseek_v3": ModelSpec(
        "deepseek_v3", deepseek_v2.DeepSeekV2, deepseek_v3.FLAVORS, deepseek_v2.parallelize_deepseek_v2,
        deepseek_v3.DeepSeekV3Adapter(), deepseek_flops_per_token, deepseek_block_activations,
        config_args=_moe_args, moe=True,
    ),
    # Qwen3-MoE: Qwen3's attention with DeepSeek-V2's MoE layer (greedy normalised top-k, no
    # shared expert) and the reference's balance loss pooled over layers.
    "qwen3_moe": ModelSpec(
        "qwen3_moe", qwen3_moe.Qwen3Moe, qwen3_moe.FLAVORS, qwen3_moe.parallelize_qwen3_moe,
        qwen3_moe.Qwen3MoeAdapter(), qwen3_moe_flops_per_token, qwen3_moe_block_activations,
        config_args=_moe_args, moe=True,
    ),
    # gpt-oss: attention with sinks and alternating sliding windows, DeepSeek-V2's MoE layer with
    # a biased top-k-softmax router and clamped-SwiGLU experts with biases; no tensor parallel.
    "gpt_oss": ModelSpec(
        "gpt_oss", gpt_oss.GptOss, gpt_oss.FLAVORS, gpt_oss.parallelize_gpt_oss, gpt_oss.GptOssAdapter(),
        gpt_oss_flops_per_token, gpt_oss_block_activations, config_args=_moe_args, moe=True,
    ),
}


def get_spec(name: str) -> ModelSpec:
    """The family ``name``'s spec. Raises ``KeyError`` naming the valid families."""
    if name not in MODELS:
        raise KeyError(f"model.name = {name!r} is unknown; valid: {sorted(MODELS)}")
    return MODELS[name]


def spec_for_hf(model_type: str) -> ModelSpec:
    """The family whose Hugging Face ``config.json`` has ``model_type`` (its adapter's own or one
    of its ``model_type_aliases``). Raises ``KeyError`` listing the supported ones."""
    for spec in MODELS.values():
        if model_type == spec.hf.model_type or model_type in spec.hf.model_type_aliases:
            return spec
    supported = sorted(t for s in MODELS.values() for t in (s.hf.model_type, *s.hf.model_type_aliases))
    raise KeyError(f"model_type {model_type!r} is not supported; supported: {supported}")


def spec_for_args(args: Any) -> ModelSpec:
    """The first family whose flavors' arguments are of ``args``'s class (Llama and Qwen3 share
    ``LlamaArgs``, and their formulas). Raises ``KeyError`` naming the class."""
    for spec in MODELS.values():
        if any(type(a) is type(args) for a in spec.flavors.values()):
            return spec
    raise KeyError(f"no model family takes arguments of type {type(args).__name__}")


def is_moe(name: str) -> bool:
    """Whether the family has mixture-of-experts layers."""
    return get_spec(name).moe


def get_model_args(name: str, flavor: str) -> Any:
    """The arguments of ``name``/``flavor``. Raises ``KeyError`` naming the valid choices."""
    flavors = get_spec(name).flavors
    if flavor not in flavors:
        raise KeyError(f"model.flavor = {flavor!r} is unknown for model {name!r}; valid: {sorted(flavors)}")
    return flavors[flavor]


def build_model(name: str, flavor: str, vocab_size: int | None = None, *, args: Any = None,
                **overrides: Any) -> Decoder:
    """Construct the whole model (on the current default device; use ``torch.device("meta")``
    as a context to allocate nothing). ``args``: the model arguments, instead of the flavor's
    (a Hugging Face checkpoint's). ``vocab_size`` overrides the flavor's, to match the
    tokenizer; ``overrides`` replace other fields of the arguments (e.g. the MoE
    ``load_balance``). Raises ``KeyError`` for an unknown family or flavor."""
    args = args if args is not None else get_model_args(name, flavor)
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    if overrides:
        args = dataclasses.replace(args, **overrides)
    return get_spec(name).model_cls(args)
