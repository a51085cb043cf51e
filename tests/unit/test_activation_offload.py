"""Activation offloading (``memory.activation_offload``, ``ray_titan.parallel.offload``): the hooks
see what each chosen block saves for backward (all of it without activation checkpointing, the
block input under full AC), leave the weights and the rotary tables alone, announce each block's
backward, and change neither the loss nor the gradients."""

from __future__ import annotations

import pytest
import torch

from ray_titan.config.schema import ConfigError, load_config
from ray_titan.models.registry import build_model
from ray_titan.parallel.ac import apply_ac
from ray_titan.parallel.offload import ActivationOffloader, apply_activation_offload, offloads
from ray_titan.preflight.checks import validate_job

CONFIG = "configs/debug_llama.toml"


def _model(ac: str = "none", offload: str | int = "none",
           copy: bool = False) -> tuple[torch.nn.Module, ActivationOffloader | None]:
    model = build_model("llama", "debug", vocab_size=258)
    model.init_weights(0)
    apply_ac(model, "selective" if ac == "op" else ac, "op")
    return model, apply_activation_offload(model, offload, min_bytes=1, copy_on_host=copy)


def _step(model: torch.nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 258, (2, 32), generator=g)
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


class _CountSaved:
    """The tensors autograd saves during a forward (its own hooks, outside the model's)."""

    def __init__(self) -> None:
        self.count = self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.count += 1
        self.bytes += t.numel() * t.element_size()
        return t


@pytest.mark.parametrize("ac", ["none", "full", "op"])
@pytest.mark.parametrize("copy", [False, True])
def test_loss_and_gradients_match_no_offloading(ac, copy):
    """On the CPU, and with every packed tensor copied away and back (``copy_on_host``: the
    handles, the prefetch one block ahead and the unpack run as on a GPU)."""
    ref_loss, ref_grads = _step(_model(ac)[0])
    model, off = _model(ac, "all", copy)
    assert off is not None
    loss, grads = _step(model)
    assert loss == ref_loss
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=0, msg=name)
    n_layers = len(model.layers)
    assert off.stats.backward_hooks == n_layers  # every block's backward announced, once
    assert off.stats.unpacked >= off.stats.packed > 0
    if copy:  # every handle came back through the prefetch (its block's, or the block after it's)
        assert off.stats.prefetched == off.stats.copies
    if ac == "none":  # a tensor several ops save (a norm's output: q, k, v's input) is copied once
        assert off.stats.copies < off.stats.packed


def test_hooks_pack_what_the_blocks_save_but_the_weights():
    """Without checkpointing the hooks see everything a block saves: with them as the innermost
    hooks, an outer counter sees nothing of the blocks (a test that fails if they are missing);
    what they pack is the blocks' activations, no parameter, no rotary table."""
    model, off = _model("none", "all")
    assert off is not None
    outer = _CountSaved()
    tokens = torch.randint(0, 258, (2, 32))
    with torch.autograd.graph.saved_tensors_hooks(outer.pack, lambda t: t):
        h = model.tok_embeddings(tokens)
        outer_before = outer.count
        for layer in model.layers.values():
            h = layer(h, model.rope_cos, model.rope_sin)
    assert outer.count == outer_before  # the blocks' own hooks took every saved tensor
    stats = off.stats
    assert stats.packed > 0 and stats.kept > 0  # weights and rotary tables are seen but stay
    # The same forward without offloading: what the blocks save, weights and tables included.
    plain, _ = _model("none")
    count = _CountSaved()
    with torch.autograd.graph.saved_tensors_hooks(count.pack, lambda t: t):
        h = plain.tok_embeddings(tokens)
        before_count, before_bytes = count.count, count.bytes
        for layer in plain.layers.values():
            h = layer(h, plain.rope_cos, plain.rope_sin)
    assert stats.packed + stats.kept == count.count - before_count
    weights = sum(p.numel() * p.element_size() for p in plain.layers.parameters() if p.dim() == 2)
    assert stats.packed_bytes <= count.bytes - before_bytes - weights


def test_full_ac_offloads_the_block_inputs_only():
    model, off = _model("full", "all")
    assert off is not None
    _step(model)
    n_layers, dim = len(model.layers), model.args.dim
    assert off.stats.packed == n_layers  # one input per block
    assert off.stats.packed_bytes == n_layers * 2 * 32 * dim * 4


def test_a_count_offloads_the_first_blocks():
    model, off = _model("full", 1)
    assert off is not None
    _step(model)
    assert off.stats.packed == 1 and off.stats.backward_hooks == 1
    assert [offloads(2, i) for i in range(3)] == [True, True, False]
    assert offloads("all", 99) and not offloads("none", 0)


def test_preflight_refuses_what_cannot_work():
    with pytest.raises(ConfigError, match="memory.activation_offload = 99"):
        validate_job(load_config(CONFIG, ["--memory.activation_offload=99"]), check_data=False)
    with pytest.raises(ConfigError, match="training.compile"):
        validate_job(load_config(CONFIG, ["--memory.activation_offload=all", "--training.compile=true"]),
                     check_data=False)
    validate_job(load_config(CONFIG, ["--memory.activation_offload=2"]), check_data=False)
