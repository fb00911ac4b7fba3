"""Device, dtype and thread choices shared by the command line, benchmarks and the engine."""

from __future__ import annotations

import os

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str = "auto") -> torch.device:
    """`auto` picks CUDA when present, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA device is available")
    return device


def resolve_dtype(name: str) -> torch.dtype:
    """Map a dtype name (float32, bfloat16, float16) to torch."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} (choose from {', '.join(DTYPES)})") from None


def configure_threads(threads: int | None) -> int:
    """Set torch's intra-op threads (default: all cores); returns the count in use."""
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def default_threads() -> int:
    """Cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
