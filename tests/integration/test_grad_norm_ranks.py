"""The gradient norm over four ranks (gloo): one all-reduce that gives every rank the whole
model's norm, whatever the gradients' placements, and the flags riding with it."""

from __future__ import annotations

import torch

from ray_titan.parallel.grad_norm import clip_grad_norm_


def _grads(mesh, placements_list, shapes, seed: int) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    """Parameters on ``mesh`` (None: plain tensors) with gradients of the given placements, and
    the full gradients, the same on every rank (seeded)."""
    from torch.distributed.tensor import Partial, distribute_tensor

    gen = torch.Generator().manual_seed(seed)
    params, fulls = [], []
    for placements, shape in zip(placements_list, shapes):
        full = torch.randn(shape, generator=gen)
        if placements is None:
            p = torch.nn.Parameter(torch.zeros(shape))
            p.grad = full.clone()
        elif any(isinstance(x, Partial) for x in placements):
            from torch.distributed.tensor import DTensor, Replicate

            # Each rank of the Partial dim holds a different addend; their sum is ``full``.
            i = next(k for k, x in enumerate(placements) if isinstance(x, Partial))
            n, me = mesh.size(i), mesh.get_local_rank(i)
            noise = torch.randn((n, *shape), generator=gen)
            local = full / n + noise[me] - noise.mean(0)
            p = torch.nn.Parameter(distribute_tensor(torch.zeros(shape), mesh, [Replicate()] * mesh.ndim))
            p.grad = DTensor.from_local(local, mesh, placements, run_check=False)
        else:
            p = torch.nn.Parameter(distribute_tensor(torch.zeros(shape), mesh, placements))
            p.grad = distribute_tensor(full, mesh, placements)
        params.append(p)
        fulls.append(full)
    return params, fulls


def _norm_checks(rank: int, world: int, init: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        # dp_shard 2 × tp 2: FSDP-like shards (uneven too), 2-D shards, a 1-D submesh (identical
        # across tp), a pending Partial over tp, and a plain tensor the same everywhere.
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        kinds = [(Shard(0), Replicate()), (Shard(0), Shard(1)), "dp", (Replicate(), Partial()), None]
        shapes = [(6, 4), (5, 3), (7, 2), (3, 3), (9,)]
        placements = [(Shard(0),) if k == "dp" else k for k in kinds]
        params, fulls = [], []
        for k, pl, shape in zip(kinds, placements, shapes):
            ps, fs = _grads(mesh["dp_shard"] if k == "dp" else mesh, [pl], [shape], seed=len(params))
            params += ps
            fulls += fs
        want = torch.linalg.vector_norm(torch.cat([f.reshape(-1) for f in fulls]))
        flag = torch.tensor([float(rank == 3), 1.0])
        norm, summed = clip_grad_norm_(params, 1e9, flags=flag)
        torch.testing.assert_close(norm, want, rtol=1e-6, atol=0)
        assert summed is not None and summed.tolist() == [1.0, float(world)]
        # Two pipeline stages of dp_shard 2: each stage's own parameters, one norm for both.
        pp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
        stage = pp_mesh.get_local_rank(0)
        stage_params = [_grads(pp_mesh["dp_shard"], [(Shard(0),), None], [(5, 2), (4,)], seed=10 + s) for s in (0, 1)]
        want = torch.linalg.vector_norm(torch.cat([f.reshape(-1) for _, fs in stage_params for f in fs]))
        norm, summed = clip_grad_norm_(stage_params[stage][0], 0.5, pp_mesh["pp"].get_group())
        torch.testing.assert_close(norm, want, rtol=1e-6, atol=0)
        clipped = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in stage_params[stage][0]]
        torch.testing.assert_close(clipped, [f * (0.5 / (want + 1e-6)) for f in stage_params[stage][1]])
    finally:
        dist.destroy_process_group()


def test_one_all_reduce_gives_every_rank_the_whole_models_norm_and_the_summed_flags(tmp_path):
    """Four ranks (gloo): the norm of every placement a trainer's gradients take (FSDP shards,
    uneven and 2-D with tp, a submesh's, a pending Partial, plain tensors) and of two pipeline
    stages' different parameters is the norm of the full gradients; the flags come back summed;
    the gradients are clipped by it."""
    import torch.multiprocessing as mp

    mp.spawn(_norm_checks, args=(4, f"file://{tmp_path / 'store'}"), nprocs=4)
