"""The benchmarks ``python -m benchmarks.run`` knows: each name, what it measures, its steps per run
(full and ``--quick``) and whether it is in the default set. docs/benchmarks.md says how to run
each, what it prints and how long it takes.

The modules that need numpy, pyarrow or the dry run are imported when their benchmark runs.
``gpu``, the first-contact run on one CUDA GPU, is not a row here: it has flags of its own and
runs alone (``python -m benchmarks.run gpu --out DIR``, ``benchmarks/gpu.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from benchmarks import main_job
from benchmarks.sides import Bench
from benchmarks.stats import Row

__all__ = ["ALL_NAMES", "BENCHMARKS", "CPU_NAMES", "STEPS", "Benchmark", "describe"]


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: the function making its rows, what it measures, its steps per run (full,
    ``--quick``; long enough that the steady part dwarfs timer noise) and whether it is in the
    default set."""

    run: Callable[[Bench], list[Row]]
    about: str
    steps: tuple[int, int]
    default: bool = False


def _parquet_rank_history(b: Bench) -> list[Row]:
    from benchmarks import metrics_scale  # numpy and pyarrow: imported by the benchmarks that use them

    return metrics_scale.bench_parquet_rank_history(b.work, b.quick)


def _preflight_scale(b: Bench) -> list[Row]:
    from benchmarks import metrics_scale

    return metrics_scale.bench_preflight_scale(b.work, b.quick)


def _collector_scale(b: Bench) -> list[Row]:
    from benchmarks import collector_scale

    return collector_scale.rows_for_runner(b)


def _dry_run_matrix(b: Bench) -> list[Row]:
    from benchmarks import dry_run_matrix

    return dry_run_matrix.rows_for_runner(b.quick)


def _dry_run_flavors(b: Bench) -> list[Row]:
    from benchmarks import dry_run_matrix

    return dry_run_matrix.rows_for_runner(b.quick, flavors=True)


def _memory_vs_torchtitan(b: Bench) -> list[Row]:
    from benchmarks import memory_vs_torchtitan

    return memory_vs_torchtitan.rows_for_runner(b.quick)


# In the order `all` runs them; the default set first.
BENCHMARKS: dict[str, Benchmark] = {
    "collector": Benchmark(main_job.bench_collector, "the metrics collector's overhead: tokens/s with it and "
                           "without (metrics.enabled = false), pp=2 × dp_shard=2; CPU per process role", (120, 12),
                           default=True),
    "bare": Benchmark(main_job.bench_bare, "one Ray worker vs a bare single-process PyTorch loop; host RSS",
                      (50, 12), default=True),
    "torchrun": Benchmark(main_job.bench_torchrun, "the same loop under Ray vs under torchrun (dp_shard=2); "
                          "Ray's worker niceness", (40, 12), default=True),
    "ray_train": Benchmark(main_job.bench_ray_train, "ray_titan vs the loop of Ray Train's FSDP2 guide "
                           "(dp_shard=4, report every step)", (10, 8), default=True),
    "memory": Benchmark(main_job.bench_memory, "every rank's host-memory slopes after warm-up, 600 steps, "
                        "glibc and jemalloc", (600, 40), default=True),
    "startup": Benchmark(main_job.bench_startup, "`ray-titan train` to the first step's console line, and the "
                         "split", (2, 2), default=True),
    "compile": Benchmark(main_job.bench_compile, "training.compile = true vs eager under torchrun; the first "
                         "step's seconds", (40, 8)),
    "torchtitan": Benchmark(main_job.bench_torchtitan, "ray_titan vs torchtitan 0.3.0 on the main job's mesh and "
                            "on one process (needs the bench extra)", (40, 8)),
    "torchtitan_ac": Benchmark(main_job.bench_torchtitan_ac, "ray_titan vs torchtitan 0.3.0 under each "
                               "activation-checkpointing mode, dp_shard=2 (needs the bench extra)", (40, 8)),
    "collector_scale": Benchmark(_collector_scale, "the metrics path at 1,024 / 4,096 / 16,384 simulated ranks "
                                 "through real Ray calls", (200, 20)),
    "parquet_rank_history": Benchmark(_parquet_rank_history, "bytes, row groups and seconds to read one rank's "
                                      "history out of steps.parquet, up to 16,384 ranks", (500, 20)),
    "preflight_scale": Benchmark(_preflight_scale, "the memory plan, pre-flight checks and elastic range of a "
                                 "16,384-rank job", (0, 0)),
    "dry_run_matrix": Benchmark(_dry_run_matrix, "the memory plan against the simulated GPU over the "
                                "composition matrix", (2, 2)),  # simulated steps per rank
    "dry_run_flavors": Benchmark(_dry_run_flavors, "the memory plan against the simulated GPU, every flavor "
                                 "of every family", (2, 2)),
    "memory_vs_torchtitan": Benchmark(_memory_vs_torchtitan, "one rank's peak device memory, ray_titan against "
                                      "torchtitan 0.3.0's own code, on the simulated GPU (torchtitan's side "
                                      "needs the bench extra)", (2, 2)),  # simulated steps per side
}
CPU_NAMES = [n for n, b in BENCHMARKS.items() if b.default]
ALL_NAMES = list(BENCHMARKS)
STEPS = {n: b.steps for n, b in BENCHMARKS.items()}


def describe() -> str:
    """One line per benchmark (for ``--help``)."""
    width = max(map(len, BENCHMARKS))
    return "\n".join(f"  {n:<{width}}  {b.about}{' (default set)' if b.default else ''}"
                     for n, b in BENCHMARKS.items()) + \
        f"\n  {'gpu':<{width}}  the first-contact run on one CUDA GPU, alone, with its own flags " \
        "(python -m benchmarks.run gpu --help)"
