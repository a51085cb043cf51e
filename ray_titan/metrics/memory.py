"""Per-rank memory sampling, cheap enough to run every step.

=========================  =====  ==========================================================
field                      unit   source
=========================  =====  ==========================================================
host_rss_bytes             bytes  ``VmRSS`` in ``/proc/self/status``: resident set now
host_peak_rss_bytes        bytes  ``VmHWM`` in ``/proc/self/status``: peak resident set of
                                  the process so far
device_allocated_bytes     bytes  ``allocated_bytes.all.current`` (``torch.cuda.memory_stats``)
device_active_bytes        bytes  ``active_bytes.all.current``
device_reserved_bytes      bytes  ``reserved_bytes.all.current``: held by the caching allocator
device_peak_active_bytes   bytes  ``active_bytes.all.peak`` since the previous sample (peaks are
                                  reset after each sample)
device_peak_reserved_bytes bytes  ``reserved_bytes.all.peak`` since the previous sample
device_alloc_retries       count  ``num_alloc_retries``: cudaMalloc retries after freeing cache
device_ooms                count  ``num_ooms``: out-of-memory errors caught by the allocator
device_capacity_bytes      bytes  ``torch.cuda.get_device_properties(..).total_memory``
=========================  =====  ==========================================================

Device fields are ``None`` on CPU-only workers.
"""

from __future__ import annotations

import torch

__all__ = ["MEMORY_FIELDS", "sample_memory", "host_memory"]

MEMORY_FIELDS = (
    "host_rss_bytes",
    "host_peak_rss_bytes",
    "device_allocated_bytes",
    "device_active_bytes",
    "device_reserved_bytes",
    "device_peak_active_bytes",
    "device_peak_reserved_bytes",
    "device_alloc_retries",
    "device_ooms",
    "device_capacity_bytes",
)


def host_memory() -> tuple[int, int]:
    """``(rss, peak_rss)`` of this process in bytes, from ``/proc/self/status``."""
    rss = peak = 0
    with open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(b"VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith(b"VmHWM:"):
                peak = int(line.split()[1]) * 1024
    return rss, peak


def sample_memory(device: torch.device) -> dict[str, int | None]:
    """One sample of every field in the table above; resets the device peak statistics."""
    rss, peak = host_memory()
    out: dict[str, int | None] = dict.fromkeys(MEMORY_FIELDS)
    out["host_rss_bytes"], out["host_peak_rss_bytes"] = rss, peak
    if device.type == "cuda":
        s = torch.cuda.memory_stats(device)
        out.update(
            device_allocated_bytes=s.get("allocated_bytes.all.current", 0),
            device_active_bytes=s.get("active_bytes.all.current", 0),
            device_reserved_bytes=s.get("reserved_bytes.all.current", 0),
            device_peak_active_bytes=s.get("active_bytes.all.peak", 0),
            device_peak_reserved_bytes=s.get("reserved_bytes.all.peak", 0),
            device_alloc_retries=s.get("num_alloc_retries", 0),
            device_ooms=s.get("num_ooms", 0),
            device_capacity_bytes=torch.cuda.get_device_properties(device).total_memory,
        )
        torch.cuda.reset_peak_memory_stats(device)
    return out
