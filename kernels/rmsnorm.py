"""RMSNorm, optionally fused with the residual add before it (one read, two writes)."""

from __future__ import annotations

import torch

from streamgrok_kernels.common import triton

if triton is not None:
    import triton.language as tl


def reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rmsnorm(x + residual) * weight, x + residual); without `residual`, x itself is
    the second result. The norm is computed in float32, the sum in x's dtype."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight, x


if triton is not None:

    @triton.jit
    def _rmsnorm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, dim, eps,
        stride_x, stride_r, stride_o, stride_s,
        BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < dim
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=ok,
                                            other=0.0).to(tl.float32))
            x = x.to(sum_ptr.dtype.element_ty)
            tl.store(sum_ptr + row * stride_s + cols, x, mask=ok)
        x32 = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / dim + eps)
        normed = (x32 * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty),
                 mask=ok)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton path; same contract as `reference` (x, residual [rows, dim], contiguous rows)."""
    dim = x.shape[-1]
    x2 = x.reshape(-1, dim)
    out = torch.empty_like(x2)
    total = torch.empty_like(x2) if residual is not None else x2
    res = residual.reshape(-1, dim) if residual is not None else x2
    block = triton.next_power_of_2(dim)
    _rmsnorm_kernel[(x2.shape[0],)](
        x2, res, weight, out, total, dim, eps,
        x2.stride(0), res.stride(0), out.stride(0), total.stride(0),
        BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=min(16, max(1, block // 256)),
    )
    return out.view_as(x), total.view_as(x)
