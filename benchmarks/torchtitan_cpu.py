"""torchtitan 0.3.0 on CPU, as the ``torchtitan`` benchmark runs it (``python -m benchmarks.run
torchtitan``); the ``bench`` extra pins it. Run under ``torchrun`` as
``python -m benchmarks.torchtitan_cpu --config-json '<ray_titan JobConfig>' --out PATH``: it
trains torchtitan's own Llama 3 (``Llama3Model`` built from its config helpers) with its own
``Trainer`` (parallelize, pipeline schedule, loss, optimizer container, LR schedule, train loop)
at the shape, batch, optimizer, schedule and mesh of the given ray_titan job, and writes the
step timing summary of each rank (ray_titan's :class:`~ray_titan.metrics.worker.timing.StepClock`
around torchtitan's ``train_step``) and the losses torchtitan logged. With ``--device cuda``
(the ``gpu`` benchmark) it runs without the CPU shims below, as torchtitan runs on GPUs, and a
job's ``training.mixed_precision = "bf16"`` becomes torchtitan's ``mixed_precision_param``.

The shims, each the smallest change that lets torchtitan run here, and why:

- **triton**: torchtitan imports Triton kernels at module import (``@triton.jit``, ``tl.*``
  types in signatures); there is no Triton for CPU. :func:`install_triton_stub` puts a module
  that absorbs every attribute into ``sys.modules`` after torch has decided that Triton is
  absent (``has_triton_package``, cached), so inductor never sees it.
- **device module**: torchtitan picks its device type once, at import
  (``torch._utils._get_available_device_type() or "cuda"``); on a machine without an
  accelerator that is CUDA. It is made to answer ``"cpu"`` (``torch.cpu`` is the device module).
- **gloo instead of NCCL**: with the device type ``cpu``, torchtitan's process-group backend
  comes from ``Backend.default_device_backend_map["cpu"]``, which is gloo.
- **SDPA instead of compiled flex attention**: torchtitan's language models use FlexAttention
  with per-document masks, which needs ``torch.compile`` of the flex kernel (Triton). The inner
  attention is replaced by its causal ``ScaledDotProductAttention`` (no document mask: the
  sequences ray_titan packs attend causally across document boundaries too).
- **force-sum reduction for FSDP on gloo**: FSDP2 reduce-scatters gradients with
  ``ReduceOp.PREMUL_SUM`` (torchtitan sets the divide factor, its loss being already divided by
  the global token count), which gloo lacks; every FSDP module gets
  ``set_force_sum_reduction_for_comms(True)``: a plain SUM, the factor applied after it.
- **the schedule's microbatch call**: torchtitan calls ``schedule.step(arg_mbs=...,
  kwarg_mbs=..., target_mbs=...)`` with microbatches already split (its dataloader yields
  microbatches); this torch's ``_PipelineSchedule.step`` takes the whole batch and splits it.
  The call is translated to the schedule's ``_step_microbatches``, which ``step`` calls after
  its split (:func:`_microbatch_step`).
- **process-group timeouts**: after step 1 torchtitan shortens them with
  ``torch.distributed.set_timeout``, which this torch lacks; they stay at their start value.
- **data and tokenizer**: ray_titan's byte tokenizer and packed python_stdlib batches, so
  both sides see the same tokens (torchtitan's HF dataloader needs ``datasets`` and a download).

What torchtitan prints under PP: the loss is known only on the last stage; rank 0 (first
stage) logs a placeholder (``-1``) loss. This file records every rank's logged losses as
torchtitan produced them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["install_shims", "main", "torchtitan_config"]


class _Absorb:
    """Absorbs calls, attribute access and indexing; a bare decorator keeps its function."""

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return self

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self

    def __getitem__(self, item):
        return self


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absorb()


def install_triton_stub() -> None:
    """``triton`` and ``triton.language`` as absorbing modules, after torch cached that the real
    package is absent (so inductor and torch's own checks keep treating Triton as missing)."""
    # torch's modules that try `import triton` at their import, imported while it is absent.
    import torch._dynamo.backends.debugging
    import torch._inductor.compile_fx
    import torch._inductor.runtime.triton_compat  # noqa: F401
    from torch.utils._triton import has_triton_package

    assert not has_triton_package(), "a real triton is installed: the stub is not needed"
    for name in ("triton", "triton.language"):
        sys.modules.setdefault(name, _StubModule(name))
    sys.modules["triton"].language = sys.modules["triton.language"]  # type: ignore[attr-defined]


def cpu_device_module() -> types.ModuleType:
    """``torch.cpu`` plus what torchtitan asks of a device module (its memory monitor): a name,
    the capacity (host memory), and memory statistics, here the host RSS peak in bytes."""
    import platform

    from ray_titan.metrics.worker.memory import host_memory

    mod = types.ModuleType("torchtitan_cpu_device")
    for name in ("device_count", "synchronize", "set_device"):
        setattr(mod, name, getattr(torch.cpu, name))
    mod.current_device = lambda: 0  # type: ignore[attr-defined]  # an index (barrier device_ids), not "cpu"
    total = 0
    with open("/proc/meminfo") as f:
        total = int(f.readline().split()[1]) * 1024
    mod.get_device_name = lambda device=None: platform.processor() or "cpu"  # type: ignore[attr-defined]
    mod.get_device_properties = lambda device=None: types.SimpleNamespace(total_memory=total)  # type: ignore[attr-defined]
    mod.empty_cache = lambda: None  # type: ignore[attr-defined]
    mod.reset_peak_memory_stats = lambda device=None: None  # type: ignore[attr-defined]
    mod.memory_stats = lambda device=None: {  # type: ignore[attr-defined]
        "active_bytes.all.peak": host_memory()[1], "reserved_bytes.all.peak": host_memory()[1]}
    return mod


def install_shims() -> None:
    """Every shim of the module docstring that must precede torchtitan's import."""
    import torch._utils

    install_triton_stub()
    device_module = cpu_device_module()
    get_module = torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"  # and so gloo
    torch._utils._get_device_module = lambda t="cuda": device_module if t == "cpu" else get_module(t)


def torchtitan_config(cfg, out_dir: Path, fuse_qkv: bool = True):
    """torchtitan's ``Trainer.Config`` for ray_titan job ``cfg`` (a ``JobConfig``). ``fuse_qkv``:
    torchtitan's Llama 3 default, one q/k/v projection; False keeps three, as ray_titan and
    Hugging Face do (the layout's share of a step-time comparison)."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.components.validate import Validator
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.protocols.model_spec import ModelSpec
    from torchtitan.trainer import Trainer

    from ray_titan.models.registry import get_model_args

    args = get_model_args(cfg.model.name, cfg.model.flavor)
    vocab = _tokenizer(cfg).vocab_size
    dim, heads = args.dim, args.n_heads
    layers = llama3._build_llama3_layers(
        n_layers=args.n_layers, dim=dim, n_heads=heads, n_kv_heads=args.n_kv_heads,
        hidden_dim=args.ffn_hidden_dim, fuse_qkv=fuse_qkv, attn_backend="flex",
        rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=args.max_seq_len, theta=args.rope_theta,
                                scaling="none"),
    )
    for layer in layers:  # shim: SDPA, causal, in place of FlexAttention
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    model = llama3.Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)),
        layers=layers,
    )
    spec = ModelSpec(name="llama3", flavor="ray_titan_" + cfg.model.flavor, model=model,
                     parallelize_fn=llama3.parallelize_llama, pipelining_fn=llama3.pipeline_llm,
                     post_optimizer_build_fn=None, state_dict_adapter=None)
    par, o, t = cfg.parallelism, cfg.optimizer, cfg.training
    dp = par.dp_shard * par.dp_replicate
    local_batch = t.global_batch_size // dp
    return Trainer.Config(
        model_spec=spec,
        dump_folder=str(out_dir),
        tokenizer=ByteTokenizer.Config(job=cfg.model_dump_json()),
        dataloader=PackedDataLoader.Config(job=cfg.model_dump_json()),
        loss=CrossEntropyLoss.Config(global_vocab_size=vocab),
        optimizer=default_adamw(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=cfg.lr_scheduler.warmup_steps, decay_type="cosine",
                                                  min_lr_factor=cfg.lr_scheduler.min_lr_ratio),
        training=TrainingConfig(local_batch_size=local_batch, global_batch_size=t.global_batch_size,
                                seq_len=t.seq_len, steps=t.steps, max_norm=t.max_norm, dtype="float32",
                                mixed_precision_param="bfloat16" if t.mixed_precision == "bf16" else "float32",
                                gc_freq=t.gc_freq,
                                disable_cuda_graphs=True),
        parallelism=ParallelismConfig(
            data_parallel_shard_degree=par.dp_shard, pipeline_parallel_degree=par.pp,
            spmd_backend="partial_dtensor",  # classic FSDP2 (fully_shard on plain parameters)
            pipeline_parallel_schedule=par.pipeline_schedule,
            pipeline_parallel_microbatch_size=max(1, local_batch // par.microbatches),
        ),
        metrics=MetricsProcessor.Config(log_freq=cfg.metrics.log_freq),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=_ac_config(cfg),
        validator=Validator.Config(enable=False),
    )


def _ac_config(cfg):
    """torchtitan's activation checkpointing for the job's: none, ``FullAC`` or, for selective
    ``op``, ``SelectiveAC`` (its per-op policy, which ray_titan's ``op`` follows). Raises
    ValueError for selective checkpointing by layer count, which torchtitan 0.3.0 dropped."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    ac = cfg.activation_checkpoint
    if ac.mode == "none":
        return None
    if ac.mode == "full":
        return FullAC.Config()
    if ac.selective_option != "op":
        raise ValueError(f"activation_checkpoint.selective_option = {ac.selective_option!r}: torchtitan 0.3.0 "
                         "checkpoints selectively by op only")
    return SelectiveAC.Config()


def _tokenizer(cfg):
    from ray_titan.data.tokenizer import build_tokenizer

    return build_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)


def _job(text: str):
    from ray_titan.config import JobConfig

    return JobConfig.model_validate_json(text)


def _define_components() -> None:
    """The tokenizer and dataloader classes (they subclass torchtitan's, so they exist only
    after the shims and torchtitan's import)."""
    global ByteTokenizer, PackedDataLoader
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer
    from torchtitan.config import Configurable

    class ByteTokenizer(BaseTokenizer):  # type: ignore[no-redef]
        """ray_titan's tokenizer of the job (byte-level: 256 bytes + BOS + EOS)."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            job: str = ""

        def __init__(self, config: Config, **kwargs):
            super().__init__()
            self.tok = _tokenizer(_job(config.job))

        def encode(self, *args, **kwargs) -> list[int]:
            return self.tok.encode(*args, **kwargs)

        def decode(self, *args, **kwargs) -> str:
            return self.tok.decode(*args, **kwargs)

        def get_vocab_size(self) -> int:
            return self.tok.vocab_size

    class PackedDataLoader(BaseDataLoader):  # type: ignore[no-redef]
        """ray_titan's packed batches of this data-parallel rank, ``local_batch_size`` sequences
        at a time (a pipeline microbatch under PP), as ``({"input": x}, y)``."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            job: str = ""

        def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, local_batch_size: int, **kwargs):
            from ray_titan.data.corpus import load_texts
            from ray_titan.data.loader import PackedLoader

            cfg = _job(config.job)
            self.loader = PackedLoader(load_texts(cfg.data), _tokenizer(cfg), cfg.training.seq_len,
                                       local_batch_size * dp_world_size, dp_rank=dp_rank,
                                       dp_degree=dp_world_size, seed=cfg.training.seed)

        def __iter__(self):
            while True:
                x, y = next(self.loader)
                yield {"input": x}, y

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            pass

    del Configurable


