"""The correctness checks of the GPU acceptance run (``python -m benchmarks.run gpu``).

Each check is a function of a work folder and a ``device`` (``"cuda"`` on the GPU; ``"cpu"``
in the test suite, which runs the same logic with gloo) returning :class:`Check` results, each
pass/fail with a one-line reason. The judging of a run is a separate pure function, so a test
can show that a check fails when the behaviour it checks is broken.

Ranks on one GPU. NCCL refuses two ranks on one device, so when a job has more ranks than the
machine has GPUs, every rank uses ``cuda:0`` over gloo. Gloo's CUDA support is partial (broadcast
and all-reduce are documented; send/recv would hand gloo a device pointer), so in the check's
rank processes :func:`stage_collectives_through_host` routes what else the trainer sends
through host copies: pipeline P2P and the stages' warm-up and shape messages, FSDP2's flat
all-gather and reduce-scatter, expert parallelism's all-to-alls. The transport is not what is
checked; the trainer's device code is. With as many GPUs as ranks, NCCL, one GPU per rank.

Rank processes start as ``torchrun ... -m benchmarks.gpu_checks --device cuda|cpu [--stage]
--config X.toml [--section.key=value ...]``: ``ray_titan.launch`` with this process's device and
backend choice (:func:`rank_main`).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.harness import MEMORY_WARMUP, REPO, job_config, run_bounded, subprocess_flags
from ray_titan.callbacks import Callback, CallbackContext
from ray_titan.config.units import MiB

__all__ = [
    "Check", "ForceRouting", "check_cpu_checkpoint_resumes", "check_cpu_offload_parity",
    "check_ep_expert_without_tokens", "check_ep_rank_without_tokens", "check_oom_under_pp", "check_steady_run",
    "indexed", "judge_device_fields", "judge_device_memory_flat", "judge_host_verdict", "judge_oom", "judge_parity",
    "rank_main", "stage_collectives_through_host", "train_here",
]

PARITY_RTOL = 1e-3
"""Relative tolerance of fp32 loss parity between two runs on the device (1e-4 on CPU in the
suite; the device's reduction orders and a host optimizer step under offload differ more)."""
FLAT_MIB_PER_100_STEPS = 1.0
"""Device memory is flat when the Theil–Sen slope of allocated bytes after warm-up is below this."""


@dataclasses.dataclass
class Check:
    """One check's outcome: ``passed`` and a one-line ``reason``; ``data`` what was measured."""

    name: str
    passed: bool
    reason: str
    data: dict[str, Any] = dataclasses.field(default_factory=dict)


# -- collectives through host memory (ranks sharing one GPU over gloo) ---------------------------
class _Staged:
    """A collective run on host copies: ``wait()`` waits for it and copies the host results back
    into the device tensors (``copies``: ``(device tensor, host tensor)`` pairs). ``keep``: host
    tensors an in-flight send reads."""

    def __init__(self, work: Any = None, copies: Sequence[tuple[torch.Tensor, torch.Tensor]] = (), keep: Any = None):
        self.work, self.copies, self.keep = work, list(copies), keep

    def wait(self, timeout: Any = None) -> bool:
        if self.work is not None:
            self.work.wait()
        with torch.no_grad():  # a recv buffer is a leaf that requires grad (the stage's input)
            for dst, src in self.copies:
                dst.copy_(src)
        self.copies = []
        return True

    def is_completed(self) -> bool:
        return not self.copies and (self.work is None or self.work.is_completed())


STAGED: Counter[str] = Counter()
"""Collectives this process staged through host memory, by function name."""


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def staged_counts(stderr: str) -> dict[str, int]:
    """Collectives the ranks of a launch staged through host memory, summed over ranks, from the
    lines :func:`rank_main` prints."""
    out: Counter[str] = Counter()
    # Not anchored to a line start, and each count read up to its last digit: lines of ranks that
    # share one stderr can still run together ("...=1gpu_checks staged: ...").
    for m in re.finditer(r"gpu_checks staged: ((?:\w+=\d+ ?)*)", stderr):
        out.update({k: int(v) for k, v in re.findall(r"(\w+?)=(\d+)", m.group(1))})
    return dict(out)


def stage_collectives_through_host(force: bool = False) -> None:
    """Route FSDP2's flat all-gather and reduce-scatter (``dist.all_gather_single`` and
    ``dist.reduce_scatter_single`` where torch has them, ``dist.all_gather_into_tensor`` and
    ``dist.reduce_scatter_tensor``, which FSDP2 calls on torch 2.11), the pipeline schedules'
    send/recv (``torch.distributed.pipelining.schedules._batch_p2p``) and the stages' blocking and
    object send/recv (``dist.send``, ``dist.recv``, ``dist.send_object_list``,
    ``dist.recv_object_list``) through host copies when a tensor is not on the CPU, so gloo can
    carry them; ``force``: for CPU tensors too (how the suite exercises this code without a GPU).
    For this process only; call before the model is built."""
    from torch.distributed.pipelining import schedules

    def need(*ts: torch.Tensor) -> bool:
        return force or any(t.device.type != "cpu" for t in ts)

    for name in ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor"):
        if hasattr(dist, name):  # which of them FSDP2 calls depends on the torch release
            setattr(dist, name, _staged_flat_collective(name, getattr(dist, name), need))
    p2p = schedules._batch_p2p

    def batch_p2p(ops: list, desc: str | None = None) -> list:
        if not ops or not need(*(p.tensor for p in ops)):
            return p2p(ops, desc)
        STAGED["batch_p2p"] += 1
        works = []
        for p in ops:  # gloo's isend/irecv do not block: posting them one by one cannot deadlock
            if p.op is dist.isend:
                h = _host(p.tensor)
                works.append(_Staged(dist.isend(h, group=p.group, tag=p.tag, group_dst=p.group_peer), keep=h))
            else:
                h = torch.empty_like(p.tensor, device="cpu")
                works.append(_Staged(dist.irecv(h, group=p.group, tag=p.tag, group_src=p.group_peer), [(p.tensor, h)]))
        return works

    schedules._batch_p2p = batch_p2p  # type: ignore[assignment]
    _stage_point_to_point(need, force)
    _stage_all_to_all(need)


def _staged_flat_collective(name: str, fn: Any, need: Any) -> Any:
    """``fn``, a collective of ``dist`` whose first two parameters are the output and the input
    tensor (named differently across its kinds and torch releases; passed by position or by
    keyword), run on host copies when ``need(output, input)``, counted in :data:`STAGED` under
    ``name``; its ``async_op`` work is one already completed."""
    import inspect

    sig = inspect.signature(fn)
    out_name, in_name = list(sig.parameters)[:2]

    def staged(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        output, input = bound.arguments[out_name], bound.arguments[in_name]
        if not need(output, input):
            return fn(*args, **kwargs)
        STAGED[name] += 1
        async_op = bound.arguments.pop("async_op", False)
        host_out = torch.empty_like(output, device="cpu")
        bound.arguments[out_name], bound.arguments[in_name] = host_out, _host(input)
        fn(*bound.args, **bound.kwargs)
        _Staged(copies=[(output, host_out)]).wait()
        return _Staged() if async_op else None

    return staged


def _stage_all_to_all(need) -> None:
    """Expert parallelism's exchange (``ray_titan.parallel.expert``): the split sizes'
    ``dist.all_to_all_single`` and the tokens' functional ``all_to_all_single_autograd``, whose
    host copies (``.cpu()``, ``.to(device)``) are differentiable, so the backward's exchange
    goes through the host too."""
    from ray_titan.parallel import expert

    a2a, split_sizes = expert.all_to_all_single_autograd, dist.all_to_all_single

    def all_to_all_single_autograd(x, *args, **kwargs):
        if not need(x):
            return a2a(x, *args, **kwargs)
        STAGED["all_to_all_single_autograd"] += 1
        return a2a(x.cpu(), *args, **kwargs).to(x.device)

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        if not need(output, input):
            return split_sizes(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        STAGED["all_to_all_single"] += 1
        out = torch.empty_like(output, device="cpu")
        split_sizes(out, _host(input), output_split_sizes, input_split_sizes, group=group)
        _Staged(copies=[(output, out)]).wait()
        return _Staged() if async_op else None

    expert.all_to_all_single_autograd = all_to_all_single_autograd
    dist.all_to_all_single = all_to_all_single


def _stage_point_to_point(need, force: bool) -> None:
    """The blocking send/recv and the object send/recv of the pipeline stages' warm-up vote and
    shape inference (``torch.distributed.pipelining.stage``), through the host as in
    :func:`stage_collectives_through_host`."""
    send, recv, send_objects, recv_objects = dist.send, dist.recv, dist.send_object_list, dist.recv_object_list

    def send_(tensor, dst=None, group=None, tag=0, group_dst=None):
        if not need(tensor):
            return send(tensor, dst, group, tag, group_dst=group_dst)
        STAGED["send"] += 1
        return send(_host(tensor), dst, group, tag, group_dst=group_dst)

    def recv_(tensor, src=None, group=None, tag=0, group_src=None):
        if not need(tensor):
            return recv(tensor, src, group, tag, group_src=group_src)
        STAGED["recv"] += 1
        h = torch.empty_like(tensor, device="cpu")
        sender = recv(h, src, group, tag, group_src=group_src)
        _Staged(copies=[(tensor, h)]).wait()
        return sender

    def on_host(device) -> bool:  # the objects are pickled into a tensor on `device`: keep it on the host
        return device is not None and (force or torch.device(device).type != "cpu")

    def objects_on_host(fn, name: str):
        def call(*args, **kwargs):
            # (object_list, peer, group, device, ...): the objects are pickled into a tensor on `device`
            if len(args) > 3:
                args, kwargs = args[:3], {"device": args[3], **kwargs}
            if on_host(kwargs.get("device")):
                STAGED[name] += 1
                kwargs["device"] = None  # gloo's default: the host
            return fn(*args, **kwargs)
        return call

    send_object_list = objects_on_host(send_objects, "send_object_list")
    recv_object_list = objects_on_host(recv_objects, "recv_object_list")
    dist.send, dist.recv = send_, recv_
    dist.send_object_list, dist.recv_object_list = send_object_list, recv_object_list


def rank_main(argv: list[str] | None = None) -> None:
    """One rank of a check's launch: ``ray_titan.launch`` on ``--device``. On CUDA with fewer
    GPUs than ranks every rank takes ``cuda:LOCAL_RANK % GPUs`` over gloo with host-staged
    collectives (module docstring); ``--stage`` stages them on CPU too (the suite's test)."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_checks")
    ap.add_argument("--device", choices=["cpu", "cuda"], required=True)
    ap.add_argument("--stage", action="store_true", help="stage collectives through host copies on CPU too")
    a, rest = ap.parse_known_args(argv)
    from ray_titan.launch import torchrun as launch

    world, local = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))
    device, shared = torch.device("cpu"), False
    if a.device == "cuda":
        n = torch.cuda.device_count()
        device, shared = torch.device("cuda", local % n), n < world
        torch.cuda.set_device(device)
    launch.local_cuda_device = lambda: device
    if shared:  # NCCL refuses two ranks on one device
        launch.process_group_backend = lambda use_gpu, cpu_offload: "gloo"
    if shared or a.stage:
        stage_collectives_through_host(force=a.stage)
    try:
        launch.main(rest)
    finally:
        # One write, newline included: print() writes the text and its newline apart, and the
        # ranks share one stderr, so another rank's line could land between them.
        sys.stderr.write("gpu_checks staged: " + " ".join(f"{k}={v}" for k, v in sorted(STAGED.items())) + "\n")
        sys.stderr.flush()


# -- running jobs ---------------------------------------------------------------------------------
JOB_OVERRIDES: list[str] = []
"""Flags every check's job gets last (the suite points ``data.cache_dir`` at its corpus)."""
DEADLINE: float | None = None
"""``time.time()`` by which every rank launch must end (:func:`run_checks` sets it): a launch's
timeout is cut to what is left."""


def job(work: Path, name: str, *overrides: str):
    """The main job (``configs/debug_llama.toml``) with ``overrides``, run under ``work``."""
    return job_config(work, name, 50, "--metrics.enable_tensorboard=false", "--metrics.log_freq=1000",
                      *overrides, *JOB_OVERRIDES)


def indexed(device: torch.device) -> torch.device:
    """``device`` with its index: a bare ``cuda`` becomes the current CUDA device
    (``torch.cuda.set_device`` refuses a device without an index: the first GPU contact's
    ValueError in four checks, 2026-11-27). Other devices are returned as they are."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def train_here(cfg, device: torch.device | str, storage: Any = None, callbacks: list | None = None) -> dict[str, Any]:
    """``cfg`` on one rank in this process (``train_loop`` without Ray, the collector in
    process with the job's leak settings; ``callbacks``: worker-side, after the job's). Returns
    ``summary`` (the rank's), ``outcome`` (the collector's), ``run_dir`` and ``steps`` (the
    metrics table). Raises what ``train_loop`` raises."""
    from ray_titan.metrics.collector.collector import MetricsCollector
    from ray_titan.metrics.collector.leak import leak_settings
    from ray_titan.metrics.reading.steps import read_steps
    from ray_titan.metrics.worker.report import LocalReporter
    from ray_titan.preflight.checks import validate_job
    from ray_titan.run_dir import make_run_dir
    from ray_titan.trainer import train_loop

    cfg = validate_job(cfg)
    device = indexed(torch.device(device))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    run_dir = make_run_dir(cfg)
    collector = MetricsCollector(str(run_dir), 1, [0], cfg.training.steps, cfg.metrics.log_freq,
                                 cfg.metrics.flush_every_steps, False, leak_settings(cfg.memory), cfg.memory.on_leak)
    try:
        summary = train_loop(cfg, LocalReporter(collector), device, run_dir, callbacks=callbacks,
                             checkpoint_storage=storage)
    finally:
        outcome = collector.finish()
        if device.type == "cuda":
            gc.collect()  # the wrapped blocks' reference cycles hold the model until a collection
            torch.cuda.empty_cache()  # the next run (or torchtitan's process) gets the memory back
    return {"summary": summary, "outcome": outcome, "run_dir": run_dir, "steps": read_steps(run_dir).sort_by("step")}


def launch_ranks(device: str, cfg, stage: bool = False, toml: str = "", timeout: float = 600):
    """``cfg`` under ``torchrun --nproc-per-node=<mesh>`` through :func:`rank_main`; ``toml``:
    more of the config file (e.g. ``[[callbacks]]``, which has no flag form). Returns
    ``(completed process, run directory or None)``."""
    dump = Path(cfg.job.dump_folder) / f"ranks-{time.time_ns()}"
    dump.mkdir(parents=True)
    config = dump / "job.toml"
    config.write_text((REPO / "configs" / "debug_llama.toml").read_text() + "\n" + toml)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cfg.world_size}",
           "-m", "benchmarks.gpu_checks", f"--device={device}", *(["--stage"] if stage else []), f"--config={config}",
           *[f for f in subprocess_flags(cfg) if not f.startswith("--job.dump_folder=")], f"--job.dump_folder={dump}"]
    if DEADLINE is not None:
        timeout = min(timeout, max(1.0, DEADLINE - time.time()))
    proc = run_bounded(cmd, timeout, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    run_dirs = sorted(p for p in dump.glob("*") if p.is_dir())
    return proc, (run_dirs[0] if run_dirs else None)


def failure_line(stderr: str) -> str:
    """The line of a launch's stderr that says why it failed: the last ``...Error: ...`` or
    ``...Exception: ...`` line, a rank's ``[rankN]:`` prefix dropped (torchrun's own summary and its
    ``ChildFailedError``, which end the stream, say nothing), else
    the last non-blank line (at most 300 characters)."""
    lines = [re.sub(r"^\[(rank|default)\d*\]:\s*", "", x.strip()) for x in stderr.splitlines() if x.strip()]
    errors = [x for x in lines if re.match(r"^[\w.]*(Error|Exception)\b", x) and "ChildFailedError" not in x]
    return ((errors or lines or ["no stderr"])[-1])[:300]


def _expert_load(steps) -> dict[int, Any]:
    """Each rank's ``expert_load`` of the last step (the metrics table's column)."""
    import pyarrow.compute as pc

    last = steps.filter(pc.equal(steps["step"], pc.max(steps["step"])))
    return dict(zip(last["rank"].to_pylist(), last["expert_load"].to_pylist()))


def _rank_losses(steps, rank: int = 0) -> list[float]:
    import pyarrow.compute as pc

    return steps.filter(pc.equal(steps["rank"], rank)).sort_by("step")["step_loss"].to_pylist()


# -- (a) an OOM inside a pipeline stage's forward ------------------------------------------------
OOM_RANK, OOM_STEP = 1, 3


def judge_oom(returncode: int, stderr: str, device: str) -> Check:
    """Pass when the run failed with ``RankOutOfMemoryError`` naming rank :data:`OOM_RANK`, its
    stage and step :data:`OOM_STEP`, and the snapshot it names exists (a CUDA allocator
    snapshot ``.pickle`` on CUDA, the live-tensor ``.json`` on CPU)."""
    name = "OOM in a stage's forward under PP → RankOutOfMemoryError + snapshot"
    if returncode == 0:
        return Check(name, False, "the run finished: the injected out-of-memory error was swallowed")
    want = (f"RankOutOfMemoryError: rank {OOM_RANK} (pp={OOM_RANK}, dp_shard=0) ran out of memory at step "
            f"{OOM_STEP} in the forward of pipeline stage {OOM_RANK}")
    if want not in stderr:
        return Check(name, False, f"no '{want[:60]}...' in the ranks' stderr; it says: {failure_line(stderr)}")
    m = re.search(r"memory snapshot: (\S+) \(", stderr)
    suffix = ".pickle" if device == "cuda" else ".json"
    if m is None or not Path(m.group(1)).is_file() or not m.group(1).endswith(suffix):
        return Check(name, False, f"the error names no {suffix} snapshot file that exists "
                                  f"({m.group(1) if m else 'none named'})")
    return Check(name, True, f"rank {OOM_RANK}, stage {OOM_RANK}, step {OOM_STEP} named; snapshot {m.group(1)} "
                             f"({Path(m.group(1)).stat().st_size} bytes)", {"snapshot": m.group(1)})


def check_oom_under_pp(work: Path, device: str, stage: bool = False) -> Check:
    """pp=2 (two ranks; one GPU: both on it over gloo), an out-of-memory error raised inside the
    forward of rank 1's stage at step 3 (``ray_titan.callbacks.InjectOOM``: on CUDA
    ``torch.OutOfMemoryError``, whose path dumps the allocator's snapshot; on CPU ``MemoryError``)."""
    cfg = job(work, "oom", "--parallelism.pp=2", "--parallelism.dp_shard=1", "--parallelism.microbatches=2",
              f"--training.steps={OOM_STEP + 1}", "--checkpoint.enable=false")
    inject = ('[[callbacks]]\ntarget = "ray_titan.callbacks:InjectOOM"\n'
              f'kwargs = {{ rank = {OOM_RANK}, step = {OOM_STEP}, where = "forward", '
              f'host = {"true" if device == "cpu" else "false"} }}\n')
    proc, _ = launch_ranks(device, cfg, stage, inject)
    check = judge_oom(proc.returncode, proc.stderr, device)
    check.data["staged"] = staged_counts(proc.stderr)
    return check


# -- (b) memory.cpu_offload: parity with one rank without offload ---------------------------------
def judge_parity(name: str, got: Sequence[float | None], want: Sequence[float | None], rtol: float = PARITY_RTOL,
                 what: str = "") -> Check:
    """Pass when both loss lists have the same length, are all finite and agree within ``rtol``."""
    import math

    if len(got) != len(want) or not got:
        return Check(name, False, f"{len(got)} losses against {len(want)} {what}".strip())
    if any(x is None or not math.isfinite(x) for x in [*got, *want]):
        return Check(name, False, f"a loss is missing or not finite: {got} vs {want}")
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))  # type: ignore[operator,arg-type]
    data = {"losses": list(got), "reference": list(want), "max_rel_diff": worst}
    if worst > rtol:
        return Check(name, False, f"losses differ by up to {worst:.2e} (relative) > {rtol:g} {what}".strip(), data)
    return Check(name, True, f"{len(got)} step losses within {worst:.1e} (relative, ≤ {rtol:g}) {what}".strip(), data)


