"""DeepSeek-V2 MoE and expert parallelism without Ray: sizes, routing, dispatch/combine against a
per-token reference, expert parallelism over two gloo ranks (edge cases included), balancing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ray_titan.models.decoder import count_parameters
from ray_titan.models.deepseek_v2.model import (
    GroupedExperts,
    MoE,
    activated_parameters,
    route_tokens,
    sequence_balance_loss,
)
from ray_titan.models.registry import build_model, get_model_args
from ray_titan.parallel.expert import MoEStepState

DEBUG = get_model_args("deepseek_v2", "debug")


def test_v2_lite_matches_the_model_card_on_meta():
    with torch.device("meta"):
        model = build_model("deepseek_v2", "V2-Lite")
    a = model.args
    assert (a.n_layers, a.dim, a.n_routed_experts, a.n_activated_experts, a.n_shared_experts) == (27, 2048, 64, 6, 2)
    # Model card: 15.7 B total, 2.4 B activated (the card truncates; the count is 2.45 B).
    assert count_parameters(model) == pytest.approx(15.7e9, rel=0.005)
    assert activated_parameters(model) == pytest.approx(2.4e9, rel=0.03)
    assert 1 == sum(1 for b in model.layers.values() if hasattr(b, "feed_forward"))  # first layer dense


def test_v2_matches_the_model_card_on_meta():
    with torch.device("meta"):
        model = build_model("deepseek_v2", "V2")
    a = model.args
    assert (a.n_layers, a.dim, a.n_routed_experts, a.n_activated_experts, a.n_shared_experts) == (60, 5120, 160, 6, 2)
    assert (a.topk_method, a.n_group, a.topk_group, a.route_scale, a.q_lora_rank) == (
        "group_limited_greedy", 8, 3, 16.0, 1536)
    # Model card: 236 B total, 21 B activated (counted: 235.7 B, 20.9 B).
    assert count_parameters(model) == pytest.approx(236e9, rel=0.005)
    assert activated_parameters(model) == pytest.approx(21e9, rel=0.01)


def _moe(seed=0, **kw) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(dataclasses.replace(DEBUG, **kw))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return moe


def _reference_routed(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert: the definition of the routed output."""
    weights, indices, _ = moe.router(x)
    e = moe.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(indices.shape[1]):
            i = int(indices[t, k])
            h = torch.nn.functional.silu(x[t] @ e.w1[i].T) * (x[t] @ e.w3[i].T)
            out[t] = out[t] + weights[t, k] * (h @ e.w2[i].T)
    return out


def test_route_tokens_equals_the_per_token_definition():
    moe = _moe()
    x = torch.randn(37, DEBUG.dim, requires_grad=True)
    weights, indices, _ = moe.router(x)
    got = route_tokens(x, weights, indices, moe.experts, moe.n_experts)
    want = _reference_routed(moe, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(got)
    gx, gw = torch.autograd.grad((got * g).sum(), [x, moe.experts.w1])
    rx, rw = torch.autograd.grad((want * g).sum(), [x, moe.experts.w1])
    torch.testing.assert_close(gx, rx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, rw, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias,activation", [(False, "swiglu"), (True, "clamped_swiglu")])
def test_grouped_gemm_equals_the_expert_loop_forward_and_backward(dtype, bias, activation):
    """torch._grouped_mm runs on CPU in torch 2.13 (bf16 with 16-byte-aligned rows): the path a
    Hopper GPU takes under bf16 (GroupedExperts.grouped) against the loop CPU and fp32 take, on
    the same weights and tokens, one expert getting none (DeepSeek's experts, gpt-oss's biased
    ones): outputs and every gradient."""
    torch.manual_seed(0)
    experts = GroupedExperts(4, 16, 32, bias=bias, activation=activation).to(dtype)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    counts = [5, 0, 11, 8]
    x = torch.randn(sum(counts), 16, dtype=dtype)
    g = torch.randn(sum(counts), 16, dtype=dtype)  # a dense gradient (as the MoE layer's weighting gives)

    def run(grouped: bool):
        xi = x.clone().requires_grad_()
        experts.zero_grad()
        if grouped:
            biases = (experts.b1, experts.b2, experts.b3) if bias else (None, None, None)
            y = experts.grouped(xi, torch.tensor(counts), (experts.w1, experts.w2, experts.w3), biases)
        else:
            y = experts(xi, counts)  # on CPU: the loop
        (y.float() * g.float()).sum().backward()
        return [y.detach(), xi.grad] + [p.grad.clone() for p in experts.parameters()]

    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for got, want in zip(run(True), run(False), strict=True):
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, **tol)


def test_router_counts_tokens_and_bias_steers_selection_only():
    moe = _moe(load_balance="aux_free")
    x = torch.randn(20, DEBUG.dim)
    moe.router.expert_bias.copy_(torch.tensor([0, 0, 0, 0, 0, 0, 10.0, 10.0]))
    weights, indices, scores = moe.router(x)
    assert set(indices.flatten().tolist()) == {6, 7}
    # The weights are the unbiased scores of the chosen experts.
    torch.testing.assert_close(weights, scores.gather(1, indices))
    assert moe.router.tokens_per_expert.tolist() == [0] * 6 + [20, 20]


def test_group_limited_routing_keeps_the_best_groups_and_refuses_bad_sizes():
    """group_limited_greedy (a function of the routing table): every token's experts lie in its
    topk_group best groups (a group's score: its best expert's), also when a balancing bias
    steers the choice; sizes that cannot route are refused when the model is built."""
    from ray_titan.models.routing import ROUTERS

    assert set(ROUTERS) >= {"greedy", "group_limited_greedy"}
    moe = _moe(load_balance="aux_free", topk_method="group_limited_greedy", n_group=4, topk_group=2)
    x = torch.randn(64, DEBUG.dim)
    for bias in ([0.0] * 8, [0, 0, 0, 0, 0, 0, -5.0, 5.0]):
        moe.router.expert_bias.copy_(torch.tensor(bias))
        weights, indices, scores = moe.router(x)
        best = (scores + moe.router.expert_bias).view(64, 4, 2).amax(-1).topk(2, dim=-1).indices
        assert ((indices // 2).unsqueeze(-1) == best.unsqueeze(1)).any(-1).all()
        torch.testing.assert_close(weights, scores.gather(1, indices))  # unbiased scores
    for change, message in (
        ({"topk_method": "sinkhorn"}, r"topk_method = 'sinkhorn' is not supported; valid: \['greedy', "),
        ({"n_group": 3, "topk_group": 1}, r"n_routed_experts = 8 is not divisible by n_group = 3"),
        ({"n_group": 4, "topk_group": 5}, r"topk_group = 5 is not within 1 and n_group = 4"),
        ({"n_group": 8, "topk_group": 1}, r"n_activated_experts = 2 exceeds the 1 experts"),
    ):
        with pytest.raises(ValueError, match=message), torch.device("meta"):
            build_model("deepseek_v2", "debug", **{"topk_method": "group_limited_greedy", **change})


def test_sequence_balance_loss_is_one_when_uniform_and_larger_when_skewed():
    n, k, seq = 4, 2, 8
    uniform_scores = torch.full((1, seq, n), 1 / n)
    # Every expert chosen by exactly seq·k/n tokens.
    idx = torch.tensor([[0, 1], [2, 3]] * (seq // 2)).unsqueeze(0)
    assert sequence_balance_loss(uniform_scores, idx, n, k).item() == pytest.approx(1.0)
    skewed = torch.tensor([0.7, 0.1, 0.1, 0.1]).expand(1, seq, n)
    all_to_0_1 = torch.tensor([[0, 1]] * seq).unsqueeze(0)
    # f = [2, 2, 0, 0], P = [0.7, 0.1, 0.1, 0.1]: 2·0.7 + 2·0.1 = 1.6
    assert sequence_balance_loss(skewed, all_to_0_1, n, k).item() == pytest.approx(1.6)


def test_aux_loss_gradient_reaches_the_router_without_changing_the_output():
    moe = _moe(load_balance="aux_loss", aux_loss_coeff=0.5)
    x = torch.randn(2, 6, DEBUG.dim)
    out = moe(x)
    moe.aux_coeff = 0.0
    with torch.no_grad():
        plain = moe(x)
    torch.testing.assert_close(out, plain)
    (g,) = torch.autograd.grad(out.sum(), [moe.router.weight])
    # Reference: d/dW [sum(out) + 0.5 · balance loss], computed explicitly.
    w, i, s = moe.router(x.reshape(-1, DEBUG.dim))
    routed = route_tokens(x.reshape(-1, DEBUG.dim), w, i, moe.experts, moe.n_experts)
    total = (routed + moe.shared_experts(x.reshape(-1, DEBUG.dim))).sum() + 0.5 * sequence_balance_loss(
        s.view(2, 6, -1), i.view(2, 6, -1), moe.n_experts, moe.top_k
    )
    (ref,) = torch.autograd.grad(total, [moe.router.weight], retain_graph=True)
    torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-7)
    (without,) = torch.autograd.grad(routed.sum(), [moe.router.weight])
    assert not torch.allclose(g, without, rtol=1e-3)  # the balance loss did contribute
    assert moe.aux_loss_sum.item() > 0


def test_aux_free_bias_moves_toward_balance():
    model = build_model("deepseek_v2", "debug", load_balance="aux_free", bias_update_rate=0.01)
    model.init_weights(0)
    state = MoEStepState({0: model}, ep=1, dp_group=None, n_microbatches=1)
    model(torch.randint(0, DEBUG.vocab_size, (2, 32)))
    scalars = state.end_step()  # on the device; read back as the step's one host copy does
    aux, layers, load = scalars.read(torch.cat([t.reshape(-1).double() for t in scalars.tensors()]).tolist())
    assert aux is None and layers == DEBUG.moe_layers
    for layer, counts in zip(layers, load):
        assert sum(counts) == 2 * 32 * DEBUG.n_activated_experts
        bias = model.layers[str(layer)].moe.router.expert_bias
        mean = sum(counts) / len(counts)
        for c, b in zip(counts, bias.tolist()):
            assert b == pytest.approx(0.01 * ((c < mean) - (c > mean)))
        assert model.layers[str(layer)].moe.router.tokens_per_expert.sum() == 0  # zeroed


def test_moe_flops_count_activated_parameters_only():
    from ray_titan.models.costs import transformer_flops_per_token
    from ray_titan.models.deepseek_v2.costs import deepseek_flops_per_token

    a = get_model_args("deepseek_v2", "V2-Lite")
    with torch.device("meta"):
        model = build_model("deepseek_v2", "V2-Lite")
    # By hand: every parameter but the embedding, with 6 of the 64 routed experts per MoE layer.
    expert = 3 * a.dim * a.moe_inter_dim
    routed_all = (a.n_layers - a.n_dense_layers) * a.n_routed_experts * expert
    n = count_parameters(model) - a.vocab_size * a.dim - routed_all * (64 - 6) // 64
    width = a.n_heads * (192 + 128) // 2
    assert deepseek_flops_per_token(a, 4096) == transformer_flops_per_token(n, 27, width, 4096)
    assert 6 * 2.4e9 < deepseek_flops_per_token(a, 4096) < 6 * 2.6e9 + 12 * 27 * width * 4096
