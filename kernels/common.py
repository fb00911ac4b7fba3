"""Triton helpers shared by the attention kernels: paged key/value blocks, query halves.

Keys are stored before rotary (cache-relative positions); a key block is rotated in registers
by its positions, in the half-split layout (x[:d/2] pairs with x[d/2:]). int8 entries are
dequantized in registers with their per-(token, head) scale.
"""

from __future__ import annotations

import os
import sys

import torch


def triton_wanted() -> bool:
    """Whether Triton's kernels can run in this process: on a CUDA device, interpreted on
    the CPU (TRITON_INTERPRET=1, set before the kernels are imported: tests), or compiled
    ahead of time by a caller that imported Triton first (`streamgrok_kernels.aot`). Elsewhere the
    package is not imported: its compiler library alone is ~70 MB resident."""
    return (os.environ.get("TRITON_INTERPRET") == "1" or "triton" in sys.modules
            or torch.cuda.is_available())


triton = None
if triton_wanted():
    try:
        import triton
        import triton.language as tl
    except ImportError:  # pragma: no cover - triton ships with torch's CUDA builds
        triton = None

if triton is not None:

    @triton.jit
    def load_key_block(
        k_ptr, ks_ptr, tables_ptr, cos_ptr, sin_ptr, table_row, kvh, n0, bound,
        stride_ks, stride_kh, stride_ss, stride_cos,
        BLOCK_N: tl.constexpr, PAGE: tl.constexpr, HALF: tl.constexpr, QUANT: tl.constexpr,
    ):
        """Keys at positions n0..n0+BLOCK_N-1 (those below `bound` valid) of one KV head,
        found through the page table row, dequantized and rotated: (k1, k2) halves [N, D/2]
        in float32, plus slots [N] (int64), valid [N] and positions [N]."""
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < bound
        page = tl.load(tables_ptr + table_row + pos // PAGE, mask=valid, other=0)
        slot = page.to(tl.int64) * PAGE + pos % PAGE
        dh = tl.arange(0, HALF)
        base = k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + dh[None, :]
        k1 = tl.load(base, mask=valid[:, None], other=0.0).to(tl.float32)
        k2 = tl.load(base + HALF, mask=valid[:, None], other=0.0).to(tl.float32)
        if QUANT:
            scale = tl.load(ks_ptr + slot * stride_ss + kvh, mask=valid, other=0.0)
            k1 = k1 * scale.to(tl.float32)[:, None]
            k2 = k2 * scale.to(tl.float32)[:, None]
        # cos/sin of position n0 + t by angle addition from the block's first row and the
        # table's first BLOCK_N rows (cached): one table row per block, not one per key
        t = tl.arange(0, BLOCK_N)
        c0 = tl.load(cos_ptr + n0 * stride_cos + dh)[None, :]
        s0 = tl.load(sin_ptr + n0 * stride_cos + dh)[None, :]
        offsets = t[:, None] * stride_cos + dh[None, :]
        ct = tl.load(cos_ptr + offsets, mask=valid[:, None], other=0.0)
        st = tl.load(sin_ptr + offsets, mask=valid[:, None], other=0.0)
        c = c0 * ct - s0 * st
        s = s0 * ct + c0 * st
        return k1 * c - k2 * s, k2 * c + k1 * s, slot, valid, pos

    @triton.jit
    def load_value_block(
        v_ptr, vs_ptr, slot, valid, kvh, stride_vs, stride_vh, stride_ss,
        DIM: tl.constexpr, QUANT: tl.constexpr, DOT: tl.constexpr,
    ):
        """Values [N, D] at `slot` of one KV head (zero where not valid), in the dot type;
        int8 values are dequantized in float32 first."""
        d = tl.arange(0, DIM)
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                    mask=valid[:, None], other=0.0)
        if QUANT:
            scale = tl.load(vs_ptr + slot * stride_ss + kvh, mask=valid, other=0.0)
            v = v.to(tl.float32) * scale.to(tl.float32)[:, None]
        return v.to(DOT)

    @triton.jit
    def qk_scores(q1, q2, k1, k2, scale, DOT: tl.constexpr, PRECISION: tl.constexpr):
        """Scaled scores [R, N] of query halves [R, D/2] (already in the dot type) against
        float32 key halves [N, D/2], float32 accumulation."""
        scores = tl.dot(q1, tl.trans(k1.to(DOT)), input_precision=PRECISION)
        scores += tl.dot(q2, tl.trans(k2.to(DOT)), input_precision=PRECISION)
        return scores * scale

    @triton.jit
    def online_softmax_step(acc, m, l_sum, scores, v, DOT: tl.constexpr,
                            PRECISION: tl.constexpr):
        """Fold one key block (masked scores [R, N], values [N, D]) into the running
        max `m`, normaliser `l_sum` and unnormalised output `acc` [R, D]."""
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp(m - m_new)
        probs = tl.exp(scores - m_new[:, None])
        acc = acc * alpha[:, None] + tl.dot(probs.to(DOT), v.to(DOT), input_precision=PRECISION)
        return acc, m_new, l_sum * alpha + tl.sum(probs, 1)

    @triton.jit
    def load_query_halves(rows_ptr, row_ok, HALF: tl.constexpr, DOT: tl.constexpr):
        """The two rotary halves [R, D/2] of query rows given by row pointers [R], in the dot
        operand type."""
        dh = tl.arange(0, HALF)
        q1 = tl.load(rows_ptr[:, None] + dh[None, :], mask=row_ok[:, None], other=0.0)
        q2 = tl.load(rows_ptr[:, None] + HALF + dh[None, :], mask=row_ok[:, None], other=0.0)
        return q1.to(DOT), q2.to(DOT)


def dot_flags(dtype) -> dict:
    """Operand type of the attention dots: the query's (bfloat16/float16 run on tensor
    cores); float32 queries use exact IEEE float32 dots, not TF32, so they match the
    reference. Triton's CPU interpreter computes bfloat16 dots from the raw bits (wrong), so
    interpreted runs use float32 operands throughout."""
    import triton.language as tl

    kinds = {"torch.bfloat16": tl.bfloat16, "torch.float16": tl.float16}
    kind = tl.float32 if os.environ.get("TRITON_INTERPRET") == "1" else kinds.get(str(dtype),
                                                                                  tl.float32)
    return {"DOT": kind, "PRECISION": "ieee" if kind == tl.float32 else "tf32"}


def kernel_flags(kv) -> dict:
    """Strides and pointers for int8 scales, or stand-ins when the pool is not quantized."""
    if kv.quantized:
        return {"ks": kv.k_scale, "vs": kv.v_scale, "stride_ss": kv.k_scale.stride(0),
                "QUANT": True}
    return {"ks": kv.k, "vs": kv.v, "stride_ss": 0, "QUANT": False}