def check_cpu_offload_parity(work: Path, device: str, stage: bool = False, steps: int = 4) -> Check:
    """``memory.cpu_offload = true`` on dp_shard=2 (FSDP2's shards, gradients and optimizer step
    on the host), fp32, against one rank without offload on the same device: the same losses."""
    common = ("--parallelism.pp=1", "--parallelism.microbatches=1", f"--training.steps={steps}",
              "--training.mixed_precision=fp32", "--checkpoint.enable=false")
    name = "memory.cpu_offload = true: fp32 parity with one rank without offload"
    proc, run_dir = launch_ranks(device, job(work, "offload", *common, "--parallelism.dp_shard=2",
                                             "--memory.cpu_offload=true"), stage)
    if proc.returncode or run_dir is None:
        return Check(name, False, f"the offloaded run failed: {failure_line(proc.stderr)}")
    from ray_titan.metrics.reading.steps import read_steps

    ref = train_here(job(work, "offload_ref", *common, "--parallelism.dp_shard=1"), device)
    check = judge_parity(name, _rank_losses(read_steps(run_dir)), _rank_losses(ref["steps"]),
                         what="of the one-rank run")
    check.data["staged"] = staged_counts(proc.stderr)
    return check


# -- (c) a checkpoint saved on CPU, resumed on the device -----------------------------------------
def check_cpu_checkpoint_resumes(work: Path, device: str, steps: int = 4) -> Check:
    """One rank, fp32: ``steps`` steps on CPU saving a checkpoint at ``steps // 2``; the same
    job resumed from it on ``device`` must continue the CPU run's loss curve."""
    from ray_titan.checkpoint import LocalCheckpointStorage

    half = steps // 2
    common = ("--parallelism.pp=1", "--parallelism.dp_shard=1", "--parallelism.microbatches=1",
              f"--training.steps={steps}", "--training.mixed_precision=fp32")
    saved = job(work, "saved_on_cpu", *common, f"--checkpoint.interval={half}")
    cpu = train_here(saved, "cpu", LocalCheckpointStorage(Path(saved.job.dump_folder) / "ckpt", 3))
    ckpt = sorted((Path(saved.job.dump_folder) / "ckpt").glob(f"step-{half:08d}"))
    name = f"checkpoint saved on CPU resumes on {device}"
    if not ckpt:
        return Check(name, False, f"the CPU run saved no checkpoint of step {half}")
    resumed = train_here(job(work, "resumed", *common, "--checkpoint.enable=false",
                             f"--checkpoint.load_path={ckpt[0]}"), device)
    if resumed["steps"]["step"].to_pylist()[:1] != [half + 1]:
        return Check(name, False, f"the resumed run started at step {resumed['steps']['step'].to_pylist()[:1]}, "
                                  f"not {half + 1}")
    return judge_parity(name, _rank_losses(resumed["steps"]), _rank_losses(cpu["steps"])[half:],
                        what=f"of the CPU run's steps {half + 1}-{steps}")


