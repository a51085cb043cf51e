"""State-dict adapters: how a model family's Hugging Face checkpoint maps onto ray_titan's model.

Each family has one small adapter in ``ray_titan/models/<family>/state_dict_adapter.py`` (the role of
torchtitan's per-model ``state_dict_adapter.py``). It knows the family's ``config.json`` fields
(:meth:`StateDictAdapter.args_from_hf`, :meth:`StateDictAdapter.hf_config`) and, for every
entry of ray_titan's state dict, where its values live in the Hugging Face files
(:meth:`StateDictAdapter.sources`, a :class:`Source` each): the tensor names, the row
permutation between Meta's interleaved rotary layout and Hugging Face's ``rotate_half`` layout
(:func:`rotary_rows`), experts stacked along dim 0 from one tensor per expert, and tied weights
(the output head reading the embedding). Reading and writing files is
``ray_titan.checkpoint.hf_import``'s and ``hf_export``'s, generic over the families.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ray_titan.models.rope import RopeScaling

__all__ = [
    "BOOL_FIELDS",
    "DROPOUT",
    "FLOAT_FIELDS",
    "SIZE_FIELDS",
    "HFConfigError",
    "Source",
    "StateDictAdapter",
    "attention_heads",
    "check_config_numbers",
    "check_quantization",
    "float_field",
    "required",
    "rope_from_hf",
    "rope_to_hf",
    "rotary_rows",
    "size_field",
]


class HFConfigError(ValueError):
    """A ``config.json`` value ray_titan cannot build; the message names the field, its value
    and what is valid."""


@dataclass(frozen=True)
class Source:
    """Where one ray_titan state-dict entry lives in a Hugging Face checkpoint.

    ``keys``: the tensor names; with ``stacked`` there is one per index of ray_titan's dim 0
    (routed experts, one Hugging Face tensor each), otherwise exactly one. ``rows``: ray_titan's
    row ``i`` (dim 0) is the Hugging Face tensor's row ``rows[i]`` (the q/k rotary layout), None
    for the identity. ``file``: None for the model's weights files; else the name of a side file
    that ``config.json``-driven loaders (transformers, vLLM) do not read (the MoE router's
    ``expert_bias``). ``optional``: may be absent, and then the entry keeps its initial value.
    ``cols = (i, n)``: ray_titan's tensor is every ``n``-th entry of the Hugging Face tensor's last
    dim from ``i`` (one of ``n`` interleaved parts: gpt-oss's fused ``gate_up_proj``, whose even
    columns are the gate and odd ones the up projection; the parts share the key and an export
    interleaves them back), then, with ``transpose``, its last two dims swapped (gpt-oss stores
    expert weights as ``(experts, in, out)``, ray_titan as ``(experts, out, in)``). Dim 0 is
    untouched, so a rank still reads a run of rows.
    """

    keys: tuple[str, ...]
    rows: tuple[int, ...] | None = None
    stacked: bool = False
    file: str | None = None
    optional: bool = False
    cols: tuple[int, int] | None = None
    transpose: bool = False


def attention_heads(config: dict[str, Any]) -> tuple[int, int, int, int]:
    """``(dim, n_heads, n_kv_heads, head_dim)`` of a Hugging Face ``config.json`` with grouped-query
    attention (``hidden_size``, ``num_attention_heads``, ``num_key_value_heads`` defaulting to
    the heads, ``head_dim`` defaulting to ``hidden_size / num_attention_heads``), checked for the
    shapes the model derives from them: a whole head size, an even one (rotary embeddings rotate
    pairs), key/value heads that divide the heads, and a width of at most :data:`MAX_WIDTH`.
    Raises :class:`HFConfigError` naming the field, its value and what is valid."""
    dim, n_heads = size_field(config, "hidden_size"), size_field(config, "num_attention_heads")
    n_kv_heads = size_field(config, "num_key_value_heads", n_heads)
    head_dim = size_field(config, "head_dim", 0)
    if not head_dim and dim % n_heads:
        raise HFConfigError(f"config.json hidden_size = {dim} is not divisible by num_attention_heads = "
                            f"{n_heads} and there is no head_dim; valid: a multiple of {n_heads}, or a head_dim")
    head_dim = head_dim or dim // n_heads
    if head_dim % 2:
        raise HFConfigError(f"config.json: the head size is {head_dim} (head_dim, or hidden_size / "
                            "num_attention_heads); valid: an even size (rotary embeddings rotate pairs)")
    if n_heads % n_kv_heads:
        raise HFConfigError(f"config.json num_attention_heads = {n_heads} is not a multiple of "
                            f"num_key_value_heads = {n_kv_heads}; valid: a divisor of {n_heads}")
    if n_heads * head_dim > MAX_WIDTH:
        raise HFConfigError(f"config.json num_attention_heads × head_dim = {n_heads} × {head_dim} exceeds "
                            f"{MAX_WIDTH}; valid: at most {MAX_WIDTH}")
    return dim, n_heads, n_kv_heads, head_dim


def rotary_rows(n_heads: int, head_dim: int, rotated: int | None = None) -> tuple[int, ...]:
    """The q/k row permutation from Hugging Face's ``rotate_half`` layout to Meta's interleaved
    pairs: within each head, Meta's rows ``2j, 2j+1`` are Hugging Face's rows ``j, j + rotated/2``
    (the inverse of the ``permute`` in transformers' ``convert_llama_weights_to_hf.py``).
    ``rotated``: the head's first dimensions the rotary embedding turns (a partial rotary
    embedding, GLM-4.5's; None: all ``head_dim``), the rows after them stay in place.
    Length ``n_heads · head_dim``."""
    rotated = rotated or head_dim
    half = rotated // 2
    return tuple(h * head_dim + (j if j >= rotated else j // 2 if j % 2 == 0 else half + j // 2)
                 for h in range(n_heads) for j in range(head_dim))


def required(config: dict[str, Any], name: str) -> Any:
    """``config[name]``; raises :class:`HFConfigError` naming the field when it is absent."""
    if name not in config:
        raise HFConfigError(f"config.json has no {name!r}")
    return config[name]


# Bounds of the config.json fields that size the model. Each maximum is far above the largest
# released model (so no real checkpoint is refused) and small enough that what ray_titan derives
# from a config before reading any weight (the model on the meta device, the adapters' tensor
# lists, rotary_rows' permutation) takes milliseconds: a hostile or mistyped value such as 1e9
# is refused here, before it sizes anything. ray_titan.checkpoint.hf_import bounds the layer and expert counts and
# the embedding further by what the safetensors headers hold.
MAX_WIDTH = 2**16
"""hidden_size, and a query projection's heads × head_dim (Llama 3.1 405B: 16,384)."""
MAX_FFN = 2**18
"""intermediate_size, moe_intermediate_size (Llama 3.1 405B: 53,248)."""
MAX_LAYERS = 256
"""num_hidden_layers (Llama 3.1 405B: 126). Lower than the others: building the model on the
meta device takes about 10 ms a layer, so 256 layers already take seconds."""
MAX_HEADS = 1024
"""num_attention_heads, num_key_value_heads (Llama 3.1 405B, DeepSeek-V3: 128)."""
MAX_HEAD_DIM = 1024
"""head_dim and DeepSeek's per-head q/k/v sizes (Gemma: 256; DeepSeek-V3's q/k: 192)."""
MAX_VOCAB = 2**22
"""vocab_size (Gemma 3: 262,144)."""
MAX_EXPERTS = 4096
"""n_routed_experts, the experts per token and the expert groups (Kimi K2: 384; Qwen3-Next: 512)."""
MAX_LORA_RANK = 2**16
"""DeepSeek's q_lora_rank, kv_lora_rank (DeepSeek-V3: 1536, 512)."""
MAX_POSITIONS = 2**24
"""max_position_embeddings (Llama 4 Scout: 10,485,760); each worker holds rotary tables of
positions × head_dim / 2 fp32 values."""

SIZE_FIELDS: dict[str, tuple[int, int]] = {
    "hidden_size": (1, MAX_WIDTH),
    "intermediate_size": (1, MAX_FFN),
    "moe_intermediate_size": (1, MAX_FFN),
    "num_hidden_layers": (1, MAX_LAYERS),
    "first_k_dense_replace": (0, MAX_LAYERS),
    "num_attention_heads": (1, MAX_HEADS),
    "num_key_value_heads": (1, MAX_HEADS),
    "head_dim": (2, MAX_HEAD_DIM),
    "vocab_size": (1, MAX_VOCAB),
    "n_routed_experts": (1, MAX_EXPERTS),
    "num_experts": (1, MAX_EXPERTS),  # Qwen3-MoE's name for n_routed_experts
    "num_local_experts": (1, MAX_EXPERTS),  # the same, as transformers 5 writes it (attribute_map)
    "decoder_sparse_step": (1, MAX_LAYERS),  # Qwen3-MoE: every n-th layer is MoE
    "num_experts_per_tok": (1, MAX_EXPERTS),
    "experts_per_token": (1, MAX_EXPERTS),  # gpt-oss's hub files' second name for num_experts_per_tok
    "sliding_window": (1, MAX_POSITIONS),  # gpt-oss: the tokens a sliding-window layer sees
    "n_shared_experts": (0, MAX_EXPERTS),
    "n_group": (1, MAX_EXPERTS),
    "topk_group": (1, MAX_EXPERTS),
    "q_lora_rank": (0, MAX_LORA_RANK),
    "kv_lora_rank": (1, MAX_LORA_RANK),
    "qk_nope_head_dim": (1, MAX_HEAD_DIM),
    "qk_rope_head_dim": (2, MAX_HEAD_DIM),
    "rotary_dim": (2, MAX_HEAD_DIM),  # MiniMax-M2: the rotated dimensions of each head
    "v_head_dim": (1, MAX_HEAD_DIM),
    "max_position_embeddings": (1, MAX_POSITIONS),
    "original_max_position_embeddings": (1, MAX_POSITIONS),
    "num_nextn_predict_layers": (0, 16),  # DeepSeek-V3's MTP modules (released: 1); sizes a skip list
    "mtp_num_hidden_layers": (0, 16),  # Qwen3.5's MTP layers (released: 1)
    # Read by transformers' reference, not by ray_titan (or only to refuse other values): still
    # sizes, checked by check_config_numbers wherever they appear.
    "qk_head_dim": (1, 2 * MAX_HEAD_DIM),  # DeepSeek: qk_nope_head_dim + qk_rope_head_dim
    "mlp_only_layers": (0, MAX_LAYERS - 1),  # Qwen3-MoE: indices of the dense layers
    "max_window_layers": (0, MAX_LAYERS),  # Qwen3: the layers with full attention
    "moe_layer_freq": (1, MAX_LAYERS),  # DeepSeek: every n-th layer is MoE
    "initial_context_length": (1, MAX_POSITIONS),  # gpt-oss's hub files
    "pretraining_tp": (1, MAX_HEADS),  # Llama: tensor-parallel degree of pre-training
    "ep_size": (1, MAX_EXPERTS),  # DeepSeek's hub files: expert-parallel degree
    # Qwen3-Next / Qwen3.5: Gated DeltaNet's heads and convolution, the gated shared expert.
    "linear_num_key_heads": (1, MAX_HEADS),
    "linear_num_value_heads": (1, MAX_HEADS),
    "linear_key_head_dim": (1, MAX_HEAD_DIM),
    "linear_value_head_dim": (1, MAX_HEAD_DIM),
    "linear_conv_kernel_dim": (1, 64),  # released: 4
    "full_attention_interval": (1, MAX_LAYERS),
    "shared_expert_intermediate_size": (0, MAX_FFN),
}
"""config.json field -> (smallest, largest) valid value: every integer field a family (or
transformers' reference) reads that sizes a tensor, a table or a list. Read them with
:func:`size_field`; :func:`check_config_numbers` checks them wherever they appear."""


def size_field(config: dict[str, Any], name: str, default: int | None = None, *, where: str = "") -> int:
    """``config[name]`` as an int within ``SIZE_FIELDS[name]``; an absent or null field is
    ``default`` (None: required). An integral float (``4096.0``, ``1e3``) counts as its integer;
    a bool, a fraction, a string or anything else is refused. ``where``: the field's path in
    the message (``"rope_scaling."``). Raises :class:`HFConfigError` naming the field, its value
    and the valid range; checks only, so it costs nothing whatever the value."""
    low, high = SIZE_FIELDS[name]
    value = config.get(name)
    if value is None:
        if default is None:
            raise HFConfigError(f"config.json has no {where}{name!r}")
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise HFConfigError(f"config.json {where}{name} = {config[name]!r} is not valid; valid: an integer from "
                            f"{low} to {high}")
    return value


FLOAT_FIELDS: dict[str, tuple[float, float, bool, bool]] = {
    "rope_theta": (0.0, math.inf, False, False),
    "rms_norm_eps": (0.0, 1.0, False, True),
    "routed_scaling_factor": (0.0, math.inf, False, False),
    "factor": (0.0, math.inf, False, False),
    "low_freq_factor": (0.0, math.inf, False, False),
    "high_freq_factor": (0.0, math.inf, False, False),
    "beta_fast": (0.0, math.inf, False, False),
    "beta_slow": (0.0, math.inf, False, False),
    "mscale": (0.0, math.inf, True, False),
    "mscale_all_dim": (0.0, math.inf, True, False),
    "swiglu_alpha": (0.0, math.inf, False, False),  # gpt-oss: sigmoid(alpha · x); 0 makes the gate x / 2
    "swiglu_limit": (0.0, math.inf, False, False),  # gpt-oss: the clamp of the gate and up projections
    "router_aux_loss_coef": (0.0, math.inf, True, False),  # a loss weight: negative rewards imbalance
    "aux_loss_alpha": (0.0, math.inf, True, False),  # DeepSeek's name for it
    "initializer_range": (0.0, math.inf, True, False),  # the std of transformers' init: normal_ refuses < 0
    "partial_rotary_factor": (0.0, 1.0, False, True),  # the rotated share of a head
    "attention_factor": (0.0, math.inf, False, False),  # transformers' rope validation: > 0
    "router_jitter_noise": (0.0, 1.0, True, False),  # MiniMax-M2 (transformers' training only): inputs × U(1 ± it)
}
"""config.json field -> (low, high, low allowed, high allowed): the floats a family reads (or
transformers' reference reads) that size nothing but enter the model's arithmetic (rope
frequencies, norms, router scale, the clamped SwiGLU, the balance loss): a NaN, an infinity, a
zero or a negative value there would poison every step without an error (rope_theta 0 or a beta
of 0 divides by zero; rms_norm_eps 0 divides a zero row by zero). Each must be finite and above
``low`` (or equal to it where allowed), below ``high`` (or equal to it where allowed). Any field
named ``*dropout`` is a probability that keeps something: 0 ≤ p < 1 (:data:`DROPOUT`). Read them
with :func:`float_field`."""

DROPOUT = (0.0, 1.0, True, False)
"""The bounds of every ``*dropout`` field (``attention_dropout``, ...): ``torch.nn.Dropout``
takes 0 ≤ p ≤ 1, and p = 1 zeroes every activation it sees, so 1 is refused too."""


def _float_bounds(name: str) -> tuple[float, float, bool, bool] | None:
    return FLOAT_FIELDS.get(name) or (DROPOUT if name.endswith("dropout") else None)


def float_field(config: dict[str, Any], name: str, default: float, *, where: str = "") -> float:
    """``config[name]`` as a float within ``FLOAT_FIELDS[name]``; an absent or null field is
    ``default``. An int counts as its float; a bool, a string or anything else is refused, as
    are NaN and infinities. ``where``: the field's path in the message (``"rope_scaling."``).
    Raises :class:`HFConfigError` naming the field, its value and the valid range."""
    bounds = _float_bounds(name)
    if bounds is None:
        raise KeyError(f"{name} is not a field of FLOAT_FIELDS")
    low, high, low_ok, high_ok = bounds
    value = config.get(name)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not (low <= value if low_ok else low < value) or not (value <= high if high_ok else value < high):
        upper = "" if math.isinf(high) else f" and {'at most' if high_ok else 'below'} {high:g}"
        raise HFConfigError(f"config.json {where}{name} = {value!r} is not valid; valid: a finite number "
                            f"{'>=' if low_ok else '>'} {low:g}{upper}")
    return float(value)


BOOL_FIELDS = frozenset({"tie_word_embeddings", "norm_topk_prob", "attention_bias", "mlp_bias", "use_sliding_window",
                         "truncate", "use_qk_norm"})
"""config.json fields the families read as booleans: JSON ``true`` / ``false`` (or null) only, as
transformers' typed configs declare them (a string ``"false"`` would read as true)."""


MAX_CONFIG_DEPTH = 16
"""The deepest nesting of objects :func:`check_config_numbers` walks (real files: 2 or 3)."""


def check_config_numbers(config: dict[str, Any], where: str = "", depth: int = 0) -> None:
    """Check every number of a ``config.json`` (``config``; nested objects such as
    ``rope_parameters`` and lists such as ``eos_token_id`` included; ``where``, ``depth``: the
    path and nesting so far):
    one of :data:`SIZE_FIELDS` an integer in its range, one of :data:`FLOAT_FIELDS` (or a
    ``*dropout``) a float in its range, any other finite; one of :data:`BOOL_FIELDS` a boolean.
    Whether or not the family reads the field: a value the reference implementation
    (transformers) would refuse or compute nonsense from is refused, not ignored, so a typo in a
    shadowed field (a top-level ``rope_theta`` beside ``rope_parameters.rope_theta``) is found.
    The ranges: positive sizes, ``rope_theta`` > 0, eps in (0, 1], 0 ≤ dropout < 1 (the tables'
    comments give each one's source). Raises :class:`HFConfigError` naming the field (its path),
    its value and the valid range, or an object nested deeper than :data:`MAX_CONFIG_DEPTH`."""
    if depth > MAX_CONFIG_DEPTH:  # a real config.json nests 2 or 3 deep; recursion has a limit
        raise HFConfigError(f"config.json {where.rstrip('.')} nests objects more than {MAX_CONFIG_DEPTH} deep; "
                            f"valid: at most {MAX_CONFIG_DEPTH}")
    for key, value in config.items():
        if isinstance(value, dict):
            check_config_numbers(value, f"{where}{key}.", depth + 1)
            continue
        if key in BOOL_FIELDS:
            if value is not None and not isinstance(value, bool):
                raise HFConfigError(f"config.json {where}{key} = {value!r} is not valid; valid: true or false")
            continue
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, dict):
                check_config_numbers(item, f"{where}{key}[].", depth + 1)
            elif isinstance(item, (int, float)) and not isinstance(item, bool):
                _check_number(key, item, where)


