"""The ``ray-titan`` command (also ``python -m ray_titan``).

``ray-titan train [--config X.toml] [--progress MODE] [--section.key=value ...]`` runs the driver
(:func:`ray_titan.driver.train`): on the cluster named by ``RAY_ADDRESS``, or on a local Ray
cluster it starts. Without ``--config`` the built-in defaults are used, which are
``configs/debug_llama.toml``. Where Ray is not installed it starts nothing and names the launcher
command that runs the job without Ray (``ray_titan.launch``; exit status 2); the other commands
need no Ray. Exit status: 0 for a complete run, 2 for a config error (before
any worker starts), 1 for a failed run, one whose metrics have errors (a non-finite final loss
included) or one that applied no update (every step's update skipped, ``training.on_nonfinite =
"skip"``), 130 when interrupted by Ctrl-C, 143 by SIGTERM and 129 by SIGHUP (a closed terminal or
SSH session; ``128 + signum``, as a shell reports it; each way the workers are stopped, the metrics
flushed, and the last checkpoint named).

``ray-titan config show [X.toml] [--section.key=value ...]`` prints the resolved config, every
default included, as TOML; ``ray-titan config docs`` prints (or writes, ``--output``) the
configuration reference ``docs/configuration.md``.
``ray-titan export CHECKPOINT_OR_RUN_DIR --to hf OUT_DIR [--dtype bf16|fp32]`` writes a ray_titan
checkpoint as a Hugging Face model directory (``ray_titan.checkpoint.export_hf``), whole or not at all.
Every command stops on Ctrl-C (exit 130), SIGTERM (143) or SIGHUP (129) as ``train`` does, and refuses bad
input one way: one line ``ray-titan <command>: <what, which value, what would be valid>`` and
exit 2 before anything starts (:class:`UsageError`, a config error, argparse's own).
``ray-titan memory plan [--config X.toml] [--device-memory 80GiB] [--section.key=value ...]``
prints every rank's predicted memory, whether the job fits, and the levers that would make it
fit (``ray_titan.preflight.memory_plan``), without starting anything; with ``--memory.fit=auto``
also the line a run prints with the levers it would apply (``ray_titan.preflight.prepare.fit_memory``).
``ray-titan report RUN_DIR`` writes ``RUN_DIR/report/loss.png`` and ``memory.png`` (every rank's
memory with its verdicts marked) and prints a summary table per rank (``ray_titan.metrics.reading.run_summary``).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import shlex
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn

__all__ = ["UsageError", "main"]

_OVERRIDES = (
    "Any setting can be overridden with --section.key=value (the value is read as TOML: 3, 1e-4, "
    "true, GPipe); the settings, their types and defaults are in docs/configuration.md"
)


class UsageError(Exception):
    """Bad input to a command, found before anything starts: ``main`` prints it as one line,
    ``ray-titan <command>: <what, which value, what would be valid>``, and returns 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line and exit status 2, as every other refusal (argparse prints the usage too)."""
        self.exit(2, f"{self.prog}: {message} (see '{self.prog} --help')\n")


# --section.key=value is an override wherever it stands: argparse would take one with a space in
# its value ("--job.name=a b") for a positional argument (config show's X.toml).
_OVERRIDE = re.compile(r"--[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z0-9_.]*=.*", re.DOTALL)


def _parser() -> argparse.ArgumentParser:
    """``ray-titan``'s parser: one sub-command per job (``train``, ``config``, ``export``, ``memory``,
    ``dry-run``, ``report``), each with its own ``--help``."""
    ap = _Parser(
        prog="ray-titan", description="Distributed LLM training on Ray: pipeline parallel × FSDP2, "
        "with the last stage's loss and every rank's memory at every step.",
        epilog="Run 'ray-titan COMMAND --help' for a command's options.",
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_train_parser, _config_parser, _export_parser, _memory_parser, _dry_run_parser, _report_parser):
        add(sub)
    return ap


def _train_parser(sub: Any) -> None:
    from ray_titan.config.docs import settings_help
    from ray_titan.driver.progress import MODES

    tr = sub.add_parser(
        "train",
        help="run a training job (on RAY_ADDRESS's cluster, or a local one it starts)",
        description="Run a training job on the Ray cluster named by RAY_ADDRESS, the one this "
        "process runs in (ray job submit), or a local cluster it starts. " + _OVERRIDES + ". "
        "Without Ray installed it names the launcher command instead (python -m ray_titan.launch, "
        "torchrun). Exit status: 0 complete run, 2 config error or no Ray (before any worker starts), 1 failed run, "
        "130 Ctrl-C, 143 SIGTERM, 129 SIGHUP (terminal closed).",
        epilog="settings (--section.key=VALUE):\n" + settings_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tr.add_argument("--config", metavar="X.toml", help="TOML job config (default: the built-in defaults, "
                    "which are configs/debug_llama.toml)")
    tr.add_argument("--progress", choices=MODES, default="auto",
                    help="progress display: a bar with ETA, loss, tokens/s and max memory over ranks "
                    "(bar), one line per log step (lines), or bar on a terminal and lines otherwise, "
                    "as under ray job submit (auto, the default)")


def _config_parser(sub: Any) -> None:
    from ray_titan.config.docs import REGENERATE

    cf = sub.add_parser("config", help="show a resolved config, or print the configuration reference",
                        description="Inspect job configs.")
    csub = cf.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND")
    show = csub.add_parser(
        "show", help="print the resolved config (TOML, every default included)",
        description="Print the config that a job would run with: the TOML file (or the built-in "
        "defaults) with the overrides applied and every default filled in, as TOML that "
        "'ray-titan train --config' accepts. " + _OVERRIDES + ". Exit status 2 for an invalid config.",
    )
    show.add_argument("config", nargs="?", metavar="X.toml", help="TOML job config (default: the built-in defaults)")
    show.add_argument("--validate", action="store_true",
                      help="also run the checks 'train' runs before workers start (mesh, batch, data "
                      "path, tokenizer), without starting Ray")
    docs = csub.add_parser(
        "docs", help="print the configuration reference (Markdown)",
        description=f"Render the configuration reference from the config classes. The committed "
        f"copy is regenerated with: {REGENERATE}",
    )
    docs.add_argument("--output", metavar="PATH", help="write to this file instead of stdout")


def _export_parser(sub: Any) -> None:
    ex = sub.add_parser(
        "export",
        help="write a checkpoint as a Hugging Face model directory (config.json, safetensors, tokenizer)",
        description="Write the model of a ray_titan checkpoint (a step-NNNNNNNN directory, or a run "
        "directory or its checkpoints/, whose latest complete checkpoint is taken) as a Hugging Face "
        "model directory that transformers' from_pretrained and vLLM load: config.json, safetensors "
        "shards with model.safetensors.index.json, and the run's tokenizer files. Streams one shard "
        "at a time into a staging directory that becomes OUT_DIR only when complete (an interrupted or "
        "failed export leaves no OUT_DIR). Exit status 2 for a missing or incomplete checkpoint, an OUT_DIR that "
        "exists and is not empty, or storage that does not answer; 130 Ctrl-C, 143 SIGTERM, 129 SIGHUP.",
    )
    ex.add_argument("checkpoint", metavar="CHECKPOINT_OR_RUN_DIR",
                    help="a step-NNNNNNNN checkpoint, or a run directory (its latest complete checkpoint)")
    ex.add_argument("--to", choices=["hf"], required=True, help="the format: hf (Hugging Face)")
    ex.add_argument("out_dir", metavar="OUT_DIR", help="the directory to write (a local path or a URI)")
    ex.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="weights dtype (default bf16)")
    ex.add_argument("--max-shard-size", type=float, default=5.0, metavar="GiB",
                    help="largest safetensors shard, GiB (default 5)")
    ex.add_argument("--storage-timeout", type=float, default=30.0, metavar="SECONDS",
                    help="seconds a remote OUT_DIR may take to accept a probe file before the export is "
                    "refused (default 30, as job.storage_timeout_s)")


def _memory_parser(sub: Any) -> None:
    mem = sub.add_parser("memory", help="plan a job's memory before running it",
                         description="Memory tools. 'memory plan' predicts every rank's memory.")
    msub = mem.add_subparsers(dest="memory_command", required=True, metavar="SUBCOMMAND")
    plan = msub.add_parser(
        "plan", help="every rank's predicted memory, whether it fits, and the levers that would make it fit",
        description="Predict every rank's memory for a job without starting anything (the model is built "
        "on the meta device): parameters, gradients, optimizer state, FSDP's gathered buffers, "
        "activations times the microbatches the pipeline schedule keeps in flight, and the peak; "
        "with a device capacity, whether it fits and the levers that would make it fit, cheapest "
        "first (ray_titan.preflight.memory_plan); with --memory.fit=auto, also the line a run prints with "
        "the microbatches / activation checkpointing it would train with, and --json writes that job's plan. "
        + _OVERRIDES + ". Exit status: 0 fits (or no capacity known; with --memory.fit=auto: the chosen job "
        "fits), 1 does not fit, 2 config error (memory.fit = auto with no fitting choice among them), "
        "3 the plan itself failed.",
    )
    plan.add_argument("--config", metavar="X.toml", help="TOML job config (default: the built-in defaults)")
    plan.add_argument("--device-memory", metavar="SIZE",
                      help="memory of each rank's device, e.g. 80GiB, 80GB, 141GB (default: memory.device_memory, "
                      "else the CUDA device here, if any)")
    plan.add_argument("--device", choices=("cuda", "cpu"),
                      help="device kind of the workers (default: cuda with --device-memory or ray.use_gpu, else cpu)")
    plan.add_argument("--routing-imbalance", type=float, default=1.0, metavar="RHO",
                      help="MoE under expert parallel: max over mean tokens per rank's experts (default 1, balanced)")
    plan.add_argument("--vocab-size", type=int, metavar="N",
                      help="vocabulary of the model (default: the job's tokenizer's, else the flavor's)")
    plan.add_argument("--margin", type=float, metavar="SHARE",
                      help="share of the device memory kept free for the CUDA context, communication buffers "
                      "and fragmentation (default 0.08 on cuda, 0 on cpu)")
    plan.add_argument("--json", metavar="PATH", help="also write the plan as JSON")


def _dry_run_parser(sub: Any) -> None:
    dr = sub.add_parser(
        "dry-run", help="train ranks of the job for a few steps on a simulated CUDA device, no GPU needed",
        description="Build and train ranks of the job for a few steps on a simulated CUDA device (fake "
        "tensors, a fake process group of the job's size; ray_titan.dry_run): what would fail on the GPUs "
        "(an NCCL collective given a host tensor, shapes that do not fit), the host synchronisations per "
        "step and each rank's peak device memory beside the memory plan's. " + _OVERRIDES + ". Exit status: "
        "0 every rank ran, 1 a rank failed, 2 config error or no simulated device.",
    )
    dr.add_argument("--config", metavar="X.toml", help="TOML job config (default: the built-in defaults)")
    dr.add_argument("--rank", type=int, action="append", dest="rank", metavar="R",
                    help="a rank to simulate (repeat for several; default 0)")
    dr.add_argument("--ranks", choices=["all"],
                    help="all: one rank per distinct role instead (the first and the last rank of every pipeline rank)")
    dr.add_argument("--steps", type=int, default=2, metavar="N", help="training steps per rank (default 2)")


def _report_parser(sub: Any) -> None:
    rp = sub.add_parser(
        "report",
        help="plot a run's loss and memory and print a summary per rank",
        description="Write RUN_DIR/report/loss.png and memory.png and print a summary table per rank.",
    )
    rp.add_argument("run_dir", help="a run directory (<dump_folder>/<name>-<timestamp>)")
    rp.add_argument("--out", help="where to write the PNG files (default: RUN_DIR/report)")


def _train(args, overrides: list[str]) -> int:
    from ray_titan.config import ConfigError

    try:
        if importlib.util.find_spec("ray") is None:  # located, not imported: the driver imports it
            return _train_without_ray(args.config, overrides)
        from ray_titan.driver import train

        result = train(args.config, overrides, progress=args.progress)
    except ConfigError as e:
        return _refuse("train", e)
    except KeyboardInterrupt as e:  # Ctrl-C 130, SIGTERM 143, SIGHUP 129: driver.Interrupted
        return 128 + int(getattr(e, "signum", signal.SIGINT))
    except Exception as e:  # Ray's error carries the failing worker's traceback
        print(f"ray-titan train: training failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    # A run that applied no update learned nothing: a failure, said by the driver's last line.
    return 1 if result.errors or result.no_update_applied else 0


def _train_without_ray(config: str | None, overrides: list[str]) -> int:
    """``ray-titan train`` where Ray is not installed: one line on stderr naming the launcher
    command that runs the same job without Ray (``torchrun`` with the mesh's process count, or
    ``python -m`` for one process); exit status 2, as a config error (nothing started)."""
    from ray_titan.config import load_config

    cfg = load_config(config, overrides)  # a ConfigError is _train's: one line, exit 2
    if cfg.data.source == "ray_data":  # the launcher refuses it: only Ray can run this job
        print("ray-titan train: Ray is not installed, and data.source = 'ray_data' streams through it: "
              "install Ray (pip install 'ray[default,train]')", file=sys.stderr)
        return 2
    n = cfg.world_size
    start = ["torchrun", f"--nproc-per-node={n}"] if n > 1 else ["python"]
    job = ["--config", config] if config else []
    print(f"ray-titan train: Ray is not installed; run this job without Ray with the launcher: "
          f"{shlex.join([*start, '-m', 'ray_titan.launch', *job, *overrides])}"
          + (f" (more ranks than one node holds: torchrun --nnodes=NODES --nproc-per-node=GPUS_PER_NODE with "
             f"NODES × GPUS_PER_NODE = {n} on every node)" if n > 8 else ""), file=sys.stderr)
    return 2


def _write(path: str, text: str, what: str) -> None:
    """Write ``text`` to ``path``; :class:`UsageError` naming ``what`` (the flag) if it cannot."""
    try:
        Path(path).write_text(text)
    except OSError as e:
        raise UsageError(f"{what} {path}: cannot write it: {e.strerror or e}") from None


def _config(args, overrides: list[str]) -> int:
    from ray_titan.config import load_config
    from ray_titan.config.docs import reference_markdown, to_toml
    from ray_titan.preflight.checks import validate_job
    from ray_titan.preflight.prepare import resolve_job

    if args.config_command == "docs":
        if overrides:
            raise UsageError(f"takes no overrides, got {overrides}")
        text = reference_markdown()
        if args.output:
            _write(args.output, text, "--output")
        else:
            sys.stdout.write(text)
        return 0
    cfg = load_config(args.config, overrides)
    if args.validate:
        cfg = resolve_job(cfg)[0]  # the rewrites of a run (ray_titan.preflight.prepare), then its checks
        validate_job(cfg)
    sys.stdout.write(to_toml(cfg))
    return 0


def _positive(value: float, flag: str, unit: str) -> None:
    """:class:`UsageError` unless ``value`` is a finite number above 0 (NaN and inf included)."""
    if not 0 < value < math.inf:
        raise UsageError(f"{flag} {value:g}: give a positive number of {unit}")


def _export(args, overrides: list[str]) -> int:
    from ray_titan.checkpoint import CheckpointError, export_hf
    from ray_titan.storage import StorageError

    if overrides:
        raise UsageError(f"unexpected arguments {overrides}")
    _positive(args.storage_timeout, "--storage-timeout", "seconds")
    _positive(args.max_shard_size, "--max-shard-size", "GiB")
    try:
        result = export_hf(args.checkpoint, args.out_dir, args.dtype, max(1, int(args.max_shard_size * 2**30)),
                           storage_timeout_s=args.storage_timeout)
    except (CheckpointError, ValueError, StorageError) as e:  # StorageError: OUT_DIR exists, or no answer
        raise UsageError(str(e)) from None
    for note in result.notes:
        print(f"ray-titan export: note: {note}", file=sys.stderr)
    print(f"wrote {result.out_dir}: {', '.join(result.files)} ({result.tensors} tensors, "
          f"{result.total_bytes / 2**20:.1f} MiB, {args.dtype})")
    return 0


def _memory(args, overrides: list[str]) -> int:
    from ray_titan.config import load_config
    from ray_titan.preflight.memory_plan import memory_plan
    from ray_titan.preflight.prepare import fit_memory

    if args.json:  # before planning: a path it cannot write is bad input, refused before any output
        where = Path(args.json)
        if where.is_dir() or not where.parent.is_dir() or not os.access(where.parent, os.W_OK):
            raise UsageError(f"--json {args.json}: cannot write it there (a directory, or a folder that is "
                             "missing or not writable); give a file path in a writable folder")
    cfg = load_config(args.config, overrides)
    capacity = args.device_memory if args.device_memory is not None else cfg.memory.device_memory
    plan = memory_plan(cfg, capacity, args.device, args.routing_imbalance, args.vocab_size, margin=args.margin)
    print(plan.format())
    if cfg.memory.fit == "auto":  # the choice a run makes (ray_titan.preflight.prepare.fit_memory)
        _, fitted, line = fit_memory(cfg, args.device, capacity, margin=args.margin)
        if line:
            print(f"ray_titan: {line}")
        plan = fitted if fitted is not None else plan
    if args.json:
        try:
            plan.save(args.json)
        except OSError as e:  # the checks above passed, then the disk said no (full, quota)
            print(f"ray-titan memory plan: --json {args.json}: cannot write it: {e.strerror or e}", file=sys.stderr)
            return 2
    return 1 if plan.fits is False else 0


def _dry_run(args, overrides: list[str]) -> int:
    from ray_titan.config import load_config
    from ray_titan.dry_run import DryRunError, dry_run, format_results, representative_ranks
    from ray_titan.dry_run.shim import ShimError

    ranks = args.rank
    if args.ranks == "all":
        if ranks:  # not silently dropped
            raise UsageError(f"--ranks all simulates one rank per role; it takes no --rank (got {ranks})")
        ranks = representative_ranks(load_config(args.config, overrides))
    try:
        results = dry_run(args.config, overrides, ranks, args.steps)
    except ShimError as e:
        raise UsageError(str(e)) from None
    except DryRunError as e:
        print(f"ray-titan dry-run: {e}", file=sys.stderr)
        return 1
    print(format_results(results))
    return 0


def _report(args, overrides: list[str]) -> int:
    from ray_titan.metrics.reading.run_summary import (
        ReportError,
        format_memory_table,
        format_table,
        memory_rows,
        write_report,
    )

    if overrides:
        raise UsageError(f"unexpected arguments {overrides}")
    try:
        memory = format_memory_table(memory_rows(args.run_dir))  # first: a damaged file refuses before any write
        paths, rows = write_report(args.run_dir, args.out)
    except (FileNotFoundError, ReportError) as e:
        raise UsageError(str(e)) from None
    except OSError as e:  # a read-only run directory (shared storage, a mounted snapshot)
        where = e.filename or args.out or Path(args.run_dir) / "report"
        raise UsageError(f"cannot write {where}: {e.strerror or e}; write the plots elsewhere with --out DIR") from None
    print(format_table(rows))
    if memory:
        print(memory)
    for path in paths:
        print(f"wrote {path}")
    return 0


# ``train`` is not here: main() hands it to the driver, which guards its own run.
_COMMANDS = {"config": _config, "export": _export, "memory": _memory, "dry-run": _dry_run, "report": _report}


def _name(args) -> str:
    """The command as typed: ``memory plan``, ``config show``, ``dry-run``."""
    sub = getattr(args, "config_command", None) or getattr(args, "memory_command", None)
    return f"{args.command} {sub}" if sub else args.command


def _refuse(name: str, e: Exception) -> int:
    """The one way a command refuses bad input: one line on stderr, exit status 2."""
    from ray_titan.config import ConfigError

    print(f"ray-titan {name}: {'config error: ' if isinstance(e, ConfigError) else ''}{e}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``ray-titan``; returns the exit status: bad input (argparse's, a config error,
    a :class:`UsageError`) is one line ``ray-titan <command>: ...`` and 2, before anything starts;
    any other failure one line and 1 (3 for ``memory plan``, whose 1 means "does not fit";
    ``RAY_TITAN_TRACEBACK=1``: the traceback). Ctrl-C, SIGTERM and
    SIGHUP stop every command the same way (:class:`~ray_titan.driver.signals.SignalGuard`): exit 130,
    143 or 129, at the latest 30 s after the signal (at once on a second one), whatever the command waits on."""
    from ray_titan.config import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    args, rest = _parser().parse_known_args([a for a in argv if not _OVERRIDE.fullmatch(a)])
    overrides = [a for a in argv if _OVERRIDE.fullmatch(a)] + rest
    if args.command == "train":
        return _train(args, overrides)  # the driver guards its own run (and names its run directory)
    from ray_titan.driver.signals import SignalGuard

    name = _name(args)
    note = f"{args.out_dir} was not written (a .partial-* directory beside it may remain)" \
        if args.command == "export" else ""
    with SignalGuard(note=note) as signals:
        try:
            return _COMMANDS[args.command](args, overrides)
        except KeyboardInterrupt:
            signum = signals.signum or signal.SIGINT
            print(f"ray-titan {name}: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
            return 128 + signum
        except (UsageError, ConfigError) as e:
            return _refuse(name, e)
        except Exception as e:
            if os.environ.get("RAY_TITAN_TRACEBACK"):
                raise
            print(f"ray-titan {name}: failed: {type(e).__name__}: {e} (RAY_TITAN_TRACEBACK=1 shows where)",
                  file=sys.stderr)
            return 3 if args.command == "memory" else 1  # memory plan's 1 is an answer: does not fit


if __name__ == "__main__":
    sys.exit(main())