# -- (d) experts that receive no tokens -----------------------------------------------------------
def check_ep_expert_without_tokens(device: str, tokens: int = 64) -> Check:
    """The DeepSeek-V2 debug MoE layer (8 experts, top 2) with the router's bias sending every
    token to experts 0 and 1, so 6 experts receive none (under ep=2, all of rank 1's): forward
    and backward on ``device`` (CUDA: bf16, where Hopper runs ``torch._grouped_mm`` with empty
    groups) against the fp32 per-expert loop on CPU. Pass: output and active experts' ``w1``
    gradient within 5 % (bf16; 1e-5 in fp32) of the reference, the idle experts' gradient
    exactly zero. One rank, the layer alone: :func:`check_ep_rank_without_tokens` trains the
    model under ep=2 in fp32, where the experts run the loop."""
    import copy

    from ray_titan.models.deepseek_v2.model import MoE, _use_grouped_mm, route_tokens
    from ray_titan.models.registry import get_model_args

    args = dataclasses.replace(get_model_args("deepseek_v2", "debug"), load_balance="aux_free")
    torch.manual_seed(0)
    ref = MoE(args)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.1)
    k, n = args.n_activated_experts, args.n_routed_experts
    ref.router.expert_bias[:k] = 9.0  # selection only (aux-free bias): experts k.. receive no tokens
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    moe = copy.deepcopy(ref).to(device=device, dtype=dtype)
    x = torch.randn(tokens, args.dim, generator=torch.Generator().manual_seed(1))
    grad_out = torch.randn(tokens, args.dim, generator=torch.Generator().manual_seed(2))

    def run(m: MoE, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w, i, _ = m.router(x)
        y = route_tokens(x, w, i, m.experts, m.n_experts)
        (gw1,) = torch.autograd.grad((y * g).sum(), [m.experts.w1])
        return y.detach().float().cpu(), gw1.float().cpu()

    want_y, want_g = run(ref, x, grad_out)
    got_y, got_g = run(moe, x.to(device, dtype), grad_out.to(device, dtype))
    path = "grouped GEMM" if _use_grouped_mm(x.to(device, dtype), moe.experts.w1) else "per-expert loop"
    return judge_experts(got_y, got_g, want_y, want_g, k, 5e-2 if dtype == torch.bfloat16 else 1e-5, path, n)


def judge_experts(got_y: torch.Tensor, got_g: torch.Tensor, want_y: torch.Tensor, want_g: torch.Tensor,
                  active: int, rtol: float, path: str, n: int) -> Check:
    """Pass when ``got_y`` and the first ``active`` experts' gradients ``got_g[:active]`` are within
    ``rtol`` of the reference (relative to its largest magnitude) and the other experts'
    gradients are exactly zero (``got_g (n_experts, hidden, dim)``)."""
    name = "MoE layer with experts receiving no tokens, bf16 (grouped GEMM's empty groups) vs fp32 loop"
    if not (torch.isfinite(got_y).all() and torch.isfinite(got_g).all()):
        return Check(name, False, f"{path}: a non-finite output or gradient")
    idle = got_g[active:].abs().max().item()
    if idle != 0:
        return Check(name, False, f"{path}: experts with no tokens got a nonzero w1 gradient (max |g| {idle:.3g})")
    ey = ((got_y - want_y).abs().max() / want_y.abs().max()).item()
    eg = ((got_g[:active] - want_g[:active]).abs().max() / want_g[:active].abs().max()).item()
    data = {"path": path, "output_rel_err": ey, "grad_rel_err": eg, "idle_experts": n - active}
    if max(ey, eg) > rtol:
        return Check(name, False, f"{path}: output off by {ey:.2e}, gradient by {eg:.2e} (> {rtol:g})", data)
    return Check(name, True, f"{path}, {n - active} of {n} experts idle: output within {ey:.1e}, gradient "
                             f"{eg:.1e} of the fp32 loop; idle experts' gradient exactly 0", data)


class ForceRouting(Callback):
    """Worker-side callback (``[[callbacks]] target = "benchmarks.gpu_checks:ForceRouting"``):
    before every router's forward, its selection bias is ``bias`` on the first ``experts``
    experts and 0 on the others, so (top-k ≤ ``experts``) only those receive tokens; under
    ep=2 with 8 experts and ``experts = 2``, rank 1's four experts receive none. Needs
    ``model.load_balance = "aux_free"`` (the bias takes part in the selection)."""

    def __init__(self, experts: int = 2, bias: float = 9.0):
        self.experts, self.bias = experts, bias
        self._handle: Any = None

    def on_train_start(self, ctx: CallbackContext) -> None:
        from torch.nn.modules.module import register_module_forward_pre_hook

        def hook(module: torch.nn.Module, args: Any) -> None:
            if type(module).__name__ == "Router" and hasattr(module, "expert_bias"):
                with torch.no_grad():
                    module.expert_bias.zero_()[: self.experts] = self.bias

        self._handle = register_module_forward_pre_hook(hook)

    def on_train_end(self, ctx: CallbackContext, error: BaseException | None = None) -> None:
        if self._handle is not None:
            self._handle.remove()


def check_ep_rank_without_tokens(work: Path, device: str, stage: bool = False, steps: int = 3) -> Check:
    """The MoE job's model (DeepSeek-V2 debug, 8 experts, top 2) on dp_shard=2 × ep=2, fp32, with
    :class:`ForceRouting` sending every token to experts 0 and 1, so rank 1's experts receive
    none: it trains and matches one rank under the same routing (losses within
    :data:`PARITY_RTOL`). One GPU: the ranks' all-to-alls through host copies (module docstring)."""
    common = ("--parallelism.pp=1", "--parallelism.microbatches=1", f"--training.steps={steps}",
              "--training.mixed_precision=fp32", "--checkpoint.enable=false", "--model.name=deepseek_v2",
              "--model.flavor=debug", "--model.load_balance=aux_free")
    force = '[[callbacks]]\ntarget = "benchmarks.gpu_checks:ForceRouting"\n'
    name = "expert-parallel step, rank 1 receiving no tokens: parity with one rank"
    proc, run_dir = launch_ranks(device, job(work, "ep", *common, "--parallelism.dp_shard=2",
                                             "--parallelism.ep=2"), stage, force)
    if proc.returncode or run_dir is None:
        return Check(name, False, f"the ep=2 run failed: {failure_line(proc.stderr)}")
    from ray_titan.metrics.reading.steps import read_steps

    ref = train_here(job(work, "ep_ref", *common, "--parallelism.dp_shard=1"), device, callbacks=[ForceRouting()])
    steps_table = read_steps(run_dir)
    check = judge_parity(name, _rank_losses(steps_table), _rank_losses(ref["steps"]), what="of one rank")
    load = _expert_load(steps_table).get(1) or []
    check.data.update(staged=staged_counts(proc.stderr), expert_load=load)
    idle = [sum(layer[len(layer) // 2:]) for layer in load]  # rank 1 holds the second half under ep=2
    if check.passed and (not idle or any(idle)):
        return Check(name, False, f"rank 1's experts received tokens (last step, per MoE layer: {idle})", check.data)
    if check.passed:
        check.reason += f"; rank 1's experts received 0 tokens in all {len(idle)} MoE layers"
    return check


# -- (e, f, g) a long run with the default settings ------------------------------------------------
def judge_host_verdict(verdicts: Sequence[str | None]) -> Check:
    """Pass when no step's host memory verdict is ``growing`` (``warming_up`` and ``stable`` are)."""
    from collections import Counter

    name = "host memory verdict stable (default settings)"
    counts = Counter(v for v in verdicts if v is not None)
    if not counts:
        return Check(name, False, "no step has a memory verdict")
    text = ", ".join(f"{v} × {c}" for v, c in sorted(counts.items()))
    return Check(name, "growing" not in counts, f"{len(verdicts)} steps: {text}; last {verdicts[-1]}",
                 {"verdicts": dict(counts)})


def judge_device_memory_flat(steps: Sequence[int], allocated: Sequence[int | None], warmup: int) -> Check:
    """Pass when the Theil–Sen slope of device allocated bytes over the steps after ``warmup`` is
    below :data:`FLAT_MIB_PER_100_STEPS` MiB per 100 steps (``ray_titan.metrics.collector.leak.theil_sen_slope``)."""
    from ray_titan.metrics.collector.leak import theil_sen_slope

    name = f"device memory flat after step {warmup} (Theil–Sen)"
    pts = [(s, a) for s, a in zip(steps, allocated) if s > warmup and a is not None]
    if len(pts) < 2:
        return Check(name, False, f"{len(pts)} steps after warm-up with device_allocated_bytes: nothing to fit")
    slope = theil_sen_slope([p[0] for p in pts], [p[1] for p in pts]) * 100 / MiB
    return Check(name, abs(slope) < FLAT_MIB_PER_100_STEPS,
                 f"{slope:+.3f} MiB per 100 steps over {len(pts)} steps (flat: |slope| < {FLAT_MIB_PER_100_STEPS:g})",
                 {"slope_mib_per_100_steps": slope, "steps": len(pts)})


def judge_device_fields(table) -> Check:
    """Pass when the metrics table has ``device_*`` columns and none has a null on any step."""
    name = "collector's device fields filled"
    cols = [c for c in table.column_names if c.startswith("device_")]
    if not cols:
        return Check(name, False, "the metrics table has no device_* column")
    empty = {c: table[c].null_count for c in cols if table[c].null_count}
    if empty:
        return Check(name, False, f"null on some of {table.num_rows} steps: "
                                  + ", ".join(f"{c} × {v}" for c, v in empty.items()))
    return Check(name, True, f"{len(cols)} device_* fields on all {table.num_rows} steps",
                 {"fields": cols, "last": {c: table[c][-1].as_py() for c in cols}})


def check_steady_run(work: Path, device: str, steps: int = 200) -> list[Check]:
    """The main job's model on one rank for ``steps`` steps with the default memory and metrics
    settings: the host verdict, device memory after warm-up (``min(100, steps // 2)`` steps,
    as the ``memory`` benchmark) and the device fields of every step."""
    cfg = job(work, "steady", "--parallelism.pp=1", "--parallelism.dp_shard=1", "--parallelism.microbatches=1",
              f"--training.steps={steps}")
    t = train_here(cfg, device)["steps"]
    warmup = min(MEMORY_WARMUP, steps // 2)
    return [judge_host_verdict(t["memory_verdict"].to_pylist()),
            judge_device_memory_flat(t["step"].to_pylist(), t["device_allocated_bytes"].to_pylist()
                                     if "device_allocated_bytes" in t.column_names else [], warmup),
            judge_device_fields(t)]


def run_checks(work: Path, device: str, steps: int = 200, stage: bool = False, skip: Sequence[str] = (),
               until: float | None = None, on_check: Callable[[Check], None] | None = None) -> list[Check]:
    """Every check on ``device`` but those named in ``skip`` (``steps``: of the long run;
    ``stage``: stage the ranks' collectives through host memory even on CPU), each caught: a
    check that raises (a rank launch past ``until``, a ``time.time()``, included) fails.
    ``on_check``: called with each result the moment it is known."""
    global DEADLINE
    DEADLINE = until  # read by launch_ranks; reset below, so a later launch in this process has none
    try:
        return _run_checks(work, device, steps, stage, skip, on_check)
    finally:
        DEADLINE = None


def _run_checks(work: Path, device: str, steps: int, stage: bool, skip: Sequence[str],
                on_check: Callable[[Check], None] | None) -> list[Check]:
    out: list[Check] = []
    for name, fn in (
        ("OOM under PP", lambda: [check_oom_under_pp(work, device, stage)]),
        ("cpu_offload parity", lambda: [check_cpu_offload_parity(work, device, stage)]),
        ("CPU checkpoint resumed", lambda: [check_cpu_checkpoint_resumes(work, device)]),
        ("ep rank without tokens", lambda: [check_ep_rank_without_tokens(work, device, stage)]),
        ("experts without tokens", lambda: [check_ep_expert_without_tokens(device)]),
        ("long run", lambda: check_steady_run(work, device, steps)),
    ):
        if name in skip:
            continue
        t0 = time.perf_counter()
        try:
            new = fn()
        except Exception as e:
            first = (str(e).splitlines() or [""])[0][:200]
            new = [Check(name, False, f"raised {type(e).__name__}: {first}")]
        for c in new:
            c.data["seconds"] = round(time.perf_counter() - t0, 1)  # of the run the check judged
            if on_check is not None:
                on_check(c)
        out += new
    return out


if __name__ == "__main__":
    rank_main()