def _check_number(key: str, value: float, where: str) -> None:
    """One number of config.json field ``where + key`` (a list's item too) against its bounds."""
    if key in SIZE_FIELDS:
        size_field({key: value}, key, where=where)
    elif _float_bounds(key) is not None:
        float_field({key: value}, key, 0.0, where=where)
    elif not math.isfinite(value):
        raise HFConfigError(f"config.json {where}{key} = {value!r} is not valid; valid: a finite number")


def check_quantization(config: dict[str, Any], model_type: str, methods: tuple[str, ...], advice: str = "") -> None:
    """Refuse a ``config.json`` ``quantization_config`` whose ``quant_method`` is not one of
    ``methods`` (those the family's import dequantises: gpt-oss's ``mxfp4``; none elsewhere):
    its weights would be read as if they were not quantised. ``advice``: how to get unquantised
    files (DeepSeek-V3's FP8). Raises :class:`HFConfigError` naming the method and the valid ones."""
    quant = config.get("quantization_config")
    if quant is None:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if method in methods:
        return
    valid = f"{' or '.join(repr(m) for m in methods)} (dequantised on import) or " if methods else ""
    raise HFConfigError(
        f"config.json quantization_config.quant_method = {method!r} is not supported for {model_type}; valid: "
        f"{valid}no quantization_config (unquantised bf16, fp16 or fp32 weights){advice}")


