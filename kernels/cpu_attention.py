"""Decode attention on the CPU as one native kernel (`kernels/cpu/decode_attention.cpp`).

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
import platform
from pathlib import Path

import torch

from kernels.background_compile import import_compiler_quietly

SOURCE = Path(__file__).with_name("cpu") / "decode_attention.cpp"
KV_DTYPES = (torch.float32, torch.bfloat16)
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]


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


@functools.cache
def _extension() -> None:
    """Build (or find built) and load the kernel as the op `streamgrok_cpu::decode_attention`,
    once per process; raises NativeKernelUnavailable."""
    import_compiler_quietly()
    from torch.utils import cpp_extension

    source = SOURCE.read_bytes()
    machine = f"{platform.machine()} {_cpu_flags()} {' '.join(_CFLAGS)} {torch.__version__}"
    digest = hashlib.sha256(source + machine.encode()).hexdigest()[:12]
    try:
        cpp_extension.load(f"streamgrok_cpu_decode_attention_{digest}", [str(SOURCE)],
                           extra_cflags=_CFLAGS, is_python_module=False, verbose=False)
    except Exception as error:  # no compiler, a failed build, a failed load
        raise NativeKernelUnavailable(f"the CPU decode attention kernel was not built "
                                      f"({type(error).__name__}: {error})") from error
    torch.library.register_fake("streamgrok_cpu::decode_attention", _fake)


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
