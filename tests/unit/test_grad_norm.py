"""Gradient clipping without a mesh: the norm torch's own clipping gives, returned on the device."""

from __future__ import annotations

import torch

from ray_titan.parallel.grad_norm import clip_grad_norm_


def test_norm_and_clipping_are_torchs_and_the_norm_stays_on_the_parameters_device():
    torch.manual_seed(0)
    mine = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in mine]
    for a, b in zip(mine, ref):
        a.grad = torch.randn_like(a)
        b.grad = a.grad.clone()
    norm = clip_grad_norm_(mine, 0.5)
    want = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    assert norm.shape == () and norm.item() == want.item() > 0.5
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    # No gradient on this rank (a host tensor would fail an NCCL all-reduce): a zero where the parameters are.
    with torch.device("meta"):
        bare = [torch.nn.Parameter(torch.empty(3))]
    assert clip_grad_norm_(bare, 1.0).device.type == "meta"