def rope_from_hf(config: dict[str, Any], kinds: tuple[str, ...],
                 default_theta: float) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, rope_scaling)`` from a ``config.json``: ``rope_scaling`` (the hub files'
    key, ``type`` or ``rope_type``) or transformers 5's ``rope_parameters``. ``kinds``: the
    scaling kinds the family supports. Raises :class:`HFConfigError` naming the field."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    field = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    theta = (float_field(params, "rope_theta", default_theta, where=f"{field}.") if "rope_theta" in params
             else float_field(config, "rope_theta", default_theta))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in kinds:
        raise HFConfigError(
            f"config.json {field}.rope_type = {kind!r} is not supported for this model; valid: "
            f"{['default', *kinds]}"
        )
    if params.get("attention_factor") is not None:
        raise HFConfigError(f"config.json {field}.attention_factor is not supported (it is inferred from mscale)")
    if params.get("factor") is None or (params.get("original_max_position_embeddings") is None
                                        and config.get("max_position_embeddings") is None):
        raise HFConfigError(f"config.json {field} ({kind}) needs factor and original_max_position_embeddings")
    if params.get("original_max_position_embeddings") is not None:
        original = size_field(params, "original_max_position_embeddings", where=f"{field}.")
    else:
        original = size_field(config, "max_position_embeddings")
    truncate = params.get("truncate", True)
    if kind == "yarn" and not isinstance(truncate, bool):  # gpt-oss: false (fractional correction range)
        raise HFConfigError(f"config.json {field}.truncate = {truncate!r} is not valid; valid: true or false")
    defaults = RopeScaling(kind, 1.0, 1)

    def number(name: str, default: float) -> float:
        return float_field(params, name, default, where=f"{field}.")

    low = number("low_freq_factor", defaults.low_freq_factor)
    high = number("high_freq_factor", defaults.high_freq_factor)
    if kind == "llama3" and high <= low:  # the smoothing divides by their difference
        raise HFConfigError(f"config.json {field}.high_freq_factor = {high:g} is not above low_freq_factor = {low:g}; "
                            "valid: high_freq_factor > low_freq_factor")
    return theta, RopeScaling(
        kind, factor=number("factor", 1.0), original_max_position_embeddings=original,
        low_freq_factor=low, high_freq_factor=high,
        beta_fast=number("beta_fast", defaults.beta_fast), beta_slow=number("beta_slow", defaults.beta_slow),
        mscale=number("mscale", 0.0), mscale_all_dim=number("mscale_all_dim", 0.0),
        truncate=truncate if kind == "yarn" else True,
    )