def _microbatch_step(schedule):
    """torchtitan's call ``step(arg_mbs=, kwarg_mbs=, target_mbs=, losses=, loss_kwargs=,
    return_outputs=)`` (microbatches already split) on this torch's single-stage schedule, whose
    ``step`` takes the whole batch and splits it: what ``step`` does, minus the split."""

    def step(*, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, loss_kwargs=None,
             return_outputs=False):
        schedule._stage.has_backward = schedule._has_backward
        schedule._stage.clear_runtime_states()
        schedule._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs,
                                    loss_kwargs=loss_kwargs)

    return step


ByteTokenizer: Any = None
PackedDataLoader: Any = None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="torchtitan 0.3.0 on CPU at a ray_titan job's shape")
    ap.add_argument("--config-json", required=True, help="ray_titan JobConfig as JSON")
    ap.add_argument("--out", type=Path, required=True, help="folder for each rank's rank<r>.json")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: torchtitan as it runs on GPUs, without the CPU shims")
    ap.add_argument("--unfused-qkv", action="store_true",
                    help="separate q, k and v projections (ray_titan's and Hugging Face's layout)")
    a = ap.parse_args(argv)
    if a.device == "cpu":
        install_shims()
    _define_components()
    import torchtitan.distributed.utils as tt_dist_utils

    # shim: after step 1 torchtitan shortens the process-group timeouts with
    # torch.distributed.set_timeout, which this torch lacks; the timeouts stay at their start value.
    tt_dist_utils.set_pg_timeouts = lambda *args, **kwargs: None
    import torch.distributed as dist
    from torchtitan.trainer import Trainer

    from ray_titan.metrics.worker.memory import host_memory
    from ray_titan.metrics.worker.timing import StepClock

    cfg = _job(a.config_json)
    if cfg.training.threads_per_worker:
        torch.set_num_threads(cfg.training.threads_per_worker)
    clock = StepClock(cfg.training.steps)
    clock.mark("loop_start")
    trainer = Trainer(torchtitan_config(cfg, a.out / "torchtitan", fuse_qkv=not a.unfused_qkv))
    clock.mark("model_built")
    from torch.distributed.fsdp import FSDPModule

    for part in trainer.model_parts:  # shim: gloo has no PREMUL_SUM / AVG
        for m in part.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
    if getattr(trainer, "pp_schedule", None) is not None:
        trainer.pp_schedule.step = _microbatch_step(trainer.pp_schedule)  # type: ignore[method-assign]
    losses: list[float] = []
    inner = trainer.train_step

    def timed_step(*args, **kwargs):
        out = inner(*args, **kwargs)
        if a.device == "cuda":  # the step's end is its kernels' end (ray_titan's step reads its loss)
            torch.cuda.synchronize()
        clock.step_end(trainer.step)
        return out

    trainer.train_step = timed_step  # type: ignore[method-assign]
    log = trainer.metrics_processor.log

    def record_loss(step, global_avg_loss, *args, **kwargs):
        losses.append(float(global_avg_loss))
        return log(step, global_avg_loss, *args, **kwargs)

    trainer.metrics_processor.log = record_loss  # type: ignore[method-assign]
    trainer.train()
    rank = dist.get_rank() if dist.is_initialized() else 0
    rss, peak = host_memory()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"rank{rank}.json").write_text(json.dumps({
        **clock.summary(), "rank": rank, "logged_losses": losses, "host_rss_bytes": rss, "host_peak_rss_bytes": peak,
    }))
    trainer.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    # Finalizing the interpreter with gloo groups still referenced (DTensors, meshes) aborted a
    # finished run now and then ("terminate called without an active exception"): all is
    # written, so leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
