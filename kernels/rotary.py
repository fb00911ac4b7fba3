"""Rotary embedding applied by position, half-split layout, cos/sin looked up in the kernel."""

from __future__ import annotations

import torch

from streamgrok_kernels.common import triton

if triton is not None:
    import triton.language as tl


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotation of x [..., tokens, heads, head_dim] with cos/sin [tokens,
    head_dim/2]. Written into one output with fused multiply-adds: the CPU decode path rotates
    every cached key of every layer each step, and this is 1.6x faster than building the
    halves and concatenating them (12 sequences x 2048 keys: 8.8 vs 13.9 ms a layer)."""
    half = x.shape[-1] // 2
    cos = cos[:, None, :].to(x.dtype)
    sin = sin[:, None, :].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty_like(x)
    first, second = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=first)
    first.addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=second)
    second.addcmul_(x1, sin)
    return out


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary`'s rotation as one expression, with cos/sin already shaped to broadcast
    against x [..., head_dim] and in its dtype: a compiler can fuse it (`apply_rotary` writes
    into its output in place, which inductor does not compile)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def reference(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """x [tokens, heads, D] rotated by positions [tokens], with cos/sin tables [>positions, D/2]."""
    return apply_rotary(x, cos[positions], sin[positions])


if triton is not None:

    @triton.jit
    def _rotary_kernel(
        x_ptr, pos_ptr, cos_ptr, sin_ptr, out_ptr, heads,
        stride_xt, stride_xh, stride_ot, stride_oh, stride_cos,
        HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + t)
        h = tl.arange(0, BLOCK_H)
        dh = tl.arange(0, HALF)
        ok = (h < heads)[:, None]
        c = tl.load(cos_ptr + pos * stride_cos + dh)[None, :]
        s = tl.load(sin_ptr + pos * stride_cos + dh)[None, :]
        src = x_ptr + t * stride_xt + h[:, None] * stride_xh + dh[None, :]
        x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
        dst = out_ptr + t * stride_ot + h[:, None] * stride_oh + dh[None, :]
        kind = out_ptr.dtype.element_ty
        tl.store(dst, (x1 * c - x2 * s).to(kind), mask=ok)
        tl.store(dst + HALF, (x2 * c + x1 * s).to(kind), mask=ok)


def rotate(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Triton path; same contract as `reference` (float32 tables, contiguous rows)."""
    tokens, heads, dim = x.shape
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    if tokens:
        _rotary_kernel[(tokens,)](
            x, positions, cos, sin, out, heads,
            x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0),
            HALF=dim // 2, BLOCK_H=triton.next_power_of_2(heads),
        )
    return out
