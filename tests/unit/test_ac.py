"""Op-level selective activation checkpointing (``ray_titan.parallel.ac``) is torchtitan 0.3.0's
policy (``torchtitan/distributed/activation_checkpoint.py``, ``SelectiveAC``): the loss and the
gradients are those of no checkpointing, and of a block's matmuls every second one (counted per
block, separately in the forward and its recomputation) is recomputed in backward, the router's
always, while the others come from the forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ray_titan.models.registry import build_model, get_spec
from ray_titan.parallel.ac import apply_ac

WIDTHS = (2, 3, 5, 7, 11, 13)  # increasing: a forward matmul's weight operand (in, out) has in < out
ROWS = 64  # more than any width: a weight gradient's operand (rows, in) is told apart


class _Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(17, 13) / 4)  # (experts, dim), as ray_titan's Router


class _Moe(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = _Router()


class _Chain(nn.Module):
    """Five linear layers of increasing width with a cheap op between them, then the router's
    matmul (``moe.router``, as ray_titan's MoE blocks name it)."""

    def __init__(self):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(a, b, bias=False) for a, b in zip(WIDTHS, WIDTHS[1:]))
        self.moe = _Moe()

    def forward(self, x):
        for lin in self.lins:
            x = torch.tanh(lin(x))
        return torch.sigmoid(F.linear(x, self.moe.router.weight)).mean(-1, keepdim=True) * x


