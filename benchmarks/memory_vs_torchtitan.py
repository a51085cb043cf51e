"""Peak device memory of one rank, ray_titan beside torchtitan 0.3.0, on the simulated GPU:
``python -m benchmarks.run memory_vs_torchtitan`` (or ``python -m benchmarks.memory_vs_torchtitan
[--jobs NAME,...] [--steps N] [--json PATH]``).

For each job of :data:`JOBS` it simulates rank 0 of the job's mesh twice, each side on its own
code: ray_titan by ``ray-titan dry-run`` (:func:`ray_titan.dry_run.dry_run`), torchtitan by its
own ``Trainer`` (model built on ``meta`` from its flavor, ``parallelize_llama`` /
``parallelize_deepseekv3`` or ``pipeline_llm``, its AC wrappers, ``to_empty`` and
``init_weights``, its optimizer container, loss and ``train_step``) in a child process of
:func:`torchtitan_rank`, with torchtitan's own dry-run communication mode (``comm.mode =
"fake_backend"``: a fake process group of the job's world size). Both children run on the same
simulated device, ray_titan's (:mod:`ray_titan.dry_run`: the fake CUDA library, fake tensors,
the fused attention kernel a GPU picks) and measure with the same tally
(:class:`ray_titan.dry_run.tally._DeviceTally`: the live fake CUDA storages at the peak of the
build and the steps, by category: parameters, gradients, optimizer state, activations,
temporaries). Each side prints its peak by category, then one line per job::

    memory_vs_torchtitan job=NAME ray_titan_gib=X torchtitan_gib=Y ratio=X/Y

What torchtitan is given to run on the simulated GPU, and why (the CPU shims of
:mod:`benchmarks.torchtitan_cpu` where they apply):

- **triton stub**: torchtitan imports Triton kernels at import (:func:`benchmarks.torchtitan_cpu.install_triton_stub`).
- **attention**: torchtitan's language models default to FlexAttention with per-document
  masks, whose kernel needs ``torch.compile`` (Triton), which fake tensors on a simulated device
  cannot run. Its causal ``ScaledDotProductAttention`` takes its place, and on the simulated
  device SDPA is the fused flash kernel a GPU picks (as on ray_titan's side): both save the
  attention output and its log-sum-exp, no ``seq × seq`` scores, as FlexAttention would.
- **absent imports**: ``datasets`` (and the metric loggers, where absent) are absorbing stubs:
  torchtitan imports its Hugging Face data loaders at import; none runs here.
- **data**: random token ids of the job's shape (the values are meaningless on fake tensors).
- **weight init**: ``init_weights`` leaves the parameters as ``to_empty`` made them (DTensor's
  random ops are a higher-order op fake mode has no rule for; values are meaningless here).
- **the console log**: ``metrics_processor.log`` is skipped (host-side, it reads the times of
  torchtitan's data loader, which this benchmark bypasses).
- **MoE split sizes**: the dry run answers a dispatch's host split sizes as balanced routing of
  the tokens × top-k it routes; torchtitan's dispatcher tells it that count as ray_titan's does.
- **the device mesh**: built on real host tensors (its rank table), as ray_titan's dry run builds its own.
- **the pipeline**: the neighbour stages' shape metadata answered as on ray_titan's side
  (:func:`ray_titan.dry_run.fake_group._install_stage_meta_shims`) and torchtitan's microbatched
  ``schedule.step`` call translated (:func:`benchmarks.torchtitan_cpu._microbatch_step`).

Not installed (the ``bench`` extra: ``pip install --no-deps torchtitan==0.3.0``), torchtitan's
side is skipped with a line saying how to install it; ray_titan's side runs regardless.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray_titan.config.units import GiB

__all__ = ["JOBS", "TorchtitanJob", "compare", "job_line", "main", "ray_titan_overrides", "torchtitan_rank"]

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "configs" / "debug_llama.toml")
INSTALL = "pip install --no-deps torchtitan==0.3.0  (the bench extra)"

# ray_titan's (model name, flavor) -> torchtitan's (model module, flavor): the same dims and vocab.
FLAVORS = {("llama", "3.1-8B"): ("llama3", "8B"), ("llama", "3.1-70B"): ("llama3", "70B"),
           ("deepseek_v3", "16B"): ("deepseek_v3", "16B")}


@dataclass(frozen=True)
class TorchtitanJob:
    """One job of the comparison, as both sides run it: ray_titan's ``model``/``flavor`` (the
    torchtitan flavor of :data:`FLAVORS`), the mesh (``dp`` = FSDP shard degree, ``tp``, ``ep``
    inside ``dp`` as in both trainers, ``pp``), ``local_batch`` sequences of ``seq`` tokens per
    data-parallel rank (``microbatches`` pipeline microbatches of them under ``pp``), AC ``ac``
    (``none``, ``full``, ``op``: torchtitan's op-level selective AC and ray_titan's
    ``selective_option = "op"``), and ``extra``: further ray_titan settings of the row
    (``--section.key=value``; e.g. a variant with a ray_titan lever torchtitan lacks)."""

    name: str
    model: str
    flavor: str
    dp: int
    seq: int
    local_batch: int
    ac: str
    tp: int = 1
    ep: int = 1
    pp: int = 1
    microbatches: int = 1
    extra: tuple[str, ...] = field(default=())

    @property
    def world(self) -> int:
        """The ranks of the job (``ep`` borrows from ``dp``)."""
        return self.dp * self.tp * self.pp

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over all data-parallel ranks."""
        return self.local_batch * self.dp


