"""Small timing helpers shared by the benchmarks."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch

from streamgrok.engine.metrics import percentile
from streamgrok.openmp_wait import without_wait_choices

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


def milliseconds(seconds: float) -> str:
    """`seconds` as whole milliseconds for a report ("n/a" for NaN: nothing measured)."""
    return "n/a" if seconds != seconds else f"{seconds * 1e3:.0f}"


def median(values: list[float]) -> float:
    return statistics.median(values)


def measurement_env() -> dict[str, str]:
    """The environment of the measured processes (ours and the peer's): OpenMP's default
    wait (libgomp's ~7 ms spin here), not the command line's bounded spin
    (`streamgrok.openmp_wait`), so rows stay comparable with the peer's and with earlier
    runs. PASSIVE waiting made a batch-1 step about 3x slower for both systems on these 2
    cores (q8 26.8 -> 9.0 tok/s, llama.cpp 89 -> 28 tok/s measured)."""
    return without_wait_choices(os.environ)
