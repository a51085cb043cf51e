"""Gated DeltaNet in plain PyTorch (``ray_titan.models.qwen3_5.delta_rule``) against its own
recurrent reference and transformers' torch implementation (``models/qwen3_5/modeling_qwen3_5.py``):
forward and gradients in fp32 on tiny random inputs, no process, no Ray."""

from __future__ import annotations

import pytest
import torch

from ray_titan.models.qwen3_5.delta_rule import (
    GatedDeltaNet,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


def _inputs(seq: int = 45, hk: int = 2, hv: int = 4, dk: int = 8, dv: int = 6, seed: int = 0):
    """q, k ``(2, seq, hk, dk)``, v ``(2, seq, hv, dv)``, g <= 0 and β in (0, 1) ``(2, seq, hv)``,
    all fp32 leaves with gradients; decays strong enough that gating matters."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, seq, hk, dk, generator=gen)
    k = torch.randn(2, seq, hk, dk, generator=gen)
    v = torch.randn(2, seq, hv, dv, generator=gen)
    g = -torch.rand(2, seq, hv, generator=gen) * 0.5
    beta = torch.rand(2, seq, hv, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def _grads(fn, inputs, seed: int = 1):
    out = fn(*inputs)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    grads = torch.autograd.grad((out * weight).sum(), inputs)
    return out.detach(), grads


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_equals_recurrent_forward_and_gradients(chunk):
    """45 tokens (not a multiple of the chunk: padding), grouped heads 2:4: the chunked form's
    outputs and the gradients of q, k, v, g and β equal the token-by-token recurrence's within
    1e-5. Control: without the decay (g = 0) the output differs (the gate matters here)."""
    inputs = _inputs()
    want, want_grads = _grads(recurrent_gated_delta_rule, inputs)
    got, got_grads = _grads(lambda *a: chunk_gated_delta_rule(*a, chunk=chunk), inputs)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for a, b in zip(got_grads, want_grads):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    q, k, v, g, beta = inputs
    ungated = chunk_gated_delta_rule(q, k, v, torch.zeros_like(g), beta, chunk=chunk)
    assert (ungated - want).abs().max() > 1e-2


def test_equal_to_transformers_forward_and_gradients():
    """Both forms against transformers' ``torch_chunk_gated_delta_rule`` and
    ``torch_recurrent_gated_delta_rule`` (``use_qk_l2norm_in_kernel``, as Qwen3.5 calls them):
    outputs and every input's gradient within 1e-5, 100 tokens over two chunks of 64."""
    inputs = _inputs(seq=100, seed=3)

    def hf_chunk(*a):
        return hf.torch_chunk_gated_delta_rule(*a[:3], g=a[3], beta=a[4], use_qk_l2norm_in_kernel=True)[0]

    def hf_recurrent(*a):
        return hf.torch_recurrent_gated_delta_rule(*a[:3], g=a[3], beta=a[4], use_qk_l2norm_in_kernel=True)[0]

    got_c, grads_c = _grads(chunk_gated_delta_rule, inputs)
    got_r, grads_r = _grads(recurrent_gated_delta_rule, inputs)
    for fn in (hf_chunk, hf_recurrent):
        want, want_grads = _grads(fn, inputs)
        for got, grads in ((got_c, grads_c), (got_r, grads_r)):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
            for a, b in zip(grads, want_grads):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_module_equals_transformers_gated_deltanet():
    """:class:`GatedDeltaNet` with the weights of transformers' ``Qwen3_5GatedDeltaNet``
    (random, std 0.3; its decay parameters too): the same output and input gradient within
    1e-5 and every weight gradient within 1e-5 of its largest entry, 70 tokens, grouped heads 2:4, a conv of width 4."""
    config = transformers.Qwen3_5TextConfig(
        hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=6, linear_conv_kernel_dim=4, num_hidden_layers=1, layer_types=["linear_attention"])
    torch.manual_seed(0)
    ref = hf.Qwen3_5GatedDeltaNet(config, 0)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.3)
    ours = GatedDeltaNet(32, 2, 4, 8, 6, 4, config.rms_norm_eps)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 70, 32, generator=torch.Generator().manual_seed(1))
    outs = []
    for module in (ref, ours):
        xi = x.clone().requires_grad_()
        out = module(xi)
        out.square().sum().backward()
        outs.append((out.detach(), xi.grad, {n: p.grad for n, p in module.named_parameters()}))
    (want, want_dx, want_dw), (got, got_dx, got_dw) = outs
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_dx, want_dx, rtol=1e-5, atol=1e-5)
    assert want_dw.keys() == got_dw.keys()
    for name in want_dw:
        scale = want_dw[name].abs().max()
        assert scale > 0, name
        torch.testing.assert_close(got_dw[name], want_dw[name], rtol=0, atol=1e-5 * scale)


def test_the_flash_linear_attention_call_is_its_api(monkeypatch):
    """Where flash-linear-attention runs (CUDA with ``fla`` installed; neither here), the call
    :func:`gated_delta_rule` makes follows its ``chunk_gated_delta_rule`` API: standing in for it,
    transformers' torch function of the same API (its fallback for that very kernel) gives the
    plain form's outputs and gradients. The kernel itself is not checked here."""
    from ray_titan.models.qwen3_5 import delta_rule

    calls = []

    def fla_stand_in(q, k, v, g, beta, **kwargs):
        calls.append(sorted(kwargs))
        return hf.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, **kwargs)

    monkeypatch.setattr(delta_rule, "FLA_CHUNK", fla_stand_in)
    monkeypatch.setattr(delta_rule, "_fla_device", lambda x: True)
    inputs = _inputs(seq=70, seed=5)
    want, want_grads = _grads(chunk_gated_delta_rule, inputs)
    got, got_grads = _grads(delta_rule.gated_delta_rule, inputs)
    assert calls == [["use_qk_l2norm_in_kernel"]]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
