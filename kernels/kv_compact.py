"""Move retained cache entries to their compacted slots on the device (after eviction).

Keys are stored before rotary with cache-relative positions, so moving a key is a plain copy:
its new position is applied at attention time and nothing is re-rotated.

Moves may overlap in place: a move may write a slot that a later move reads, but no move may
read a slot that an earlier move wrote. Compaction satisfies this: destination position i takes
the token at kept position keep[i] >= i with keep ascending, so a later move's source
keep[j] > keep[i] >= i is never an earlier destination. One program per KV head walks the moves
in order, a block at a time: it loads the block, waits at a barrier, then stores it, so every
move reads its slot before anything overwrites it.
"""

from __future__ import annotations

import torch

from streamgrok_kernels.common import kernel_flags, triton
from streamgrok_kernels.paged_kv import PagedKV

if triton is not None:
    import triton.language as tl


def reference(kv: PagedKV, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy every stored tensor (K, V and int8 scales) from slots `src` to slots `dst`."""
    src, dst = src.long(), dst.long()
    for tensor in kv.tensors():
        tensor[dst] = tensor[src]


if triton is not None:

    @triton.jit
    def _compact_kernel(
        src_ptr, dst_ptr, moves, k_ptr, v_ptr, ks_ptr, vs_ptr,
        stride_ps, stride_ph, stride_ss,
        DIM: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr,
    ):
        h = tl.program_id(0)
        d = tl.arange(0, DIM)
        for start in range(0, moves, BLOCK):
            i = start + tl.arange(0, BLOCK)
            ok = i < moves
            src = tl.load(src_ptr + i, mask=ok, other=0).to(tl.int64)
            dst = tl.load(dst_ptr + i, mask=ok, other=0).to(tl.int64)
            src_rows = src[:, None] * stride_ps + h * stride_ph + d[None, :]
            dst_rows = dst[:, None] * stride_ps + h * stride_ph + d[None, :]
            k = tl.load(k_ptr + src_rows, mask=ok[:, None])
            v = tl.load(v_ptr + src_rows, mask=ok[:, None])
            if QUANT:
                k_scale = tl.load(ks_ptr + src * stride_ss + h, mask=ok)
                v_scale = tl.load(vs_ptr + src * stride_ss + h, mask=ok)
            tl.debug_barrier()
            tl.store(k_ptr + dst_rows, k, mask=ok[:, None])
            tl.store(v_ptr + dst_rows, v, mask=ok[:, None])
            if QUANT:
                tl.store(ks_ptr + dst * stride_ss + h, k_scale, mask=ok)
                tl.store(vs_ptr + dst * stride_ss + h, v_scale, mask=ok)


def kv_compact(kv: PagedKV, src: torch.Tensor, dst: torch.Tensor, block: int = 64) -> None:
    """Triton path; same contract as `reference` (see the module docstring for overlaps)."""
    if src.numel() == 0:
        return
    flags = kernel_flags(kv)
    _compact_kernel[(kv.kv_heads,)](
        src, dst, src.numel(), kv.k, kv.v, flags["ks"], flags["vs"],
        kv.k.stride(0), kv.k.stride(1), flags["stride_ss"],
        DIM=kv.head_dim, BLOCK=block, QUANT=flags["QUANT"],
    )
