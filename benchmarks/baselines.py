"""The two loops ray_titan is measured against, written as their users would write them.

- :func:`bare_pytorch_loop`: one process, no Ray, no collector (nanoGPT style): the ceiling of
  one worker on this machine. Run as ``python -m benchmarks.baselines --config-json '...'``,
  so it has a process of its own like a ray_titan worker; prints its summary as JSON.
- :func:`plain_ray_train_loop`: the loop of Ray Train's PyTorch/FSDP2 guide: ``fully_shard``
  each block and the model, train, and ``ray.train.report(metrics)`` every step from every rank,
  the documented way to get metrics out of a Ray Train run.

Both use ray_titan's model, data, optimizer settings and LR schedule, so the comparison is on
the same model, data and batch; they time themselves with the same
:class:`~ray_titan.metrics.worker.timing.StepClock` as the train loop.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.nn.functional as F

from ray_titan.config import JobConfig
from ray_titan.data.corpus import load_texts
from ray_titan.data.loader import PackedLoader
from ray_titan.data.tokenizer import build_tokenizer
from ray_titan.metrics.worker.memory import host_memory
from ray_titan.metrics.worker.timing import StepClock
from ray_titan.models.registry import build_model
from ray_titan.trainer.build import build_lr_lambda

__all__ = ["bare_pytorch_loop", "plain_ray_train_loop"]


def _setup(cfg: JobConfig, dp_rank: int, dp_degree: int):
    torch.manual_seed(cfg.training.seed)
    if cfg.training.threads_per_worker:
        torch.set_num_threads(cfg.training.threads_per_worker)
    tok = build_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)
    loader = PackedLoader(load_texts(cfg.data), tok, cfg.training.seq_len, cfg.training.global_batch_size,
                          dp_rank=dp_rank, dp_degree=dp_degree, seed=cfg.training.seed)
    model = build_model(cfg.model.name, cfg.model.flavor, vocab_size=tok.vocab_size)
    model.init_weights(cfg.training.seed)
    return loader, model


def _optimizer(cfg: JobConfig, model: torch.nn.Module):
    o = cfg.optimizer
    # The same kernel as ray_titan's default (optimizer.implementation = "fused").
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay, fused=True)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, build_lr_lambda(cfg))


def _summary(clock: StepClock, tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
    rss, peak = host_memory()
    return {**clock.summary(), "tokens_per_step": tokens, "host_rss_bytes": rss,
            "host_peak_rss_bytes": peak, **extra}


def bare_pytorch_loop(cfg: JobConfig) -> dict[str, Any]:
    """Train ``cfg``'s model in this process (one worker, no microbatching): forward, loss,
    backward, clip, AdamW, LR step; the loss reaches the host only every ``metrics.log_freq``
    steps. Returns the :class:`StepClock` summary plus ``tokens_per_step``, host RSS and the
    last logged loss."""
    clock = StepClock(cfg.training.steps)
    clock.mark("loop_start")
    loader, model = _setup(cfg, 0, 1)
    opt, sched = _optimizer(cfg, model)
    clock.mark("model_built")
    logged = None
    for step in range(1, cfg.training.steps + 1):
        x, y = next(loader)
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % cfg.metrics.log_freq == 0:
            logged = loss.item()
        clock.step_end(step)
    return _summary(clock, y.numel(), {"last_logged_loss": logged})


def plain_ray_train_loop(config: dict[str, Any]) -> None:
    """Ray Train ``train_loop_per_worker`` as the FSDP2 guide writes it; ``config`` holds the
    job (``"job"``, a ``JobConfig`` dump) and ``"out_dir"``, where each rank writes its timing
    summary as ``rank{r}.json``."""
    from pathlib import Path

    import ray.train
    from torch.distributed.fsdp import fully_shard

    cfg = JobConfig.model_validate(config["job"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    clock = StepClock(cfg.training.steps)
    clock.mark("loop_start")
    loader, model = _setup(cfg, rank, world)
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    opt, sched = _optimizer(cfg, model)
    clock.mark("model_built")
    for step in range(1, cfg.training.steps + 1):
        x, y = next(loader)
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        ray.train.report({"step": step, "loss": loss.item()})
        clock.step_end(step)
    out = Path(config["out_dir"]) / f"rank{rank}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_summary(clock, y.numel(), {"rank": rank})))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="bare PyTorch baseline: prints its summary as JSON")
    ap.add_argument("--config-json", required=True, help="JobConfig as JSON")
    job = JobConfig.model_validate_json(ap.parse_args().config_json)
    print(json.dumps(bare_pytorch_loop(job)))
