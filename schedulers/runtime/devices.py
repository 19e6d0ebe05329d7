"""The device a single-process run uses, and the peak memory a process has held on its device."""

from __future__ import annotations

import torch

__all__ = ["default_device", "peak_memory_bytes"]


def default_device() -> torch.device:
    """``cuda:0`` when CUDA is available, else the CPU."""
    return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory (bytes) this process has held on ``device``: on CUDA what torch's caching allocator
    reserved (``torch.cuda.max_memory_reserved``), else the process's peak resident memory: ``VmHWM`` of
    ``/proc/self/status`` on Linux (``getrusage``'s ``ru_maxrss`` survives ``exec``, so a spawned worker
    would report its parent's peak), ``ru_maxrss`` elsewhere."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB
