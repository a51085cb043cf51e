"""DeepSeek-V2 MoE and expert parallelism without Ray: sizes, routing, dispatch/combine against a
per-token reference, expert parallelism over two gloo ranks (edge cases included), balancing."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ray_titan.models.decoder import count_parameters
from ray_titan.models.deepseek_v2.model import (
    MoE,
    activated_parameters,
    route_tokens,
    sequence_balance_loss,
)
from ray_titan.models.registry import build_model, get_model_args
from ray_titan.parallel.expert import MoEStepState
from tests.ranks import free_port

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


def test_router_counts_tokens_and_bias_steers_selection_only():
    moe = _moe(load_balance="aux_free")
    x = torch.randn(20, DEBUG.dim)
    moe.router.expert_bias.copy_(torch.tensor([0, 0, 0, 0, 0, 0, 10.0, 10.0]))
    weights, indices, scores = moe.router(x)
    assert set(indices.flatten().tolist()) == {6, 7}
    # The weights are the unbiased scores of the chosen experts.
    torch.testing.assert_close(weights, scores.gather(1, indices))
    assert moe.router.tokens_per_expert.tolist() == [0] * 6 + [20, 20]


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
    aux, layers, load = state.end_step()
    assert aux is None and layers == DEBUG.moe_layers
    for layer, counts in zip(layers, load):
        assert sum(counts) == 2 * 32 * DEBUG.n_activated_experts
        bias = model.layers[str(layer)].moe.router.expert_bias
        mean = sum(counts) / len(counts)
        for c, b in zip(counts, bias.tolist()):
            assert b == pytest.approx(0.01 * ((c < mean) - (c > mean)))
        assert model.layers[str(layer)].moe.router.tokens_per_expert.sum() == 0  # zeroed


# -- expert parallelism over 2 gloo ranks -------------------------------------------------------

# Each case: (top_k, expert bias forcing the routing or None, tokens on rank 0, tokens on rank 1)
EP_CASES = {
    "random routing": (2, None, 24, 24),
    "experts with no tokens on some rank": (2, [9.0, 9.0, 0, 0, 0, 0, 0, 0], 24, 24),
    "all tokens to one expert": (1, [0, 0, 0, 0, 0, 9.0, 0, 0], 16, 16),
    "batch smaller than ep": (1, None, 1, 0),
}


def _ep_worker(rank: int, port: int, out_dir: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh

    from ray_titan.parallel.expert import apply_expert_parallel

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    out = {}
    for name, (top_k, bias, t0, t1) in EP_CASES.items():
        full = _moe(seed=1, n_activated_experts=top_k, load_balance="aux_free")
        if bias is not None:
            full.router.expert_bias.copy_(torch.tensor(bias))
        g = torch.Generator().manual_seed(2)
        xs = [torch.randn(t0, DEBUG.dim, generator=g), torch.randn(t1, DEBUG.dim, generator=g)]
        gouts = [torch.randn(t0, DEBUG.dim, generator=g), torch.randn(t1, DEBUG.dim, generator=g)]
        # The single-rank truth on both ranks' tokens.
        x_all = torch.cat(xs).requires_grad_()
        w, i, _ = full.router(x_all)
        y_all = route_tokens(x_all, w, i, full.experts, full.n_experts)
        want_grad_w1 = torch.autograd.grad((y_all * torch.cat(gouts)).sum(), [full.experts.w1])[0]

        class Holder(torch.nn.Module):
            def __init__(self, moe):
                super().__init__()
                self.moe = moe

            def moe_modules(self):
                return {1: self.moe}

        ep_moe = _moe(seed=1, n_activated_experts=top_k, load_balance="aux_free")
        ep_moe.router.load_state_dict(full.router.state_dict())
        holder = Holder(ep_moe)
        apply_expert_parallel(holder, mesh)
        with torch.no_grad():
            for n in ("w1", "w2", "w3"):
                getattr(ep_moe.experts, n).to_local().copy_(getattr(full.experts, n).chunk(2)[rank])
        x = xs[rank].clone().requires_grad_()
        w, i, _ = ep_moe.router(x)
        y = route_tokens(x, w, i, ep_moe.experts, ep_moe.n_experts, ep_moe.run_experts)
        gx, gw1 = torch.autograd.grad((y * gouts[rank]).sum(), [x, ep_moe.experts.w1])
        lo, hi = (0, t0) if rank == 0 else (t0, t0 + t1)
        out[name] = {
            "y_err": (y - y_all[lo:hi].detach()).abs().max().item() if hi > lo else 0.0,
            "w1_grad_err": (gw1.to_local() - want_grad_w1.chunk(2)[rank]).abs().max().item(),
            "tokens": hi - lo,
        }
        del gx
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(out))
    # Neither rank tears gloo down while the other may still be sending (an abort at exit).
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ep_results(tmp_path_factory):
    # Results through files, not an mp.Manager: its server process is forked from this one,
    # which may hold a Ray driver (the shared test cluster), and a forked Ray client broke
    # the next Ray Train run (its controller hung before starting workers).
    out = tmp_path_factory.mktemp("ep")
    mp.spawn(_ep_worker, args=(free_port(), str(out)), nprocs=2, join=True)
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}


@pytest.mark.parametrize("case", list(EP_CASES))
def test_expert_parallel_matches_one_rank(ep_results, case):
    for rank in (0, 1):
        r = ep_results[rank][case]
        assert r["y_err"] < 1e-5, (rank, r)
        # Each rank's experts get the gradient of the tokens of *both* ranks (the backward of the
        # dispatch all-to-all ran), equal to the single-rank gradient of those experts.
        assert r["w1_grad_err"] < 1e-5, (rank, r)


def test_moe_flops_count_activated_parameters_only():
    from ray_titan.metrics.flops import deepseek_flops_per_token, transformer_flops_per_token

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