class _Model(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleDict({str(i): _Chain() for i in range(n)})

    def forward(self, x):
        for block in self.layers.values():
            x = block(x[..., :2])
        return x


class _ForwardMatmuls(TorchDispatchMode):
    """The forward-shaped matmuls that run (``rows × in`` by ``in × out``, ``in < out``): by their
    weight operand's shape ``(in, out)``, in order."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default and args[0].shape[0] == ROWS:
            shape = tuple(args[1].shape)
            if shape[0] < shape[1] or shape == (13, 17):
                self.shapes.append(shape)
        return func(*args, **(kwargs or {}))


LAYER_SHAPES = list(zip(WIDTHS, WIDTHS[1:])) + [(13, 17)]


def _backward_recomputes(model: nn.Module, microbatches: int = 1) -> tuple[list, list]:
    """Forward ``microbatches`` inputs (all before any backward, as a pipeline does), then their
    backwards; the forward-shaped matmuls each backward ran, and the parameters' gradients."""
    xs = [torch.randn(ROWS, 2, generator=torch.Generator().manual_seed(i)) for i in range(microbatches)]
    losses = [model(x).square().mean() for x in xs]
    runs = []
    for loss in losses:
        with _ForwardMatmuls() as seen:
            loss.backward()
        runs.append(seen.shapes)
    return runs, [p.grad.clone() for p in model.parameters()]


def test_every_second_matmul_and_the_router_are_recomputed_and_the_rest_saved():
    """Per block: the 2nd and 4th of the five counted matmuls and the router's are recomputed in
    backward; the 1st, 3rd and 5th come from the forward. The old policy (save every matmul)
    recomputes none; a counter shared by the blocks, or by the forward and its recomputation,
    or one that counted the router, would pick other layers in the second block or microbatch."""
    plain, _ = _backward_recomputes(_Model(2))
    assert plain == [[]]  # no checkpointing: backward runs no forward matmul
    model = _Model(2)
    assert apply_ac(model, "selective", "op") == ["0", "1"]
    runs, _ = _backward_recomputes(model, microbatches=2)
    want = [LAYER_SHAPES[1], LAYER_SHAPES[3], LAYER_SHAPES[5]]  # (3, 5), (7, 11), the router (13, 17)
    for seen in runs:  # each microbatch: block 1's backward, then block 0's
        assert seen == want + want


def test_full_ac_recomputes_every_matmul():
    model = _Model(1)
    apply_ac(model, "full")
    runs, _ = _backward_recomputes(model)
    assert runs == [LAYER_SHAPES]


def test_op_sac_keeps_the_loss_and_gradients_of_a_llama_and_a_moe_model():
    """The debug Llama and DeepSeek (MoE: router, experts' matmul per expert) under op SAC: two
    microbatches forward, then both backwards; losses and gradients equal no checkpointing's
    within fp32 tolerance."""
    for family in ("llama", "deepseek_v2"):
        runs = []
        for ac in (False, True):
            torch.manual_seed(0)
            model = build_model(family, "debug", vocab_size=258)
            model.init_weights(0)
            if ac:
                assert apply_ac(model, "selective", "op") == list(model.layers.keys())
            xs = [torch.randint(0, 258, (2, 64), generator=torch.Generator().manual_seed(i)) for i in range(2)]
            losses = [F.cross_entropy(model(x).flatten(0, 1), x.flatten()) for x in xs]
            for loss in losses:
                loss.backward()
            runs.append(([loss.detach() for loss in losses], {n: p.grad for n, p in model.named_parameters()}))
        (loss0, grads0), (loss1, grads1) = runs
        torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
        assert grads0.keys() == grads1.keys()
        for name, grad in grads0.items():
            torch.testing.assert_close(grads1[name], grad, msg=f"{family}: {name}")


def test_unknown_option_is_refused():
    with pytest.raises(ValueError, match="selective_option"):
        apply_ac(_Model(1), "selective", "op_all")


def _leaves(node):
    """Every entry of torch's SAC cache, however this torch nests it (op → list of outputs on
    torch 2.11; op → dict of outputs on 2.13 and later)."""
    if isinstance(node, dict):
        node = list(node.values())
    if isinstance(node, (list, tuple)):
        for item in node:
            yield from _leaves(item)
    else:
        yield node


@pytest.mark.parametrize("family,layer", [("llama", 0), ("qwen3", 0), ("deepseek_v2", 0), ("deepseek_v2", 1),
                                          ("qwen3_moe", 1)])
def test_the_plans_op_formula_equals_what_op_sac_saves(monkeypatch, family, layer):
    """The family's ``BlockActivations.op`` (fp32, CPU) against the storages op SAC keeps from one
    block's forward (the outputs its policy saves, read from torch's SAC cache) plus the block
    input: equal for dense blocks; MoE blocks within 1 % (the plan assumes balanced routing)."""
    import ray_titan.parallel.ac as ac

    caches = []
    real = ac.create_selective_checkpoint_contexts

    def recording(policy):
        forward, recompute = real(policy)
        caches.append(forward.storage)
        return forward, recompute

    monkeypatch.setattr(ac, "create_selective_checkpoint_contexts", recording)
    torch.manual_seed(0)
    model = build_model(family, "debug", vocab_size=258)
    model.init_weights(0)
    apply_ac(model, "selective", "op")
    b, s = 4, 128
    x = torch.randn(b, s, model.args.dim, requires_grad=True)
    model.layers[str(layer)](x, model.rope_cos[:s], model.rope_sin[:s])
    (cache,) = caches
    kept = {}
    for t in _leaves(cache):
        t = getattr(t, "val", None)  # a saved output; a recomputed one is a marker
        if isinstance(t, torch.Tensor):
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    saved = sum(kept.values()) + x.numel() * x.element_size()
    planned = get_spec(family).block_activations(model.args, layer, 4, s, "cpu", 1.0, 1).op * b * s
    assert planned == pytest.approx(saved, rel=0.01 if layer else 0)


class _Ranges(nn.Module):
    """A block that opens one profiler range more in its recomputation than in its forward, as a
    routed experts' FSDP2 unit inside a checkpointed block does (``FSDP::`` ranges)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2, bias=False)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        for _ in range(self.calls):  # before the block's ops, as FSDP2's pre-forward
            with torch.profiler.record_function("range"):
                pass
        return torch.tanh(self.lin(x))


def test_op_sac_tolerates_profiler_ranges_that_differ_in_the_recomputation():
    model = nn.Module()
    model.layers = nn.ModuleDict({"0": _Ranges()})
    apply_ac(model, "selective", "op")
    x = torch.randn(4, 2, requires_grad=True)
    model.layers["0"](x).sum().backward()  # torch's SAC matched ops by count: "not found in storage"
    assert model.layers["0"].calls == 2 and x.grad is not None
