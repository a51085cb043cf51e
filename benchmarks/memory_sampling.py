"""Cost of the per-step memory sample (``ray_titan.metrics.worker.memory.MemorySampler``), of each of
its reads, and of the memory verdict per step in the collector, printed as figures (not a test).
The heap's cost depends on the process: glibc's ``mallinfo2`` takes ~2 µs here and ~0.55 ms in a
Ray train worker, whose threads each hold an arena; a run's real cost is its ``metrics_time_s``.

    python benchmarks/memory_sampling.py [--samples 2000]

On CUDA the device fields (``torch.cuda.memory_stats`` and ``reset_peak_memory_stats``) are
included; on CPU only the three ``/proc`` reads.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ray_titan.allocator import host_heap
from ray_titan.metrics.collector.leak import LeakMonitor, leak_settings
from ray_titan.metrics.worker.memory import MemorySampler, host_available, host_memory, sample_memory


def _per_call_us(fn, n: int) -> float:
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--samples", type=int, default=2000)
    args = ap.parse_args()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    print(f"device: {device}")
    sampler = MemorySampler(device, slow_interval_s=1.0)
    print(f"MemorySampler:  {_per_call_us(sampler.sample, args.samples):8.1f} us per call (every step, every rank; "
          "heap and available memory once a second)")
    print(f"sample_memory:  {_per_call_us(lambda: sample_memory(device), args.samples):8.1f} us (every field read)")
    print(f"  host_memory:  {_per_call_us(host_memory, args.samples):8.1f} us (/proc/self/statm opened, getrusage)")
    print(f"  host_heap:    {_per_call_us(host_heap, args.samples):8.1f} us (malloc's statistics)")
    print(f"  host_available: {_per_call_us(host_available, args.samples):6.1f} us (/proc/meminfo and the cgroup)")
    sampler.close()
    monitor = LeakMonitor(**leak_settings())
    row = sample_memory(device) | {"rank": 0, "coords": {"pp": 0, "dp_shard": 0}}
    step = iter(range(1, 10**9))
    print(f"verdict update: {_per_call_us(lambda: monitor.update(next(step), row), 500):8.1f} "
          "us per rank per step (collector)")


if __name__ == "__main__":
    main()
