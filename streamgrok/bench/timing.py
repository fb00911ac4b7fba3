"""Small timing helpers shared by the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from streamgrok.engine.metrics import percentile

__all__ = ["median", "percentile", "synchronize", "timed"]


def synchronize(device: torch.device) -> None:
    """Wait for queued device work so wall-clock timings mean something."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds one call of fn takes, device work included."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def median(values: list[float]) -> float:
    return statistics.median(values)
