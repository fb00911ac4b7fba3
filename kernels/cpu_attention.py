"""Attention on the CPU as native kernels (`kernels/cpu/`), built on first use.

`decode_attention` (`decode_attention.cpp`) serves decode steps on the contiguous cache,
compiled or eager, with float32, bfloat16 or int8 K/V (int8 with a float16 scale per row);
`paged_attention` (`paged_attention.cpp`) serves the paged streaming cache: decode rows and
prefill chunks through page tables, keys rotated to their cache positions as they are read,
with the exact attention mass eviction needs (see `cpu_paged_attention`).

A decode step's attention reads every cached key and value once per layer; on the CPU that
read is the step's floor (SmolLM2, 32 sequences at 560 tokens: 826 MB of float32 K/V a step,
22 ms at the 37 GB/s two cores read here). PyTorch's own formulations do not reach it: SDPA,
batched matmuls, flex attention and inductor's fused product-sum loops all took 47-69 ms for
those 30 layers (11.6-16 ms at 8 sequences), because they score one query head at a time with
a horizontal reduction per key, or soft-max on one thread. The kernel scores a KV head's whole
query group against each key while the key is in L1 and sums the values into register
accumulators: 27.5 ms at 32 sequences, 7.6 ms at 8 (floors 22.3 and 5.6); with bfloat16 K/V
17.9 and 5.2 ms.

The kernels are built on first use (`kernels.cpu_native`, one extension with the other
native CPU kernels) and called as the dispatcher ops `streamgrok_cpu::decode_attention` and
`streamgrok_cpu::paged_attention`, which torch.compile keeps as one opaque call each.
`decode_attention_reference` is the same contract in PyTorch (the tests' oracle).
"""

from __future__ import annotations

import torch

from streamgrok_kernels.cpu_native import (
    NATIVE_ATTENTION_ENV,  # noqa: F401  (the switch's name, for callers of this module)
    NativeBuild,
    NativeKernelUnavailable,
    load_native_kernels,
    native_kernels_by_default,
)
from streamgrok_kernels.paged_kv import PagedKV
from streamgrok_kernels.quant import dequantized

KV_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
PAGED_KV_DTYPES = (torch.float32, torch.bfloat16, torch.int8)


def native_attention_by_default() -> bool:
    """Whether CPU attention uses the native kernels where they build (off where
    STREAMGROK_NATIVE_ATTENTION=0: compiled decode steps attend by inductor's loops, the
    paged cache by the PyTorch references)."""
    return native_kernels_by_default()


def decode_attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                               lengths: torch.Tensor, scale: float,
                               key_scales: torch.Tensor | None = None,
                               value_scales: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D]; keys, values [B, KVH, capacity, D] (int8 with their row scales
    key_scales, value_scales [B, KVH, capacity]: a value is int8 * scale); row b attends to
    the positions below lengths[b] (H a multiple of KVH: query head h reads KV head
    h // (H / KVH)); out [B, H, D] float32."""
    batch, heads, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    k = dequantized(keys, key_scales).repeat_interleave(group, dim=1)
    v = dequantized(values, value_scales).repeat_interleave(group, dim=1)
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
        load_native_kernels()
    except NativeKernelUnavailable:
        return False
    return True


def cpu_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         lengths: torch.Tensor, scale: float,
                         key_scales: torch.Tensor | None = None,
                         value_scales: torch.Tensor | None = None) -> torch.Tensor:
    """`decode_attention_reference`'s contract (q float32; K/V float32, bfloat16 or int8
    with float16 scales, CPU), by the native kernel; call `native_kernel_available` first
    (which loads it)."""
    return torch.ops.streamgrok_cpu.decode_attention(q, keys, values, lengths, scale,
                                                     key_scales, value_scales)


class NativePagedAttention(NativeBuild):
    """Whether the paged cache's CPU attention runs the native kernel (`cpu_paged_attention`):
    on unless told (`native_attention_by_default`), for CPU tensors with K/V the kernel
    reads, once built (see `kernels.cpu_native.NativeBuild`: no step waits for the
    compiler)."""

    def __init__(self, enabled: bool | None = None) -> None:
        super().__init__("paged attention", enabled)

    def serves(self, q: torch.Tensor, kv: PagedKV) -> bool:
        """Whether this call runs the native kernel (starting its build if need be)."""
        if q.device.type != "cpu" or kv.k.dtype not in PAGED_KV_DTYPES:
            return False
        return self.ready()


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

