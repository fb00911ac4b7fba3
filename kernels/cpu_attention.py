"""Attention on the CPU as native kernels (`kernels/cpu/`), built on first use.

`decode_attention` (`decode_attention.cpp`) serves compiled decode steps on the contiguous
cache; `paged_attention` (`paged_attention.cpp`) serves the paged streaming cache: decode
rows and prefill chunks through page tables, keys rotated to their cache positions as they
are read, with the exact attention mass eviction needs (see `cpu_paged_attention`).

A decode step's attention reads every cached key and value once per layer; on the CPU that
read is the step's floor (SmolLM2, 32 sequences at 560 tokens: 826 MB of float32 K/V a step,
22 ms at the 37 GB/s two cores read here). PyTorch's own formulations do not reach it: SDPA,
batched matmuls, flex attention and inductor's fused product-sum loops all took 47-69 ms for
those 30 layers (11.6-16 ms at 8 sequences), because they score one query head at a time with
a horizontal reduction per key, or soft-max on one thread. The kernel scores a KV head's whole
query group against each key while the key is in L1 and sums the values into register
accumulators: 27.5 ms at 32 sequences, 7.6 ms at 8 (floors 22.3 and 5.6); with bfloat16 K/V
17.9 and 5.2 ms.

It is built on first use with PyTorch's C++ extension builder (the C++ compiler inductor
needs anyway), for this machine's instruction set (the build's name carries a hash of the CPU's
flags, so a cache shared between machines never runs code built for another), and is called
as the dispatcher op `streamgrok_cpu::decode_attention` (registered in C++, so a compiled
graph calls it without Python in between), which torch.compile keeps as one opaque call.
`decode_attention_reference` is the same contract in PyTorch (the tests' oracle).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import threading
from pathlib import Path

import torch

from kernels.background_compile import BackgroundCompiles, import_compiler_quietly
from kernels.paged_kv import PagedKV

SOURCE = Path(__file__).with_name("cpu") / "decode_attention.cpp"
SOURCES = (SOURCE, SOURCE.with_name("paged_attention.cpp"))
HEADERS = (SOURCE.with_name("attention_math.h"),)
KV_DTYPES = (torch.float32, torch.bfloat16)
PAGED_KV_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
_BUILD_LOCK = threading.Lock()  # one build and registration, whichever thread asks first
NATIVE_ATTENTION_ENV = "STREAMGROK_NATIVE_ATTENTION"  # "0": attention in PyTorch instead


def native_attention_by_default() -> bool:
    """Whether CPU attention uses the native kernels where they build (off where
    STREAMGROK_NATIVE_ATTENTION=0: compiled decode steps attend by inductor's loops, the
    paged cache by the PyTorch references)."""
    return os.environ.get(NATIVE_ATTENTION_ENV, "1") != "0"


class NativeKernelUnavailable(RuntimeError):
    """The native kernel could not be built here (no C++ compiler, or the build failed)."""


def decode_attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                               lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, D]; keys, values [B, KVH, capacity, D]; row b attends to the positions below
    lengths[b] (H a multiple of KVH: query head h reads KV head h // (H / KVH)); out
    [B, H, D] float32."""
    batch, heads, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("bhd,bhtd->bht", q.float(), k) * scale
    visible = torch.arange(keys.shape[2], device=q.device)[None, :] < lengths[:, None]
    weights = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    return torch.einsum("bht,bhtd->bhd", weights, v)


def native_kernel_available(kv_dtype: torch.dtype) -> bool:
    """Whether the native kernel serves K/V of `kv_dtype` here (building it if need be:
    tens of seconds the first time on a machine, then a load from the build cache)."""
    if kv_dtype not in KV_DTYPES:
        return False
    try:
        _extension()
    except NativeKernelUnavailable:
        return False
    return True


def _extension() -> None:
    """`_build_extension` under the build lock."""
    with _BUILD_LOCK:
        _build_extension()


