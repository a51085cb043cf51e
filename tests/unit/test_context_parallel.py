"""Context parallelism's parts (``ray_titan.parallel.context``), without processes: the causal load
balancer gives every cp rank the same attention work (a contiguous split does not: the mutation
this catches, since it computes the same function), and the sharded mask is the whole sequence's.
On ranks: tests/integration/test_context_parallel_parity.py.
"""

from __future__ import annotations

import pytest
import torch

from ray_titan.models.decoder import document_causal_mask
from ray_titan.parallel.context import attention_work, balanced_indices, sharded_mask

SEQ, BATCH = 32, 2


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_the_balancer_splits_the_sequence_and_evens_the_causal_work(cp):
    seq = 16 * cp
    shares = [balanced_indices(seq, cp, r) for r in range(cp)]
    assert torch.equal(torch.cat(shares).sort().values, torch.arange(seq))  # a partition
    assert all(len(s) == seq // cp for s in shares)
    work = attention_work(seq, cp)
    assert len(set(work)) == 1 and sum(work) == seq * (seq + 1) // 2
    # What the balancer is for: a contiguous split gives the last rank far more work.
    contiguous = [int((torch.arange(r * seq // cp, (r + 1) * seq // cp) + 1).sum()) for r in range(cp)]
    assert contiguous[-1] > 2 * contiguous[0]
    with pytest.raises(ValueError, match="2·cp"):
        balanced_indices(seq + cp, cp, 0)


def positions() -> torch.Tensor:
    """``(BATCH, SEQ)`` positions within documents: several documents per sequence, crossing the
    chunk boundaries."""
    starts = [[0, 5, 13, 14, 27], [0, 9, 10, 21]]
    pos = torch.zeros(BATCH, SEQ, dtype=torch.int64)
    for b, s in enumerate(starts):
        for i, j in zip(s, [*s[1:], SEQ]):
            pos[b, i:j] = torch.arange(j - i)
    return pos


@pytest.mark.parametrize("cp", [2, 4])
def test_the_sharded_mask_is_the_whole_sequence_mask_at_the_shards_indices(cp):
    whole = positions()
    full = document_causal_mask(whole)
    gathered = torch.cat([balanced_indices(SEQ, cp, r) for r in range(cp)])
    for r in range(cp):
        local = balanced_indices(SEQ, cp, r)
        assert torch.equal(sharded_mask(whole, local, gathered), full[:, :, local][:, :, :, gathered])
        causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
        assert torch.equal(sharded_mask(None, local, gathered)[0, 0], causal[local][:, gathered])


def _validate(*flags: str):
    from ray_titan.config import load_config, merge_overrides
    from ray_titan.preflight.checks import validate_job
    from tests.conftest import REPO

    flags = merge_overrides(["--parallelism.pp=1", "--parallelism.dp_shard=1"], list(flags))
    return validate_job(load_config(REPO / "configs" / "debug_llama.toml", flags), check_data=False)


@pytest.mark.parametrize(("flags", "setting"), [
    (["--parallelism.cp=4", "--training.seq_len=36"], "training.seq_len = 36"),  # 36 = 4 · 9, not 8 · k
    (["--parallelism.cp=2", "--parallelism.tp=4", "--training.seq_len=36"], "training.seq_len = 36"),
    (["--parallelism.cp=2", "--model.name=gpt_oss"], "parallelism.cp = 2 is not supported for gpt_oss"),
    (["--parallelism.cp=2", "--model.name=qwen3_moe"], "parallelism.cp = 2 is not supported for qwen3_moe"),
    # Expert parallelism borrows from dp_shard only, never from cp (ray_titan.parallel.dims).
    (["--parallelism.cp=2", "--model.name=deepseek_v2", "--parallelism.ep=2"], "never from tp, cp"),
    # Gated DeltaNet's state runs along the whole sequence; MTP's shifted tokens cross the slices.
    (["--parallelism.cp=2", "--model.name=qwen3_5"], "parallelism.cp = 2 is not supported for qwen3_5"),
    (["--parallelism.cp=2", "--model.name=qwen3_5_moe"], "parallelism.cp = 2 is not supported for qwen3_5_moe"),
    (["--parallelism.cp=2", "--model.name=deepseek_v3", "--model.mtp_layers=1"], "model.mtp_layers = 1"),
])
def test_preflight_refuses_what_context_parallel_cannot_split(flags, setting):
    from ray_titan.config.schema import ConfigError

    with pytest.raises(ConfigError, match=setting):
        _validate(*flags)


def test_preflight_accepts_expert_parallel_under_context_parallel():
    """ep within dp_shard composes with cp (the routed experts FSDP-sharded over dp_shard / ep × cp)."""
    cfg = _validate("--parallelism.cp=2", "--model.name=deepseek_v3", "--parallelism.dp_shard=2",
                    "--parallelism.ep=2")
    assert (cfg.world_size, cfg.parallelism.ep, cfg.parallelism.cp) == (4, 2, 2)


def test_a_context_parallel_mesh_counts_its_workers_and_coordinates():
    from ray_titan.parallel.dims import ParallelDims

    cfg = _validate("--parallelism.cp=2", "--parallelism.dp_shard=2", "--parallelism.tp=2",
                    "--training.seq_len=64")
    assert cfg.world_size == 8
    dims = ParallelDims(dp_shard=2, cp=2, tp=2)
    # tp innermost, then cp, then dp_shard (torchtitan's order); the cp ranks share a dp rank.
    assert [(c["dp_shard"], c["cp"], c["tp"]) for c in map(dims.coords, range(8))] == [
        (d, c, t) for d in range(2) for c in range(2) for t in range(2)]
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert dims.fsdp and ParallelDims(cp=2).fsdp and dims.describe() == "pp=1 × dp_shard=2 × cp=2 × tp=2"


@pytest.mark.parametrize("rank", [0, 13])
def test_expert_meshes_under_context_parallel_follow_the_coordinates(rank, request):
    """ep = 2 within dp_shard = 4, cp = 2, HSDP over 2 replicas (16 ranks of a fake process group):
    a rank's ``ep`` group is the ranks differing only in their ep coordinate (the same cp rank: the
    tokens exchanged are of one cp slice), and its experts' FSDP mesh (``efsdp``) every rank of
    its pp, tp and ep coordinates, ``(dp_replicate, dp_shard / ep × cp)``."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ray_titan.parallel.dims import ParallelDims
    from ray_titan.preflight.checks import _torch_before

    if _torch_before(2, 13):  # pre-flight refuses this mesh there (the test below)
        pytest.skip(f"torch {torch.__version__}'s DeviceMesh cannot slice a non-contiguous flattened dim")
    dims = ParallelDims(dp_replicate=2, dp_shard=4, cp=2, ep=2)
    coords = [dims.coords(r) for r in range(dims.world_size)]
    me = coords[rank]
    def outside_ep(c: dict[str, int]) -> tuple[int, int, int]:
        return c["dp_replicate"], c["dp_shard"] // dims.ep, c["cp"]

    ep_ranks = [r for r, c in enumerate(coords) if outside_ep(c) == outside_ep(me)]
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world_size)
    request.addfinalizer(dist.destroy_process_group)
    meshes = dims.build_mesh("cpu")
    assert meshes["ep"].mesh.tolist() == ep_ranks and [coords[r]["ep"] for r in ep_ranks] == [0, 1]
    efsdp = meshes["efsdp"]
    assert efsdp.mesh_dim_names == ("dp_replicate", "dp_shard_mod_ep_cp") and tuple(efsdp.mesh.shape) == (2, 4)
    assert sorted(efsdp.mesh.flatten().tolist()) == [r for r, c in enumerate(coords) if c["ep"] == me["ep"]]
    # Each replica's row is one FSDP shard group: the cp ranks of the dp_shard ranks of this ep rank.
    assert {coords[r]["dp_replicate"] for r in efsdp.mesh[me["dp_replicate"]].tolist()} == {me["dp_replicate"]}


def test_the_causal_chunks_of_a_long_sequence_hold_no_host_memory(request):
    """At 131,072 tokens on cp = 2 each rank's two lower-right causal masks stand for 32,768 × up to
    131,072 positions; torch's own ``causal_lower_right`` would allocate a (2, 32,768, 131,072)
    fp32 tensor (32 GiB) for each at build time. They hold nothing, and mask as torch's does."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ray_titan.parallel.context import ContextParallel, _LowerRightCausal

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    request.addfinalizer(dist.destroy_process_group)
    cp = ContextParallel(dist.group.WORLD, 131_072)
    assert [end for end, _ in cp._causal] == [32_768, 131_072]
    assert all(bias.untyped_storage().nbytes() == 0 for _, bias in cp._causal)
    q, k, v = (torch.randn(1, 2, n, 8, generator=torch.Generator().manual_seed(n)) for n in (4, 12, 12))
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, attn_mask=_LowerRightCausal(4, 12)),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(4, 12)))


def test_the_layout_line_shows_the_cp_coordinate():
    """The console's layout line (``console.layout_line``) names each node's cp span beside the
    other axes, from the ranks' mesh coordinates."""
    import numpy as np

    from ray_titan.metrics.collector.console import layout_line
    from ray_titan.parallel.dims import ParallelDims

    dims = ParallelDims(pp=2, dp_shard=2, cp=2)
    ranks = np.arange(dims.world_size)
    line = layout_line(ranks, ["node-a"] * 4 + ["node-b"] * 4, [dims.coords(int(r)) for r in ranks])
    assert "node node-a: ranks 0-3 (pp=0 × dp_shard=0-1 × cp=0-1)" in line, line
    assert "node node-b: ranks 4-7 (pp=1 × dp_shard=0-1 × cp=0-1)" in line, line


def test_preflight_refuses_experts_under_cp_with_replicas_before_torch_2_13(monkeypatch):
    """torch 2.11's DeviceMesh cannot slice the experts' ``(dp_replicate, dp_shard_mod_ep_cp)``
    mesh (its flattened dim is not contiguous): refused before any worker starts, naming the
    settings and the torch that would do; accepted on a torch that slices it."""
    from ray_titan.config import load_config
    from ray_titan.config.schema import ConfigError
    from ray_titan.preflight.checks import validate_job
    from tests.conftest import REPO

    flags = ["--model.name=deepseek_v2", "--parallelism.pp=1", "--parallelism.cp=2", "--parallelism.dp_shard=2",
             "--parallelism.ep=2", "--parallelism.dp_replicate=2"]
    cfg = load_config(REPO / "configs" / "debug_deepseek.toml", flags)
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    with pytest.raises(ConfigError, match=r"parallelism.dp_replicate = 2 needs torch >= 2.13 \(this is 2.11.0"):
        validate_job(cfg)
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    validate_job(cfg)


def test_the_layers_share_one_additive_document_mask():
    """Under a document mask every attention of a stage gets the same additive bias (made once
    per mask and dtype, equal to what SDPA makes of the bool mask: the same outputs bit for bit),
    instead of each converting the bool mask and keeping its own copy for backward (4 fp32
    copies on the simulated GPU's cp8 row: 3 MiB more than one)."""
    import torch.nn.functional as F

    from ray_titan.parallel.context import ContextParallel

    cp = ContextParallel.__new__(ContextParallel)  # the method needs no process group
    cp._bias = None
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(2, 1, 8, 16, generator=g) < 0.7
    mask[..., 0] = True  # no row without a key
    q, k, v = (torch.randn(2, 4, n, 8, generator=g) for n in (8, 16, 16))
    bias = cp._additive(mask, torch.float32)
    assert bias.dtype == torch.float32 and cp._additive(mask, torch.float32) is bias
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=bias),
                       F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    other = cp._additive(mask.clone(), torch.float32)  # another mask (the next microbatch): its own
    assert other is not bias and torch.equal(other, bias)
    half = cp._additive(mask, torch.bfloat16)  # another dtype: its own
    assert half.dtype == torch.bfloat16 and cp._additive(mask, torch.bfloat16) is half