def rope_to_hf(theta: float, scaling: RopeScaling | None) -> dict[str, Any]:
    """The ``config.json`` fields of a rope: ``rope_theta`` and ``rope_scaling`` (None when plain),
    in the form the released checkpoints use and transformers 4 and 5 and vLLM read."""
    if scaling is None:
        return {"rope_theta": theta, "rope_scaling": None}
    out: dict[str, Any] = {"rope_type": scaling.kind, "factor": scaling.factor,
                           "original_max_position_embeddings": scaling.original_max_position_embeddings}
    if scaling.kind == "llama3":
        out.update(low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor)
    else:
        out.update(beta_fast=scaling.beta_fast, beta_slow=scaling.beta_slow)
        if scaling.mscale:
            out["mscale"] = scaling.mscale
        if scaling.mscale_all_dim:
            out["mscale_all_dim"] = scaling.mscale_all_dim
        if not scaling.truncate:
            out["truncate"] = False
    return {"rope_theta": theta, "rope_scaling": out}


class StateDictAdapter:
    """A family's mapping to and from Hugging Face checkpoints (module docstring).

    ``model_type`` and ``architectures`` are the ``config.json`` values transformers dispatches
    on (an export writes them); ``model_type_aliases``: other ``model_type`` values of checkpoints
    with the same architecture that import through this adapter (Kimi K2's ``kimi_k2``, a
    DeepSeek-V3); ``training_fields``: argument fields that are training choices, not architecture (they
    are neither read from nor compared with ``config.json``).
    """

    model_type: str
    architectures: tuple[str, ...]
    model_type_aliases: tuple[str, ...] = ()
    training_fields: frozenset[str] = frozenset({"init_std"})
    quant_methods: tuple[str, ...] = ()
    """``quantization_config.quant_method`` values the import dequantises (none but gpt-oss's)."""
    quant_advice: str = ""
    """Appended to the refusal of another quantisation: how to get unquantised files."""

    def check_config(self, config: dict[str, Any]) -> None:
        """The checks every family's ``config.json`` passes before :meth:`args_from_hf`: its
        quantisation (:func:`check_quantization`) and every number in it
        (:func:`check_config_numbers`). Raises :class:`HFConfigError` naming the field."""
        check_quantization(config, self.model_type, self.quant_methods, self.quant_advice)
        check_config_numbers(config)

    def args_from_hf(self, config: dict[str, Any]) -> Any:
        """The model arguments a ``config.json`` describes. Raises :class:`HFConfigError` for a
        missing field or a value ray_titan cannot build (naming it)."""
        raise NotImplementedError

    def hf_config(self, args: Any) -> dict[str, Any]:
        """The architecture fields of ``config.json`` for ``args`` (the exporter adds
        ``model_type``, ``architectures``, token ids and the dtype)."""
        raise NotImplementedError

    def sources(self, args: Any) -> dict[str, Source]:
        """Every entry of the whole model's state dict (parameters and persistent buffers, by
        ray_titan name) and its :class:`Source`."""
        raise NotImplementedError

    @staticmethod
    def output_key(args: Any) -> str:
        """The tensor the output head reads: the embedding when tied, else ``lm_head.weight``."""
        return "model.embed_tokens.weight" if args.tie_word_embeddings else "lm_head.weight"

    def export_args(self, args: Any) -> Any:
        """The arguments an export writes (names and ``config.json``) for a model trained with
        ``args``: ``args`` itself, unless the family imports a form it does not write (Qwen3.5's
        multimodal files: exported as the text model)."""
        return args

    def ignored_keys(self, args: Any) -> set[str]:
        """Tensor names a checkpoint may hold that the model does not use (a tied model's
        ``lm_head.weight``, which transformers ignores too)."""
        return {"lm_head.weight"} if args.tie_word_embeddings else set()

    def held_args(self, args: Any, keys: set[str]) -> Any:
        """``args`` (from ``config.json``) narrowed to the parts whose tensors ``keys`` (the
        checkpoint's tensor names) hold, where a checkpoint may declare a part it does not carry
        (DeepSeek-V3's multi-token prediction, which transformers' ``save_pretrained`` drops).
        Default: ``args``."""
        return args

    def skipped_prefixes(self, args: Any) -> dict[str, str]:
        """Name prefixes of checkpoint tensors the model does not build, each with the reason a
        user reads when an import skips them (DeepSeek-V3's multi-token-prediction layer)."""
        return {}

    def canonical(self, args: Any) -> Any:
        """``args`` as :meth:`args_from_hf` would give them back from :meth:`hf_config` (e.g. the
        feed-forward size resolved), with the training fields kept: two arguments describe the
        same architecture when their canonical forms agree outside :attr:`training_fields`."""
        back = self.args_from_hf({**self.hf_config(args), "model_type": self.model_type})
        keep = {f: getattr(args, f) for f in self.training_fields if hasattr(args, f)}
        return dataclasses.replace(back, **keep)

    def differences(self, a: Any, b: Any) -> list[tuple[str, Any, Any]]:
        """``(field, value in a, value in b)`` for each architecture field where ``a`` and ``b``
        (canonical forms) differ."""
        ca, cb = self.canonical(a), self.canonical(b)
        return [(f.name, getattr(ca, f.name), getattr(cb, f.name)) for f in dataclasses.fields(ca)
                if f.name not in self.training_fields and getattr(ca, f.name) != getattr(cb, f.name)]
