"""The Qwen3.5 dense family's Hugging Face mapping (``model_type = "qwen3_5_text"``,
``Qwen3_5ForCausalLM``; the released multimodal ``qwen3_5`` files import too).

``config.json`` in both forms the hub carries: the text model's fields at the top level
(``qwen3_5_text``), or the released multimodal checkpoint's (``qwen3_5``,
``Qwen3_5ForConditionalGeneration``), whose language model's fields are under ``text_config``
(``tie_word_embeddings`` at the top) and whose language-model tensors are named
``model.language_model.*`` instead of ``model.*``. Its vision tower (``model.visual.*``) is
skipped on import. An export is always the text model (``qwen3_5_text``, ``model.*``), which
transformers' ``Qwen3_5ForCausalLM`` reads.

The multi-token-prediction layer (``mtp_num_hidden_layers``, the model's ``n_mtp_layers``, built
when ``model.mtp_layers = 1``; in both forms at the top level, ``mtp.*``, which transformers
ignores; the layout of vLLM's ``qwen3_next_mtp.py`` / ``qwen3_5_mtp.py``): ``mtp.fc`` (``2·dim ->
dim``, the embedding's half first) ↔ ``layers.<n_layers>.eh_proj``, ``mtp.pre_fc_norm_embedding``
/ ``mtp.pre_fc_norm_hidden`` / ``mtp.norm`` ↔ its ``enorm`` / ``hnorm`` / ``head_norm``, and
``mtp.layers.0.*`` (a full-attention layer named as the others) ↔ its block. An export writes it
with ``mtp_num_hidden_layers``, and without it ``mtp_num_hidden_layers = 0``.

Names: ``model.layers.N.input_layernorm`` / ``post_attention_layernorm`` ↔ ``layers.N.attention_norm``
/ ``ffn_norm``; ``self_attn.{q,k,v,o}_proj`` ↔ ``attention.w{q,k,v,o}`` (the query projection
keeps transformers' per-head query-then-gate rows, and rotary embeddings use its ``rotate_half``
layout, so no row is permuted); ``self_attn.{q,k}_norm`` ↔ ``attention.{q,k}_norm``;
``linear_attn.*`` ↔ ``linear_attn.*`` (the same names); ``mlp.{gate,up,down}_proj`` ↔
``feed_forward.w{1,3,2}``; ``model.embed_tokens`` / ``model.norm`` / ``lm_head`` ↔
``tok_embeddings`` / ``norm`` / ``output``. The norms' weights are stored as transformers holds
them (zero-centred: the scale is ``1 + w``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ray_titan.models.qwen3_5.args import FULL, LINEAR, Qwen35Args, hybrid_layer_types
from ray_titan.models.state_dict_adapter import (
    HFConfigError,
    Source,
    StateDictAdapter,
    attention_heads,
    float_field,
    rope_from_hf,
    rope_to_hf,
    size_field,
)

__all__ = ["MULTIMODAL_PREFIX", "Qwen35Adapter", "text_config"]

MULTIMODAL_PREFIX = "model.language_model."
"""Where the released multimodal checkpoints keep the language model's tensors."""

DELTANET_TENSORS = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
                    "conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight")
"""The Gated DeltaNet tensors of a linear-attention layer (the same names on both sides)."""


