"""Device, dtype and thread choices shared by the command line, benchmarks and the engine."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
import time

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


def resolve_dtype(name: str, device: torch.device | None = None) -> torch.dtype:
    """Map a dtype name (auto, float32, bfloat16, float16) to torch. `auto` is bfloat16 on
    CUDA and float32 on CPU (measured faster here than bfloat16 without AVX512-BF16:
    `python -m benchmarks decode --dtype bfloat16`)."""
    if name == "auto":
        on_cuda = device is not None and torch.device(device).type == "cuda"
        return torch.bfloat16 if on_cuda else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} (choose from {', '.join(DTYPES)})") from None


def resolve_weights(weights: str, dtype: str, device: torch.device) -> str:
    """The weight format `weights` names: `auto` with `dtype` auto is `q4` on the CPU (int4
    projections, an int8 head: the native decode step; its accuracy against float32 is
    printed by `python -m benchmarks decode`) and the model's dtype elsewhere; any other
    `weights`, or an explicit `dtype`, is kept as given."""
    if weights == "auto" and dtype == "auto" and torch.device(device).type == "cpu":
        return "q4"
    return weights


def configure_threads(threads: int | None) -> int:
    """Set torch's intra-op threads (default: all cores) and steady host-allocator
    thresholds; returns the thread count in use."""
    if threads:
        torch.set_num_threads(threads)
    steady_host_allocator()
    return torch.get_num_threads()


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
HEAP_LIMIT_BYTES = 256 * 2**20


def steady_host_allocator(limit: int = HEAP_LIMIT_BYTES) -> bool:
    """Serve CPU tensors below `limit` bytes from glibc's heap and keep it from being trimmed.

    By default glibc moves its mmap threshold as the process frees memory, and once a step's
    temporaries (gathered K/V, attention masks, packed weights) fall above it, every one is a
    fresh mmap that page-faults on first touch: a SmolLM2 decode step at 4k cached tokens then
    takes 2.5x as long (260 ms instead of 105 ms) depending on what ran before. Fixed
    thresholds make it steady. Returns False where the C library is not glibc."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, limit)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * limit))


def release_free_memory() -> bool:
    """Give the C heap's free memory back to the system (glibc malloc_trim), which the
    steady thresholds above otherwise keep for the next steps: call it when work has left
    (sessions closed), not between steps. Returns False where the C library is not glibc."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim(0)
    return True


MADV_DONTNEED = 4  # Linux


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, loaded once (finding it runs `ldconfig`): None where there is none."""
    path = ctypes.util.find_library("c")
    if path is None:
        return None
    libc = ctypes.CDLL(path, use_errno=True)
    if hasattr(libc, "madvise"):
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def discard_rows(tensor: torch.Tensor, runs: list[tuple[int, int]]) -> int:
    """Give the system back the memory of rows [start, stop) of each run of a CPU tensor
    (madvise MADV_DONTNEED on the whole OS pages inside them; the rows then read as zeros
    and are committed again when written). For storage that is zeroed before reuse anyway,
    like freed KV pages. Returns the bytes given back (0 off Linux or on another device)."""
    libc = _libc()
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or libc is None \
            or not os.uname().sysname == "Linux":
        return 0
    page = mmap.PAGESIZE
    row_bytes = tensor[0].numel() * tensor.element_size() if tensor.shape[0] else 0
    base = tensor.data_ptr()
    given = 0
    for start, stop in runs:
        first = -(-(base + start * row_bytes) // page) * page  # round up to an OS page
        last = (base + stop * row_bytes) // page * page  # round down
        if last > first and libc.madvise(first, last - first, MADV_DONTNEED) == 0:
            given += last - first
    return given


def default_threads() -> int:
    """Cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class StepTimer:
    """Seconds one step took, device work included: on CUDA, events recorded on the current
    stream around the step (the end one waited for, so a step that only queued kernels is not
    counted as instant); elsewhere the wall clock."""

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._begin: torch.cuda.Event | None = None
        self._started = 0.0

    def start(self) -> None:
        self._started = time.perf_counter()
        if self.cuda:
            self._begin = torch.cuda.Event(enable_timing=True)
            self._begin.record()

    def stop(self) -> float:
        if not self.cuda:
            return time.perf_counter() - self._started
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return self._begin.elapsed_time(end) / 1e3

