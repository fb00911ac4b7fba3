"""Scatter new K/V into their page slots, quantizing to int8 (with scales) when the pool is int8.

Slot -1 marks a padding row that is skipped. One program per (token, KV head).
"""

from __future__ import annotations

import torch

from streamgrok_kernels.common import kernel_flags, triton
from streamgrok_kernels.paged_kv import PagedKV
from streamgrok_kernels.quant import INT8_MAX, MIN_ABS_MAX, quantize_int8

if triton is not None:
    import triton.language as tl

    _INT8_MAX = tl.constexpr(INT8_MAX)
    _MIN_ABS_MAX = tl.constexpr(MIN_ABS_MAX)


def reference(kv: PagedKV, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store k, v [tokens, kv_heads, head_dim] at slots [tokens] (in place)."""
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    slots = slots.long()
    if kv.quantized:
        for values, store, scales in ((k, kv.k, kv.k_scale), (v, kv.v, kv.v_scale)):
            quantized, scale = quantize_int8(values)
            store[slots] = quantized
            scales[slots] = scale.to(scales.dtype)
    else:
        kv.k[slots] = k.to(kv.k.dtype)
        kv.v[slots] = v.to(kv.v.dtype)


if triton is not None:

    @triton.jit
    def _store_row(x, dst_ptr, scale_ptr, DIM: tl.constexpr, QUANT: tl.constexpr):
        d = tl.arange(0, DIM)
        if QUANT:
            x = x.to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(x), 0), _MIN_ABS_MAX)
            scale = (amax / _INT8_MAX).to(tl.float16)
            scaled = x / scale.to(tl.float32)
            rounded = tl.where(scaled >= 0, tl.floor(scaled + 0.5), -tl.floor(0.5 - scaled))
            rounded = tl.minimum(tl.maximum(rounded, -_INT8_MAX), _INT8_MAX)
            tl.store(dst_ptr + d, rounded.to(tl.int8))
            tl.store(scale_ptr, scale)
        else:
            tl.store(dst_ptr + d, x.to(dst_ptr.dtype.element_ty))

    @triton.jit
    def _append_kernel(
        slots_ptr, k_ptr, v_ptr, kp_ptr, vp_ptr, ks_ptr, vs_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh, stride_ps, stride_ph, stride_ss,
        DIM: tl.constexpr, QUANT: tl.constexpr,
    ):
        t = tl.program_id(0)
        h = tl.program_id(1)
        slot = tl.load(slots_ptr + t).to(tl.int64)
        if slot >= 0:
            d = tl.arange(0, DIM)
            k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d)
            v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d)
            dst = slot * stride_ps + h * stride_ph
            _store_row(k, kp_ptr + dst, ks_ptr + slot * stride_ss + h, DIM, QUANT)
            _store_row(v, vp_ptr + dst, vs_ptr + slot * stride_ss + h, DIM, QUANT)


def kv_append(kv: PagedKV, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Triton path; same contract as `reference`."""
    tokens, kv_heads, dim = k.shape
    if tokens == 0:
        return
    flags = kernel_flags(kv)
    _append_kernel[(tokens, kv_heads)](
        slots, k, v, kv.k, kv.v, flags["ks"], flags["vs"],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), kv.k.stride(0), kv.k.stride(1),
        flags["stride_ss"], DIM=dim, QUANT=flags["QUANT"],
    )
