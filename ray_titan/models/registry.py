"""The model registry: a family name maps to everything the trainer needs of it.

Each family builds its own :class:`~ray_titan.models.spec.ModelSpec` (the role of torchtitan's
train spec) in its package, ``ray_titan/models/<family>/__init__.py`` (``SPEC``); this module only
collects them, from the package names in :data:`FAMILIES`, into :data:`MODELS`. The trainer
reaches a family only through its spec, so it never branches on a family's name. How to add a
family: ``ray_titan.models``.

Flavors: ``debug`` is tiny and CPU-friendly in each family; the named ones have the dimensions of
released models (each family's ``args.py`` and package docstring; the README's model table). Every
flavor is constructible on the meta device. Each family's ``hf`` adapter maps it to and from
Hugging Face checkpoints (``ray_titan.models.state_dict_adapter``).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from ray_titan.models.decoder import Decoder
from ray_titan.models.spec import ModelSpec

__all__ = ["FAMILIES", "MODELS", "ModelSpec", "build_model", "get_model_args", "get_spec", "is_moe", "spec_for_args",
           "spec_for_hf"]

# The registered families, each a package under ray_titan/models/ with a SPEC, in the order the
# config's model.name lists them (checked: tests/unit/test_registry.py). A lookup by arguments
# takes the first family whose flavors have them (spec_for_args).
FAMILIES: tuple[str, ...] = ("llama", "qwen3", "deepseek_v2", "deepseek_v3", "qwen3_moe", "gpt_oss", "glm4_moe",
                             "minimax_m2", "qwen3_5", "qwen3_5_moe")


def _collect(families: tuple[str, ...]) -> dict[str, ModelSpec]:
    """Each family package's ``SPEC``, by name; a spec whose name is not its package's is refused."""
    specs = {}
    for family in families:
        spec = getattr(importlib.import_module(f"{__package__}.{family}"), "SPEC", None)
        if not isinstance(spec, ModelSpec) or spec.name != family:
            raise TypeError(f"{__package__}.{family}.SPEC must be a ModelSpec named {family!r}; it is "
                            f"{getattr(spec, 'name', spec)!r}")
        specs[family] = spec
    return specs


MODELS: dict[str, ModelSpec] = _collect(FAMILIES)


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
                rope_positions: int | None = None, **overrides: Any) -> Decoder:
    """Construct the whole model (on the current default device; use ``torch.device("meta")``
    as a context to allocate nothing). ``args``: the model arguments, instead of the flavor's
    (a Hugging Face checkpoint's). ``vocab_size`` overrides the flavor's, to match the
    tokenizer; ``rope_positions``: the rotary tables' length (the job's sequence length;
    ``Decoder.fit_rope_tables``), None: the arguments' ``max_seq_len``; ``overrides`` replace
    other fields of the arguments (e.g. the MoE ``load_balance``). Raises ``KeyError`` for an
    unknown family or flavor, ``ValueError`` for ``rope_positions`` above ``max_seq_len``."""
    args = args if args is not None else get_model_args(name, flavor)
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    if overrides:
        args = dataclasses.replace(args, **overrides)
    model = get_spec(name).model_cls(args)
    if rope_positions is not None:
        model.fit_rope_tables(rope_positions)
    return model