JOBS: list[TorchtitanJob] = [
    # torchtitan's published Llama 3.1 8B on 8 H100s (its benchmarks/llama3_h100_202412_torchtitan.md,
    # table 1): FSDP8, local batch 2 × 8,192.
    TorchtitanJob("llama8b_fsdp8_ac_none", "llama", "3.1-8B", dp=8, seq=8192, local_batch=2, ac="none"),
    TorchtitanJob("llama8b_fsdp8_ac_full", "llama", "3.1-8B", dp=8, seq=8192, local_batch=2, ac="full"),
    TorchtitanJob("llama8b_fsdp8_ac_op", "llama", "3.1-8B", dp=8, seq=8192, local_batch=2, ac="op"),
    # torchtitan's published Llama 3.1 70B on 256 H100s: FSDP32 × TP8, local batch 16 × 8,192, full AC.
    TorchtitanJob("llama70b_fsdp32_tp8_ac_full", "llama", "3.1-70B", dp=32, tp=8, seq=8192, local_batch=16,
                  ac="full"),
    # DeepSeek-V3 16B, FSDP8 × EP8 (EP inside FSDP: 8 ranks), local batch 4 × 4,096, op-level SAC.
    TorchtitanJob("dsv3_16b_fsdp8_ep8_ac_op", "deepseek_v3", "16B", dp=8, ep=8, seq=4096, local_batch=4, ac="op"),
    # Llama 3.1 70B on pp=8 × FSDP8 (64 ranks), 8 microbatches of one 8,192-token sequence, 1F1B, full AC.
    TorchtitanJob("llama70b_pp8_fsdp8_ac_full", "llama", "3.1-70B", dp=8, pp=8, seq=8192, local_batch=8,
                  microbatches=8, ac="full"),
]

