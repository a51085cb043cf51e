"""The Llama model, its flavors, deterministic init and pipeline splits (no Ray)."""

from __future__ import annotations

import math

import pytest
import torch

from ray_titan.models.decoder import count_parameters
from ray_titan.models.registry import build_model, get_model_args
from ray_titan.parallel.dims import ParallelDims
from ray_titan.parallel.pipeline import build_stage_module, split_layers


def test_llama3_8b_matches_the_model_card_on_meta():
    with torch.device("meta"):
        model = build_model("llama", "8B")
    n = count_parameters(model)
    assert round(n / 1e9, 2) == 8.03  # model card: 8.03 B
    assert n == 8_030_261_248
    assert all(p.is_meta for p in model.parameters())
    args = get_model_args("llama", "8B")
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.ffn_hidden_dim) == (4096, 32, 32, 8, 14336)


def test_debug_forward_shapes_and_initial_loss():
    model = build_model("llama", "debug")
    model.init_weights(0)
    tokens = torch.randint(0, 258, (2, 32))
    logits = model(tokens)
    assert logits.shape == (2, 32, 258)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    assert abs(loss.item() - math.log(258)) < 0.1  # small output init: near-uniform predictions


def test_attention_is_causal():
    model = build_model("llama", "debug")
    model.init_weights(0)
    a = torch.randint(0, 258, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 258
    assert torch.allclose(model(a)[0, :10], model(b)[0, :10], atol=1e-6)
    assert not torch.allclose(model(a)[0, 10:], model(b)[0, 10:])


def test_init_is_deterministic_and_seeded():
    a, b, c = (build_model("llama", "debug") for _ in range(3))
    a.init_weights(1), b.init_weights(1), c.init_weights(2)
    for (n, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(pa, pb), n
        if not n.endswith("norm.weight"):
            assert not torch.equal(pa, pc), n


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
def test_stage_weights_do_not_depend_on_the_split(num_stages):
    whole = build_model("llama", "debug")
    whole.init_weights(7)
    ref = dict(whole.named_parameters())
    with torch.device("meta"):
        meta = build_model("llama", "debug")
    seen = set()
    for s, layers in enumerate(split_layers(meta.args.n_layers, num_stages)):
        stage = build_stage_module(meta, layers, first=s == 0, last=s == num_stages - 1)
        stage.to_empty(device="cpu")
        stage.init_weights(7)
        for name, p in stage.named_parameters():
            assert torch.equal(p, ref[name]), name
            seen.add(name)
    assert seen == set(ref)  # the stages together hold the whole model, each parameter once


def test_stages_chained_equal_the_whole_model():
    whole = build_model("llama", "debug")
    whole.init_weights(3)
    tokens = torch.randint(0, 258, (2, 24))
    h = tokens
    for s, layers in enumerate(split_layers(4, 3)):
        stage = build_stage_module(whole, layers, first=s == 0, last=s == 2)
        h = stage(h)
    torch.testing.assert_close(h, whole(tokens), rtol=0, atol=0)


def test_split_layers_balances_with_embedding_and_head_counted():
    assert split_layers(4, 2) == [[0, 1], [2, 3]]
    assert split_layers(4, 4) == [[0], [1], [2], [3]]
    assert split_layers(6, 2) == [[0, 1, 2], [3, 4, 5]]
    # 8 layers + embedding + head over 4 stages: each stage weighs 2 or 3.
    parts = split_layers(8, 4)
    weights = [len(p) + (i == 0) + (i == 3) for i, p in enumerate(parts)]
    assert sum(len(p) for p in parts) == 8 and max(weights) - min(weights) <= 1
    for n, s in [(5, 2), (7, 3), (32, 4), (32, 8)]:
        parts = split_layers(n, s)
        assert [i for p in parts for i in p] == list(range(n)) and all(parts)
    with pytest.raises(ValueError):
        split_layers(2, 3)


def test_last_stage_ranks_come_from_the_stage_mapping():
    assert ParallelDims(pp=2, dp_shard=2).last_stage_ranks() == [2, 3]
    interleaved = ParallelDims(pp=2, dp_shard=2, stages_per_rank=2)
    assert interleaved.stages_on_pp_rank(0) == [0, 2] and interleaved.stages_on_pp_rank(1) == [1, 3]
    assert interleaved.last_stage_ranks() == [2, 3]
    assert ParallelDims(pp=3, dp_shard=1).last_stage_ranks() == [2]
    assert ParallelDims(pp=1, dp_shard=4).last_stage_ranks() == [0, 1, 2, 3]
    assert ParallelDims(pp=2, dp_shard=3).coords(4) == {"pp": 1, "dp_shard": 1}
    assert ParallelDims(pp=2, dp_shard=4, ep=2).coords(7) == {"pp": 1, "dp_shard": 3, "ep": 1}
