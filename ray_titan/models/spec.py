"""What a model family gives the trainer: its :class:`ModelSpec` (the role of torchtitan's train
spec). Each family builds its own in its package's ``__init__.py`` (``SPEC``);
``ray_titan.models.registry`` collects them. How to add a family: ``ray_titan.models``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ray_titan.config.schema import JobConfig, Model
from ray_titan.models.costs import BlockActivations
from ray_titan.models.decoder import Decoder
from ray_titan.models.state_dict_adapter import StateDictAdapter
from ray_titan.parallel.dims import Meshes, ParallelDims

__all__ = ["BlockFormula", "FlopsPerToken", "ModelSpec", "Parallelize", "moe_config_args", "mtp_config_args",
           "mtp_moe_config_args"]

Parallelize = Callable[[nn.Module, ParallelDims, "Meshes | None", JobConfig], None]
FlopsPerToken = Callable[[Any, int], int]
BlockFormula = Callable[[Any, int, int, int, str, float, int], BlockActivations]


@dataclass(frozen=True)
class ModelSpec:
    """A model family's parts.

    ``name``: the family's name (``model.name``), which is its package's
    (``ray_titan/models/<name>/``); ``model_cls`` builds the whole model from an arguments
    dataclass; ``flavors`` maps a flavor name to its arguments; ``parallelize(stage, dims, meshes,
    cfg)`` applies the family's parallelisms to one pipeline stage module in the fixed order (TP →
    EP → AC → compile → FSDP); ``config_args(cfg.model)`` gives the argument fields the job's
    ``[model]`` settings override (e.g. MoE load balancing: :func:`moe_config_args`); ``moe``:
    whether it has mixture-of-experts layers; ``hf``: its Hugging Face state-dict adapter
    (``config.json`` ``model_type`` and tensor names); ``flops_per_token(args, seq_len)``: training
    FLOPs per token (MFU's numerator); ``block_activations(args, layer, e, seq_len, device,
    routing_imbalance, ep)``: the bytes per token block ``layer`` saves for backward (the memory
    plan's; :class:`~ray_titan.models.costs.BlockActivations`). Both live in the family's
    ``costs.py`` (or those of the family whose formulas it shares).
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
    mtp: bool = False
    """Whether the family builds multi-token-prediction depths (``model.mtp_layers``: its
    ``config_args`` give them to the model as ``n_mtp_layers``)."""
    mtp_tp: bool = False
    """Whether its ``parallelize`` gives those depths a tensor-parallel plan
    (``ray_titan.parallel.tp.mtp_depth_plan``); pre-flight refuses ``parallelism.tp > 1`` with
    ``model.mtp_layers`` otherwise."""


def moe_config_args(m: Model) -> dict[str, Any]:
    """The ``[model]`` settings a mixture-of-experts family's arguments take: ``load_balance``
    (unset: the flavor's, or the checkpoint family's, own), ``aux_loss_coeff``, ``bias_update_rate``."""
    lb = {"load_balance": m.load_balance} if m.load_balance is not None else {}
    return {**lb, "aux_loss_coeff": m.aux_loss_coeff, "bias_update_rate": m.bias_update_rate}


def mtp_config_args(m: Model) -> dict[str, Any]:
    """The multi-token-prediction depths, ``n_mtp_layers`` = ``model.mtp_layers`` (the depths
    built replace a checkpoint's count)."""
    return {"n_mtp_layers": m.mtp_layers}


def mtp_moe_config_args(m: Model) -> dict[str, Any]:
    """:func:`moe_config_args` and :func:`mtp_config_args` (DeepSeek-V3, GLM-4.5, Qwen3.5-MoE)."""
    return {**moe_config_args(m), **mtp_config_args(m)}