_AC = {"none": ["--activation_checkpoint.mode=none"], "full": ["--activation_checkpoint.mode=full"],
       "op": ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_option=op"]}


def ray_titan_overrides(job: TorchtitanJob) -> list[str]:
    """The ``ray-titan dry-run`` overrides (on ``configs/debug_llama.toml``) of ``job``: its model,
    mesh, batch, AC, bf16 compute (FSDP2's bf16 parameters, fp32 gradient reduction: torchtitan's
    ``mixed_precision_param``/``_reduce`` defaults), AdamW, then ``job.extra``. The vocabulary is the
    flavor's (the dry run builds with it: 128,256 for Llama 3.1, 102,400 for DeepSeek-V3 16B).
    Loss parallel is ray_titan's default, as torchtitan 0.3.0's under tp (``_LossParallelCrossEntropy``)."""
    return [f"--model.name={job.model}", f"--model.flavor={job.flavor}", f"--parallelism.pp={job.pp}",
            "--parallelism.dp_replicate=1", f"--parallelism.dp_shard={job.dp}", f"--parallelism.tp={job.tp}",
            f"--parallelism.ep={job.ep}", "--parallelism.pipeline_schedule=1F1B",
            f"--parallelism.microbatches={job.microbatches}", f"--training.seq_len={job.seq}",
            f"--training.global_batch_size={job.global_batch}", "--training.mixed_precision=bf16",
            "--optimizer.name=AdamW", "--memory.cpu_offload=false", "--parallelism.loss_parallel=true",
            *_AC[job.ac], *job.extra]


def torchtitan_available() -> bool:
    """Whether torchtitan is importable here (without importing it: its import needs the shims)."""
    import importlib.util

    return importlib.util.find_spec("torchtitan") is not None


def job_line(name: str, ray_titan_bytes: int | None, torchtitan_bytes: int | None) -> str:
    """The closing line of a job: ``memory_vs_torchtitan job=NAME ray_titan_gib=X torchtitan_gib=Y
    ratio=R`` (GiB with 2 decimals, the ratio with 4; a side that did not run is ``-``, and so is the ratio)."""
    def gib(n: int | None) -> str:
        return f"{n / GiB:.2f}" if n is not None else "-"

    ratio = f"{ray_titan_bytes / torchtitan_bytes:.4f}" if ray_titan_bytes and torchtitan_bytes else "-"
    return (f"memory_vs_torchtitan job={name} ray_titan_gib={gib(ray_titan_bytes)} "
            f"torchtitan_gib={gib(torchtitan_bytes)} ratio={ratio}")


# --- torchtitan's side: one rank in a child process ---------------------------------------------


def _torchtitan_config(job: TorchtitanJob, steps: int, dump: str) -> Any:
    """torchtitan 0.3.0's ``Trainer.Config`` of ``job`` (call after the shims and torchtitan's import)."""
    import importlib

    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.components.validate import Validator
    from torchtitan.config import CommConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.trainer import Trainer

    module, flavor = FLAVORS[(job.model, job.flavor)]
    spec = importlib.import_module(f"torchtitan.models.{module}").model_registry(flavor)
    for layer in spec.model.layers:  # FlexAttention needs compiled kernels: its causal SDPA instead
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    ac = {"none": None, "full": FullAC.Config(), "op": SelectiveAC.Config()}[job.ac]
    return Trainer.Config(
        model_spec=spec, dump_folder=dump,
        tokenizer=_RandomTokens.Config(vocab=spec.model.vocab_size),
        dataloader=_RandomBatches.Config(vocab=spec.model.vocab_size),
        loss=CrossEntropyLoss.Config(global_vocab_size=spec.model.vocab_size),
        optimizer=default_adamw(lr=3e-4),
        training=TrainingConfig(local_batch_size=job.local_batch, global_batch_size=job.global_batch,
                                seq_len=job.seq, steps=steps, dtype="float32", mixed_precision_param="bfloat16",
                                disable_cuda_graphs=True),
        parallelism=ParallelismConfig(data_parallel_shard_degree=job.dp, tensor_parallel_degree=job.tp,
                                      expert_parallel_degree=job.ep, pipeline_parallel_degree=job.pp,
                                      pipeline_parallel_schedule="1F1B", spmd_backend="partial_dtensor",
                                      pipeline_parallel_microbatch_size=job.local_batch // job.microbatches),
        comm=CommConfig(mode="fake_backend"),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=ac,
        validator=Validator.Config(enable=False),
    )


# What torchtitan imports at its import for parts this benchmark does not run (its Hugging Face
# data loaders, metric loggers): stubs where the package is absent.
_UNUSED_IMPORTS = ("datasets", "datasets.distributed", "tensorboard", "torch.utils.tensorboard", "wandb")


def _stub_absent(*names: str) -> None:
    """An absorbing module (:class:`benchmarks.torchtitan_cpu._StubModule`) for each of ``names``
    that cannot be imported here."""
    import importlib

    from benchmarks.torchtitan_cpu import _StubModule

    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            sys.modules[name] = _StubModule(name)


_RandomTokens: Any = None
_RandomBatches: Any = None


def _define_components() -> None:
    """The tokenizer and dataloader torchtitan's ``Trainer`` builds (subclasses of its own, so
    defined after its import): a vocabulary size, and random token ids of the job's shape."""
    global _RandomTokens, _RandomBatches
    import torch
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    class RandomTokens(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab: int = 0

        def __init__(self, config: Any, **kwargs: Any) -> None:
            super().__init__()
            self.vocab = config.vocab

        def encode(self, *args: Any, **kwargs: Any) -> list[int]:
            return []

        def decode(self, *args: Any, **kwargs: Any) -> str:
            return ""

        def get_vocab_size(self) -> int:
            return self.vocab

    class RandomBatches(BaseDataLoader):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            vocab: int = 0

        def __init__(self, config: Any, *, local_batch_size: int, seq_len: int, **kwargs: Any) -> None:
            self.shape, self.vocab = (local_batch_size, seq_len), config.vocab

        def __iter__(self) -> Any:
            while True:
                x = torch.randint(0, self.vocab, self.shape)
                yield {"input": x}, x

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            pass

    _RandomTokens, _RandomBatches = RandomTokens, RandomBatches


def torchtitan_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """Rank 0 of ``spec["job"]`` (a :class:`TorchtitanJob` as a dict) trained ``spec["steps"]``
    steps by torchtitan 0.3.0's ``Trainer`` on the simulated GPU; returns the peak device bytes,
    the peak by category and its largest makers, the held state after the last step, seconds.
    Call only in a process where the fake CUDA library was loaded before torch (:func:`_child`)."""
    import torch

    from benchmarks.torchtitan_cpu import _microbatch_step, install_triton_stub
    from ray_titan.dry_run.fake_device import (
        _dry_run_mode,
        _install_op_shims,
        _install_torch_shims,
        _patch,
        _register_cuda_kernels,
        _stub_torch_cuda,
    )
    from ray_titan.dry_run.fake_group import _install_stage_meta_shims
    from ray_titan.dry_run.rank import _import_before_shims
    from ray_titan.dry_run.tally import _device_bytes, _DeviceTally, _owned_storages

    job = TorchtitanJob(**{**spec["job"], "extra": tuple(spec["job"].get("extra", ()))})
    _import_before_shims()
    install_triton_stub()
    _stub_absent(*_UNUSED_IMPORTS)
    _register_cuda_kernels(torch)
    _stub_torch_cuda(torch)
    tally = _DeviceTally()
    mode = _dry_run_mode(tally)
    _install_torch_shims(mode, tally)
    _install_op_shims(tally)
    import torchtitan.distributed.utils as tt_dist_utils
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    from torchtitan.distributed import parallel_dims as tt_dims

    _define_components()
    tt_dist_utils.set_pg_timeouts = lambda *a, **k: None
    build_mesh = tt_dims.ParallelDims.build_mesh

    def real_build_mesh(self: Any) -> Any:
        with unset_fake_temporarily():  # the mesh's rank table: real host tensors
            return build_mesh(self)

    _patch(tt_dims.ParallelDims, "build_mesh", real_build_mesh)
    # init_weights draws each parameter's values with DTensor's random ops (a higher-order op fake
    # mode has no rule for); on fake tensors values are meaningless: the parameters stay as made.
    from torchtitan.protocols import module as tt_module

    _patch(tt_module.Module, "_init_param", lambda self, name, param: None)
    # The MoE dispatch's split sizes (host lists of fake counts) are answered as balanced routing
    # of the tokens × top-k this dispatch routes, as on ray_titan's side.
    from torchtitan.models.common import token_dispatcher as tt_dispatch

    for cls in (tt_dispatch.LocalTokenDispatcher, tt_dispatch.AllToAllTokenDispatcher):
        _patch(cls, "dispatch", _counting_dispatch(cls.dispatch, tally))
    if job.pp > 1:
        from ray_titan.checkpoint import job_model_args
        from ray_titan.config import load_config

        dim = job_model_args(load_config(CONFIG, ray_titan_overrides(job))).dim
        _install_stage_meta_shims(type("Job", (), {"hidden": (job.local_batch // job.microbatches, job.seq, dim),
                                                  "hidden_dtype": torch.bfloat16})())
    os.environ.update(NGPU=str(job.world), RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(job.world))
    from torchtitan.trainer import Trainer

    t0 = time.perf_counter()
    with mode, tempfile.TemporaryDirectory(prefix="rt_tt_") as dump:
        trainer = Trainer(_torchtitan_config(job, spec["steps"], dump))
        built_s = time.perf_counter() - t0
        schedule = getattr(trainer, "pp_schedule", None)
        if schedule is not None:
            schedule.step = _microbatch_step(schedule)
        optimizers = trainer.optimizers.optimizers
        state: dict[Any, Any] = {}
        for opt in optimizers:
            state.update(opt.state)
        parts = type("Parts", (), {})()
        parts.optimizer = type("Opt", (), {"state": state})()
        parts.stages = dict(enumerate(trainer.model_parts))
        parts.schedule = schedule

        def owners() -> dict[int, str]:
            state.clear()
            for opt in optimizers:
                state.update(opt.state)
            return _owned_storages(parts)

        tally.owners = owners
        # The console log (host-side: times of a data loader this benchmark bypasses) is skipped.
        trainer.metrics_processor.log = lambda *a, **k: None
        fwd_bwd = trainer.forward_backward_step

        def tagged_forward_backward(*a: Any, **k: Any) -> Any:
            out = fwd_bwd(*a, **k)
            tally.phase = "step"  # clipping, until the optimizer's hooks
            return out

        trainer.forward_backward_step = tagged_forward_backward
        pre = register_optimizer_step_pre_hook(lambda *a: setattr(tally, "phase", "optimizer"))
        post = register_optimizer_step_post_hook(lambda *a: setattr(tally, "phase", "step"))
        batches = iter(trainer.dataloader)
        for step in range(1, spec["steps"] + 1):
            trainer.step = step
            tally.phase = "forward"
            trainer.train_step(batches)
        pre.remove()
        post.remove()
        tally.phase = "done"
        tally.finish()
    params = [p for m in trainer.model_parts for p in m.parameters()]
    owners()  # the optimizer state after the last step
    return {"peak_device_bytes": tally.peak, "peak_by_category": tally.by_category,
            "peak_top_ops": [list(t) for t in tally.top_ops],
            "held_bytes": {"parameters": _device_bytes(params), "gradients": _device_bytes(p.grad for p in params),
                           "optimizer_state": _device_bytes(v for st in state.values() for v in st.values())},
            "build_seconds": built_s, "seconds": time.perf_counter() - t0}


def _counting_dispatch(dispatch: Any, tally: Any) -> Any:
    """torchtitan's ``dispatch(x_TD, topk_scores_TK, topk_expert_ids_TK, ...)``, noting the tokens
    × top-k it routes in ``tally.routed`` first (what the dry run's host-list answer spreads)."""

    def counted(self: Any, x: Any, scores: Any, expert_ids: Any, *a: Any, **k: Any) -> Any:
        tally.routed = x.shape[0] * expert_ids.shape[1]
        return dispatch(self, x, scores, expert_ids, *a, **k)

    return counted


def _child(spec_path: str) -> int:
    """The child process of torchtitan's side: load the fake CUDA library before torch, run
    :func:`torchtitan_rank`, write its result (or the error) to the spec's ``out``."""
    import ctypes
    import traceback

    spec = json.loads(Path(spec_path).read_text())
    if spec.get("shim"):
        shim = ctypes.CDLL(spec["shim"], mode=os.RTLD_GLOBAL)
        import torch  # noqa: F401

        shim.rt_fake_cuda_install()
    try:
        result, code = torchtitan_rank(spec), 0
    except Exception as e:
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        code = 1
    Path(spec["out"]).write_text(json.dumps(result))
    return code


def run_torchtitan(job: TorchtitanJob, steps: int, timeout: float = 900.0) -> dict[str, Any]:
    """torchtitan's side of ``job`` in a child process (:func:`_child`); its result, or
    ``{"error": ...}``."""
    from dataclasses import asdict

    from ray_titan.dry_run.shim import build_shim

    shim = build_shim()
    with tempfile.TemporaryDirectory(prefix="rt_tt_spec_") as tmp:
        out = Path(tmp) / "out.json"
        spec_file = Path(tmp) / "spec.json"
        spec_file.write_text(json.dumps({"job": asdict(job), "steps": steps, "out": str(out),
                                         "shim": str(shim) if shim else None}))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
            [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
        try:
            proc = subprocess.run([sys.executable, "-m", "benchmarks.memory_vs_torchtitan", "--child", str(spec_file)],
                                  capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
        except subprocess.TimeoutExpired:
            return {"error": f"ran past {timeout:g} s"}
        if not out.is_file():
            return {"error": f"the child died (exit {proc.returncode}): {proc.stderr[-2000:]}"}
        return dict(json.loads(out.read_text()))


def run_ray_titan(job: TorchtitanJob, steps: int) -> dict[str, Any]:
    """ray_titan's side of ``job``: rank 0 by ``ray-titan dry-run``; its result, or ``{"error": ...}``."""
    from dataclasses import asdict

    from ray_titan.dry_run import dry_run

    t0 = time.perf_counter()
    try:
        (r,) = dry_run(CONFIG, ray_titan_overrides(job), ranks=[0], steps=steps, timeout=900.0)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {**asdict(r), "wall_seconds": time.perf_counter() - t0}


def _category_table(name: str, sides: dict[str, dict[str, Any]]) -> str:
    from ray_titan.dry_run.tally import CATEGORIES

    rows = [f"{name}: peak by category, GiB (simulated GPU, rank 0)",
            f"  {'side':<11}" + "".join(f"{c:>16}" for c in CATEGORIES) + f"{'peak':>10}{'seconds':>9}"]
    for side, r in sides.items():
        if "error" in r:
            rows.append(f"  {side:<11} {r['error'].splitlines()[0][:200]}")
            continue
        cats = r.get("peak_by_category", {})
        rows.append(f"  {side:<11}" + "".join(f"{cats.get(c, 0) / GiB:>16.2f}" for c in CATEGORIES)
                    + f"{r['peak_device_bytes'] / GiB:>10.2f}{r.get('seconds', 0):>9.1f}")
    return "\n".join(rows)


def compare(jobs: list[TorchtitanJob], steps: int = 2) -> tuple[list[dict[str, Any]], bool]:
    """Both sides of every job; prints each job's table as it finishes, then the job lines.
    Returns the results (one dict per job: ``name``, ``ray_titan``, ``torchtitan``) and whether
    any side failed (torchtitan absent is no failure)."""
    have_tt = torchtitan_available()
    if not have_tt:
        print(f"torchtitan is not installed: its side is skipped; install it with {INSTALL}", flush=True)
    results: list[dict[str, Any]] = []
    failed = False
    for job in jobs:
        sides = {"ray_titan": run_ray_titan(job, steps)}
        if have_tt:
            sides["torchtitan"] = run_torchtitan(job, steps)
        failed = failed or any("error" in r for r in sides.values())
        print(_category_table(job.name, sides), flush=True)
        results.append({"name": job.name, **sides})
    for r in results:
        print(job_line(r["name"], *(r.get(s, {}).get("peak_device_bytes") for s in ("ray_titan", "torchtitan"))))
    return results, failed


def rows_for_runner(quick: bool) -> list[Any]:
    """The runner's rows (``benchmarks.run``'s table): one per job, ray_titan's peak against
    torchtitan's (``quick``: the Llama 3.1 8B full-AC job only). The tables and the job lines are
    printed to stderr as each job finishes."""
    import contextlib

    from benchmarks.stats import Row

    jobs = select("llama8b_fsdp8_ac_full" if quick else None)
    with contextlib.redirect_stdout(sys.stderr):
        results, _ = compare(jobs)
    rows = []
    for r in results:
        rt, tt = (r.get(s, {}) for s in ("ray_titan", "torchtitan"))
        line = job_line(r["name"], rt.get("peak_device_bytes"), tt.get("peak_device_bytes"))
        rows.append(Row(f"memory_vs_torchtitan {r['name']}", "ray_titan peak",
                        f"{rt['peak_device_bytes'] / GiB:.2f} GiB" if "peak_device_bytes" in rt else "failed",
                        "torchtitan peak",
                        f"{tt['peak_device_bytes'] / GiB:.2f} GiB" if "peak_device_bytes" in tt else
                        tt.get("error", "not installed").splitlines()[0][:80],
                        target="ratio ≤ 1.00", note=line.rsplit(" ", 1)[-1], data=r))
    return rows


def select(names: str | None) -> list[TorchtitanJob]:
    """The jobs named (comma-separated), all if None; raises ``SystemExit`` naming an unknown one."""
    if not names:
        return list(JOBS)
    known = {j.name: j for j in JOBS}
    bad = [n for n in names.split(",") if n not in known]
    if bad:
        raise SystemExit(f"unknown job {bad[0]!r}; known: {', '.join(known)}")
    return [known[n] for n in names.split(",")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--jobs", help="comma-separated job names (default: all): " + ", ".join(j.name for j in JOBS))
    ap.add_argument("--steps", type=int, default=2, help="simulated steps per side (AdamW's state from step 1)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return _child(a.child)
    results, failed = compare(select(a.jobs), a.steps)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
