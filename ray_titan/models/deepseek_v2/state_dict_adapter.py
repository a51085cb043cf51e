"""The DeepSeek-V2 family's Hugging Face mapping (``model_type = "deepseek_v2"``,
``DeepseekV2ForCausalLM``; the released checkpoints' names).

Names: ``self_attn.q_proj`` (or ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``) ↔
``attention.wq`` (``wq_a``, ``q_norm``, ``wq_b``), ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` /
``kv_b_proj`` / ``o_proj`` ↔ ``wkv_a`` / ``kv_norm`` / ``wkv_b`` / ``wo``; dense layers'
``mlp.{gate,up,down}_proj`` ↔ ``feed_forward.w{1,3,2}``; MoE layers' ``mlp.gate`` ↔
``moe.router``, ``mlp.experts.E.{gate,up,down}_proj`` (one tensor per expert) ↔ row ``E`` of the
stacked ``moe.experts.w{1,3,2}``, ``mlp.shared_experts.*`` ↔ ``moe.shared_experts.*``. The
rotary parts stay in place: DeepSeek's checkpoints, like ray_titan, use interleaved pairs.

The router's ``expert_bias`` (auxiliary-loss-free balancing, DeepSeek-V3 §2.1.2) has no
DeepSeek-V2 tensor in transformers; it is kept beside the weights in
:data:`ROUTER_BIAS_FILE` (``model.layers.N.mlp.gate.expert_bias``), which transformers and vLLM
do not read, so it survives an export and re-import.
"""

from __future__ import annotations

from typing import Any

from ray_titan.models.deepseek_v2.args import DeepSeekV2Args
from ray_titan.models.routing import GROUPED, group_problem
from ray_titan.models.state_dict_adapter import (
    HFConfigError,
    Source,
    StateDictAdapter,
    float_field,
    rope_from_hf,
    rope_to_hf,
    size_field,
)

__all__ = ["ROUTER_BIAS_FILE", "DeepSeekV2Adapter", "moe_sources"]

ROUTER_BIAS_FILE = "router_bias.safetensors"