def text_config(config: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The language model's fields of a Qwen3.5 ``config.json`` and whether it is the multimodal
    form (a ``text_config`` object). Raises :class:`HFConfigError` for a ``text_config`` that is
    not an object."""
    text = config.get("text_config")
    if text is None:
        return config, False
    if not isinstance(text, dict):
        raise HFConfigError(f"config.json text_config = {text!r} is not valid; valid: an object")
    return text, True


class Qwen35Adapter(StateDictAdapter):
    """Qwen3.5 dense (Qwen3.5-27B): hybrid Gated DeltaNet / gated attention, both config forms."""

    model_type = "qwen3_5_text"
    architectures = ("Qwen3_5ForCausalLM",)
    model_type_aliases = ("qwen3_5",)
    # The MTP depths built are the job's choice (model.mtp_layers), not compared with config.json.
    training_fields = frozenset({"init_std", "hf_prefix", "n_mtp_layers"})

    def dense_fields(self, config: dict[str, Any]) -> dict[str, Any]:
        """The arguments both Qwen3.5 families read from ``config.json`` (either form), as a dict.
        Raises :class:`HFConfigError` naming the field."""
        c, multimodal = text_config(config)
        for name, valid in (("hidden_act", "silu"), ("attention_bias", False)):
            if c.get(name, valid) != valid:
                raise HFConfigError(f"config.json {name} = {c[name]!r} is not supported; valid: {valid!r}")
        dim, n_heads, n_kv_heads, head_dim = attention_heads(c)
        theta, _ = rope_from_hf(c, (), 10_000.0)  # plain: text positions make the mrope sections coincide
        params = c.get("rope_parameters") or {}
        factor = (float_field(params, "partial_rotary_factor", 1.0, where="rope_parameters.")
                  if "partial_rotary_factor" in params else float_field(c, "partial_rotary_factor", 0.25))
        n_layers = size_field(c, "num_hidden_layers")
        types = c.get("layer_types")
        if types is None:
            types = hybrid_layer_types(n_layers, size_field(c, "full_attention_interval", 4))
        if not isinstance(types, (list, tuple)) or len(types) != n_layers or set(types) - {LINEAR, FULL}:
            raise HFConfigError(f"config.json layer_types = {types!r} is not valid; valid: {n_layers} entries, each "
                                f"{LINEAR!r} or {FULL!r}")
        k_heads, v_heads = size_field(c, "linear_num_key_heads"), size_field(c, "linear_num_value_heads")
        if v_heads % k_heads:
            raise HFConfigError(f"config.json linear_num_value_heads = {v_heads} is not a multiple of "
                                f"linear_num_key_heads = {k_heads}; valid: a multiple of {k_heads}")
        tied = config.get("tie_word_embeddings", c.get("tie_word_embeddings", False))
        return dict(
            dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
            vocab_size=size_field(c, "vocab_size"), partial_rotary_factor=factor, linear_k_heads=k_heads,
            linear_v_heads=v_heads, linear_k_head_dim=size_field(c, "linear_key_head_dim"),
            linear_v_head_dim=size_field(c, "linear_value_head_dim"),
            conv_kernel=size_field(c, "linear_conv_kernel_dim", 4), layer_types=tuple(types),
            norm_eps=float_field(c, "rms_norm_eps", 1e-6), rope_theta=theta,
            max_seq_len=size_field(c, "max_position_embeddings"), tie_word_embeddings=bool(tied),
            hf_prefix=MULTIMODAL_PREFIX if multimodal else "model.",
            n_mtp_layers=size_field(c, "mtp_num_hidden_layers", 0),
        )

    def args_from_hf(self, config: dict[str, Any]) -> Qwen35Args:
        c, _ = text_config(config)
        return Qwen35Args(inter_dim=size_field(c, "intermediate_size"), **self.dense_fields(config))

    def hf_config(self, args: Qwen35Args) -> dict[str, Any]:
        return {
            "hidden_size": args.dim, "intermediate_size": args.inter_dim, "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
            "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "max_position_embeddings": args.max_seq_len,
            "tie_word_embeddings": args.tie_word_embeddings, "hidden_act": "silu", "attention_bias": False,
            "attention_dropout": 0.0, "partial_rotary_factor": args.partial_rotary_factor,
            "linear_conv_kernel_dim": args.conv_kernel, "linear_key_head_dim": args.linear_k_head_dim,
            "linear_value_head_dim": args.linear_v_head_dim, "linear_num_key_heads": args.linear_k_heads,
            "linear_num_value_heads": args.linear_v_heads, "layer_types": list(args.layer_types),
            "mtp_num_hidden_layers": args.n_mtp_layers,
            # An export is the text model: a multimodal import's nested configs do not carry over.
            "text_config": None, "vision_config": None,
            **rope_to_hf(args.rope_theta, None),
        }

    def export_args(self, args: Qwen35Args) -> Qwen35Args:
        """The text model's names whatever form was imported (module docstring)."""
        return dataclasses.replace(args, hf_prefix="model.")

    def skipped_prefixes(self, args: Qwen35Args) -> dict[str, str]:
        mtp = {} if args.n_mtp_layers else {
            "mtp.": "config.json declares no multi-token-prediction layer (mtp_num_hidden_layers)"}
        return {**mtp, "model.visual.": "the vision tower is not built (ray_titan trains the language model)"}

    def held_args(self, args: Qwen35Args, keys: set[str]) -> Qwen35Args:
        """The MTP layer when the files hold it (``mtp.*``): a file saved by transformers has none."""
        held = 1 if args.n_mtp_layers and any(k.startswith("mtp.") for k in keys) else 0
        return dataclasses.replace(args, n_mtp_layers=held)

    def ffn_sources(self, args: Qwen35Args, hf_layer: str) -> dict[str, Source]:
        """The feed-forward entries of the layer named ``hf_layer`` (``model.layers.3.``,
        ``mtp.layers.0.``): ray_titan name relative to the block → source."""
        hf = f"{hf_layer}mlp."
        return {f"feed_forward.{rt}.weight": Source((f"{hf}{name}.weight",))
                for rt, name in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))}

    def layer_sources(self, args: Qwen35Args, hf: str, rt: str, kind: str) -> dict[str, Source]:
        """One block's entries: ray_titan's ``rt`` (``layers.3.``) from the Hugging Face layer
        ``hf`` (``model.layers.3.``), of ``kind`` (full or linear attention)."""
        out = {rt + "attention_norm.weight": Source((hf + "input_layernorm.weight",)),
               rt + "ffn_norm.weight": Source((hf + "post_attention_layernorm.weight",))}
        if kind == FULL:
            out |= {f"{rt}attention.{rt_name}.weight": Source((f"{hf}self_attn.{name}.weight",))
                    for rt_name, name in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj"),
                                          ("q_norm", "q_norm"), ("k_norm", "k_norm"))}
        else:
            out |= {f"{rt}linear_attn.{t}": Source((f"{hf}linear_attn.{t}",)) for t in DELTANET_TENSORS}
        return out | {rt + k: v for k, v in self.ffn_sources(args, hf).items()}

    def sources(self, args: Qwen35Args) -> dict[str, Source]:
        p = args.hf_prefix
        out = {"tok_embeddings.weight": Source((f"{p}embed_tokens.weight",)),
               "norm.weight": Source((f"{p}norm.weight",)),
               "output.weight": Source((f"{p}embed_tokens.weight" if args.tie_word_embeddings else "lm_head.weight",))}
        for i, kind in enumerate(args.layer_types):
            out |= self.layer_sources(args, f"{p}layers.{i}.", f"layers.{i}.", kind)
        if args.n_mtp_layers:  # one depth (Qwen35Args.max_mtp_layers), and a last stage's copy of the embedding
            rt = f"layers.{args.n_layers}."
            out |= self.layer_sources(args, "mtp.layers.0.", rt, FULL)
            out |= {f"{rt}{a}.weight": Source((f"mtp.{b}.weight",))
                    for a, b in (("eh_proj", "fc"), ("enorm", "pre_fc_norm_embedding"),
                                 ("hnorm", "pre_fc_norm_hidden"), ("head_norm", "norm"))}
            out["mtp_embeddings.weight"] = Source((f"{p}embed_tokens.weight",))
        return out
