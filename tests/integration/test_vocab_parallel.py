"""The tp-split token embedding (``ray_titan.parallel.tp.VocabParallelEmbedding``) on two gloo
ranks: the same rows and the same gradient as one ``nn.Embedding``, with the gradient kept as
each rank's own rows (``Shard(0)``, ``ceil(vocab / tp)`` rows), not a whole-vocabulary partial sum;
ids outside the vocabulary raise, as they do without tp."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ray_titan.parallel.tp import VocabParallelEmbedding


def _parity(mesh, rank: int, world: int, vocab: int, sequence_parallel: bool) -> None:
    torch.manual_seed(0)
    ref = nn.Embedding(vocab, 6)
    emb = nn.Embedding(vocab, 6)
    emb.load_state_dict(ref.state_dict())
    layout = Shard(1) if sequence_parallel else Replicate()
    VocabParallelEmbedding(output_layout=layout)._apply(emb, mesh)
    ids = torch.randint(0, vocab, (2, 8))
    ids[0, :2] = torch.tensor([0, vocab - 1])  # the first row of rank 0 and the last of the last rank
    out = emb(ids)
    whole = ref(ids)
    # Under SP each rank's loss is of its own tokens (the global loss their sum); replicated
    # outputs carry one loss, the same on every rank.
    weights = torch.arange(whole.numel(), dtype=torch.float32).view_as(whole)
    mine = weights.chunk(world, dim=1)[rank] if sequence_parallel else weights
    assert torch.equal(out, whole.chunk(world, dim=1)[rank] if sequence_parallel else whole)
    (out * mine).sum().backward()
    (whole * weights).sum().backward()
    grad = emb.weight.grad
    assert isinstance(grad, DTensor) and grad.placements == (Shard(0),)
    rows = -(-vocab // world)
    assert grad.to_local().shape == (min(rows, vocab - rank * rows), 6)
    assert torch.allclose(grad.full_tensor(), ref.weight.grad)


def _out_of_range_ids_raise(mesh) -> None:
    """Ids at the vocabulary's end, negative or 2^40 raise as one nn.Embedding's do, on every
    rank before any collective (they used to give zero rows)."""
    ref = nn.Embedding(10, 6)
    emb = nn.Embedding(10, 6)
    VocabParallelEmbedding(output_layout=Replicate())._apply(emb, mesh)
    for bad in (10, -1, 2**40):
        ids = torch.tensor([[1, bad, 2]])
        with pytest.raises(IndexError, match="index out of range"):
            ref(ids)
        with pytest.raises(RuntimeError, match=r"a token id outside the vocabulary \[0, 10\)"):
            emb(ids)
    assert emb(torch.tensor([[0, 9]])).shape == (1, 2, 6)  # the ends of the range still look up


def _checks(rank: int, world: int, init: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        _parity(mesh, rank, world, 10, sequence_parallel=True)
        _parity(mesh, rank, world, 11, sequence_parallel=False)  # uneven: 6 rows and 5
        _out_of_range_ids_raise(mesh)
        with pytest.raises(ValueError, match=r"a vocabulary of 1 split 2 ways .* leaves the last tp rank no rows"):
            VocabParallelEmbedding(output_layout=Replicate())._apply(nn.Embedding(1, 4), mesh)
        with pytest.raises(TypeError, match="plain nn.Embedding"):
            VocabParallelEmbedding(output_layout=Replicate())._apply(nn.Embedding(9, 4, padding_idx=0), mesh)
    finally:
        dist.destroy_process_group()
    # A spawned child finalizes the interpreter, where gloo groups the mesh still holds can abort
    # the process (seen in test_moe_parity): passed, so leave without finalizing.
    os._exit(0)


def test_the_split_embedding_matches_one_embedding_and_keeps_its_own_rows_gradient(tmp_path):
    """Sequence parallel (vocab 10) and replicated output (vocab 11, uneven shards); ids outside
    the vocabulary raise as without tp; a split that leaves a rank no rows, or a padded embedding,
    is refused."""
    mp.spawn(_checks, args=(2, f"file://{tmp_path / 'store'}"), nprocs=2)