class DeepSeekV2Adapter(StateDictAdapter):
    """DeepSeek-V2 and V2-Lite: softmax routing (``topk_method``: ``greedy`` or V2's
    ``group_limited_greedy``, functions of ``ray_titan.models.routing.ROUTERS``), YaRN rope.

    ``topk_methods`` / ``scoring_funcs``: the ``config.json`` values this family's reference
    (transformers' modeling file) computes, the first being the default when the field is absent.
    """

    model_type = "deepseek_v2"
    architectures = ("DeepseekV2ForCausalLM",)
    training_fields = frozenset({"init_std", "load_balance", "aux_loss_coeff", "bias_update_rate"})
    topk_methods: tuple[str, ...] = ("greedy", "group_limited_greedy")
    scoring_funcs: tuple[str, ...] = ("softmax",)

    def args_from_hf(self, config: dict[str, Any]) -> DeepSeekV2Args:
        def need(name: str, default: int | None = None) -> int:
            return size_field(config, name, default)

        for name, valid in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                            ("moe_layer_freq", 1)):
            if config.get(name, valid) != valid:
                raise HFConfigError(f"config.json {name} = {config[name]!r} is not supported; valid: {valid!r}")
        score_func = config.get("scoring_func") or self.scoring_funcs[0]
        if score_func not in self.scoring_funcs:
            raise HFConfigError(f"config.json scoring_func = {score_func!r} is not supported for {self.model_type}; "
                                f"valid: {list(self.scoring_funcs)}")
        method = config.get("topk_method") or self.topk_methods[0]
        if not isinstance(method, str) or method not in self.topk_methods:
            raise HFConfigError(f"config.json topk_method = {method!r} is not supported for {self.model_type}; "
                                f"valid: {list(self.topk_methods)}")
        n_layers, n_dense = need("num_hidden_layers"), need("first_k_dense_replace", 0)
        n_experts, top_k = need("n_routed_experts"), need("num_experts_per_tok")
        rope_dim = need("qk_rope_head_dim")
        # The shapes the model derives from these: dense layers among the layers, the top-k among
        # the experts, rotary pairs.
        if n_dense > n_layers:
            raise HFConfigError(f"config.json first_k_dense_replace = {n_dense} exceeds num_hidden_layers = "
                                f"{n_layers}; valid: 0 to {n_layers}")
        if top_k > n_experts:
            raise HFConfigError(f"config.json num_experts_per_tok = {top_k} exceeds n_routed_experts = "
                                f"{n_experts}; valid: 1 to {n_experts}")
        # Group-limited routing: the groups split the experts evenly and hold the top-k. Other
        # methods ignore the groups (as transformers does): they are kept as 1.
        n_group = topk_group = 1
        if method in GROUPED:
            n_group, topk_group = need("n_group"), need("topk_group")
            problem = group_problem(n_experts, top_k, n_group, topk_group,
                                    ("n_routed_experts", "num_experts_per_tok", "n_group", "topk_group"))
            if problem:
                raise HFConfigError(f"config.json {problem} (topk_method = {method!r})")
        if rope_dim % 2:
            raise HFConfigError(f"config.json qk_rope_head_dim = {rope_dim} is odd; valid: an even size "
                                "(rotary embeddings rotate pairs)")
        theta, scaling = rope_from_hf(config, ("yarn",), 10_000.0)
        return DeepSeekV2Args(
            dim=need("hidden_size"), n_layers=n_layers,
            n_dense_layers=n_dense, n_heads=need("num_attention_heads"),
            vocab_size=need("vocab_size"), inter_dim=need("intermediate_size"),
            moe_inter_dim=need("moe_intermediate_size"), n_routed_experts=n_experts,
            n_shared_experts=need("n_shared_experts", 0),
            n_activated_experts=top_k,
            route_scale=float_field(config, "routed_scaling_factor", 1.0),
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            topk_method=method, score_func=score_func, n_group=n_group, topk_group=topk_group,
            q_lora_rank=need("q_lora_rank", 0), kv_lora_rank=need("kv_lora_rank"),
            qk_nope_head_dim=need("qk_nope_head_dim"), qk_rope_head_dim=rope_dim,
            v_head_dim=need("v_head_dim"), norm_eps=float_field(config, "rms_norm_eps", 1e-6),
            rope_theta=theta, max_seq_len=need("max_position_embeddings"), rope_scaling=scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    def hf_config(self, args: DeepSeekV2Args) -> dict[str, Any]:
        return {
            "hidden_size": args.dim, "num_hidden_layers": args.n_layers, "first_k_dense_replace": args.n_dense_layers,
            "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_heads, "vocab_size": args.vocab_size,
            "intermediate_size": args.inter_dim, "moe_intermediate_size": args.moe_inter_dim,
            "n_routed_experts": args.n_routed_experts, "n_shared_experts": args.n_shared_experts,
            "num_experts_per_tok": args.n_activated_experts, "routed_scaling_factor": args.route_scale,
            "norm_topk_prob": args.norm_topk_prob, "topk_method": args.topk_method, "scoring_func": args.score_func,
            "n_group": args.n_group, "topk_group": args.topk_group, "moe_layer_freq": 1,
            "q_lora_rank": args.q_lora_rank or None, "kv_lora_rank": args.kv_lora_rank,
            "qk_nope_head_dim": args.qk_nope_head_dim, "qk_rope_head_dim": args.qk_rope_head_dim,
            "v_head_dim": args.v_head_dim, "rms_norm_eps": args.norm_eps,
            "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": args.tie_word_embeddings,
            "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
            **rope_to_hf(args.rope_theta, args.rope_scaling),
        }

    def router_bias_source(self, hf_layer: str) -> Source:
        """Where a layer's ``expert_bias`` lives: V2 has no such tensor, so a side file."""
        return Source((hf_layer + "mlp.gate.expert_bias",), file=ROUTER_BIAS_FILE, optional=True)

    def sources(self, args: DeepSeekV2Args) -> dict[str, Source]:
        out = {"tok_embeddings.weight": Source(("model.embed_tokens.weight",)),
               "norm.weight": Source(("model.norm.weight",)),
               "output.weight": Source((self.output_key(args),))}
        for i in range(args.n_layers):
            out |= self.layer_sources(args, i)
        return out

    def layer_sources(self, args: DeepSeekV2Args, i: int) -> dict[str, Source]:
        """The sources of block ``i``'s entries (``layers.i.*`` ↔ ``model.layers.i.*``); a dense
        block below ``n_dense_layers``, an MoE block above (multi-token prediction's too)."""
        out: dict[str, Source] = {}
        hf, rt = f"model.layers.{i}.", f"layers.{i}."
        attn = {"wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
        attn |= {"wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj"} if args.q_lora_rank else {
            "wq": "q_proj"}
        out |= {f"{rt}attention.{a}.weight": Source((f"{hf}self_attn.{b}.weight",)) for a, b in attn.items()}
        out |= {rt + "attention_norm.weight": Source((hf + "input_layernorm.weight",)),
                rt + "ffn_norm.weight": Source((hf + "post_attention_layernorm.weight",))}
        if i < args.n_dense_layers:
            out |= {f"{rt}feed_forward.{a}.weight": Source((f"{hf}mlp.{b}.weight",)) for a, b in _FFN.items()}
        else:
            out |= moe_sources(args, hf, rt, self.router_bias_source(hf))
        return out


_FFN = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def moe_sources(args: Any, hf: str, rt: str, router_bias: Source, moe: str = "mlp.",
                ffn: dict[str, str] | None = None) -> dict[str, Source]:
    """The :class:`Source` of each entry of one MoE layer (``ray_titan.models.deepseek_v2.model.MoE``)
    in DeepSeek's names, shared by the families that use them (GLM-4.5, and MiniMax-M2 with its
    own ``moe`` prefix and ``ffn`` names): ``mlp.gate`` ↔ ``moe.router``, the router's bias from
    ``router_bias``, ``mlp.experts.E.{gate,up,down}_proj`` (one tensor per expert; ``ffn``: ours →
    theirs) ↔ row ``E`` of ``moe.experts.w{1,3,2}``, ``mlp.shared_experts.*`` ↔
    ``moe.shared_experts.*``. ``hf``, ``rt``: the layer's name prefix there and here
    (``model.layers.N.``, ``layers.N.``); ``args``: ``n_routed_experts``, ``n_shared_experts``."""
    ffn = ffn or _FFN
    out = {rt + "moe.router.weight": Source((f"{hf}{moe}gate.weight",)), rt + "moe.router.expert_bias": router_bias}
    out |= {f"{rt}moe.experts.{a}": Source(tuple(f"{hf}{moe}experts.{e}.{b}.weight"
                                                 for e in range(args.n_routed_experts)), stacked=True)
            for a, b in ffn.items()}
    if args.n_shared_experts:
        out |= {f"{rt}moe.shared_experts.{a}.weight": Source((f"{hf}mlp.shared_experts.{b}.weight",))
                for a, b in _FFN.items()}
    return out