@functools.cache
def _build_extension() -> None:
    """Build (or find built) and load the kernels as the ops `streamgrok_cpu::decode_attention`
    and `streamgrok_cpu::paged_attention`, once per process; raises NativeKernelUnavailable."""
    import_compiler_quietly()
    from torch.utils import cpp_extension

    source = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    machine = f"{platform.machine()} {_cpu_flags()} {' '.join(_CFLAGS)} {torch.__version__}"
    digest = hashlib.sha256(source + machine.encode()).hexdigest()[:12]
    try:
        cpp_extension.load(f"streamgrok_cpu_attention_{digest}", [str(p) for p in SOURCES],
                           extra_cflags=_CFLAGS, is_python_module=False, verbose=False)
    except Exception as error:  # no compiler, a failed build, a failed load
        raise NativeKernelUnavailable(f"the native CPU attention kernels were not built "
                                      f"({type(error).__name__}: {error})") from error
    torch.library.register_fake("streamgrok_cpu::decode_attention", _fake)
    torch.library.register_fake("streamgrok_cpu::paged_attention", _fake_paged)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def cpu_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """`decode_attention_reference`'s contract (q float32; K/V float32 or bfloat16, CPU),
    by the native kernel; call `native_kernel_available` first (which loads it)."""
    return torch.ops.streamgrok_cpu.decode_attention(q, keys, values, lengths, scale)


def _fake(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
          scale: float) -> torch.Tensor:
    """The op's output for tracing: like q, contiguous."""
    return torch.empty_like(q, memory_format=torch.contiguous_format)


class NativePagedAttention:
    """Whether the paged cache's CPU attention runs the native kernel (`cpu_paged_attention`).

    On unless told (`native_attention_by_default`), for CPU tensors with K/V the kernel
    reads. The first call that could use it starts the build on a background thread and gets
    False, as do calls until it is loaded (a step never waits tens of seconds for the C++
    compiler; the PyTorch path serves meanwhile); a failed build turns it off with one
    warning."""

    _KIND = "paged attention"

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = native_attention_by_default() if enabled is None else enabled
        self._build = BackgroundCompiles("native CPU attention")

    def serves(self, q: torch.Tensor, kv: PagedKV) -> bool:
        """Whether this call runs the native kernel (starting its build if need be)."""
        if not self.enabled or q.device.type != "cpu" or kv.k.dtype not in PAGED_KV_DTYPES:
            return False
        if self._build.is_ready(self._KIND):
            return True
        self._build.start(self._KIND, _extension)
        return False

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Build now if not started, wait for it; whether the kernel is in use (benchmarks
        and tests, before they measure or compare)."""
        if self.enabled:
            self._build.start(self._KIND, _extension)
            self._build.wait(timeout)
        return self.enabled and self._build.is_ready(self._KIND)

    @property
    def error(self) -> str | None:
        """Why the native kernel is off, if its build failed."""
        return self._build.error


def cpu_paged_attention(
    q: torch.Tensor, kv: PagedKV, block_tables: torch.Tensor, cu_q: torch.Tensor,
    past: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mass_rows: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`kernels.paged_prefill_attention.reference`'s contract by the native kernel (call
    `native_kernel_available` first, which loads it): q [T, H, D] rotated; sequence b's
    queries are rows cu_q[b]:cu_q[b+1] at cache positions past[b], past[b] + 1, ..., each
    attending to the cached keys up to its own position (a decode row: one query at
    position length - 1). K/V float32, bfloat16 or int8 (with scales), on the CPU. Returns
    out [T, H, D] in q's dtype and, with `mass_rows`, mass [B, P * page_size] float32: what
    the last `mass_rows` queries of each sequence gave each key, summed over heads."""
    out, mass = torch.ops.streamgrok_cpu.paged_attention(
        q.float(), kv.k, kv.v, kv.k_scale, kv.v_scale, block_tables.int(), cu_q.long(),
        past.long(), cos.float(), sin.float(), kv.page_size, mass_rows or 0,
        q.shape[-1] ** -0.5)
    return out.to(q.dtype), (mass if mass_rows else None)


def _fake_paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale, v_scale,
                block_tables: torch.Tensor, cu_q: torch.Tensor, past: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, page_size: int, mass_rows: int,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The paged op's outputs for tracing."""
    width = block_tables.shape[1] * page_size
    mass = q.new_empty((block_tables.shape[0], width) if mass_rows > 0 else (0,))
    return torch.empty_like(q, memory_format=torch.contiguous_format), mass
