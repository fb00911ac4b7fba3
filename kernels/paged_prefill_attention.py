"""Paged prefill attention: chunks of new tokens from several sequences in one launch.

The queries of sequence b are rows cu_q[b]:cu_q[b+1] of q (rotated, at cache positions
past[b], past[b] + 1, ...). Their keys and values are already in the pages (appended first):
each query attends to every cached token before the chunk and causally within it. Keys are
rotated in registers as in decode; int8 entries are dequantized in registers.

Optional attention mass (the SnapKV / H2O signal over an observation window): the probability
each cached token receives from the last `mass_window` queries of its sequence's chunk, summed
over those queries and all heads. A prefill chunk is compute-bound, so the exact probabilities
come from a second pass that recomputes the window's scores against the LSE the first pass
stored; it costs about window / chunk of the first pass.
"""

from __future__ import annotations

import math

import torch

from streamgrok_kernels.common import dot_flags, kernel_flags, triton
from streamgrok_kernels.paged_kv import PagedKV, table_slots
from streamgrok_kernels.paged_read import PagedReader

# A chunk of at most this many queries (a question, a short note) in float32 attends by two
# matrix products with each KV head's query heads stacked, [G * m, D] x [D, n]: for 19 queries
# over 2,000 keys that was ~1.0 ms against SDPA's ~1.3 (2 cores), whose flash kernel tiles
# the few rows poorly. Longer chunks, and any chunk whose score matrix would pass
# SHORT_CHUNK_SCORES floats (a question over a very long full cache), keep SDPA, which never
# holds the whole matrix.
SHORT_CHUNK_ROWS = 64
SHORT_CHUNK_SCORES = 1 << 23  # 32 MiB of float32 scores

if triton is not None:
    import triton.language as tl

    from streamgrok_kernels.common import (
        load_key_block,
        load_query_halves,
        load_value_block,
        online_softmax_step,
        qk_scores,
    )


def product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries q [m, H, D] at positions past..past+m-1 attend causally to k, v [>= past+m,
    kv_heads, D] (rotated) by two matrix products per KV head, its query heads stacked as
    rows. Returns out [m, H, D] and the probabilities [kv_heads, H / kv_heads, m, n]."""
    m, heads, dim = q.shape
    n, kv_heads, _ = k.shape
    group = heads // kv_heads
    stacked = q.reshape(m, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(
        kv_heads, group * m, dim) * (1.0 / math.sqrt(dim))
    scores = torch.bmm(stacked, k.permute(1, 2, 0)).view(kv_heads, group, m, n)
    allowed = torch.ones(m, n - past, dtype=torch.bool, device=q.device).tril()
    scores[..., past:].masked_fill_(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.bmm(probs.view(kv_heads, group * m, n), v.permute(1, 0, 2))  # [kvh, G*m, D]
    return out.view(kv_heads, group, m, dim).permute(2, 0, 1, 3).reshape(m, heads, dim), probs


def dense_chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, mass_rows: int | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Queries q [m, H, D] at positions past..past+m-1 attend causally to k, v [>= past+m,
    kv_heads, D] (rotated). Returns out [m, H, D] and, when `mass_rows` is given, the mass
    [n] each key received from the last `mass_rows` queries, summed over heads."""
    m = q.shape[0]
    if mass_rows is None:
        causal = torch.ones(m, k.shape[0], dtype=torch.bool, device=q.device).tril(
            diagonal=past)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=causal,
            enable_gqa=True,
        )
        return out.transpose(0, 1), None
    out, probs = product_attention(q, k, v, past)
    mass = probs[:, :, m - min(mass_rows, m):, :].sum(dim=(0, 1, 2))
    return out, mass.float()


def reference(
    q: torch.Tensor,
    kv: PagedKV,
    block_tables: torch.Tensor,
    cu_q: torch.Tensor,
    past: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    max_q: int,
    mass_window: int | None = None,
    reader: PagedReader | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU path and the oracle. q [T, H, D]; block_tables [B, P]; cu_q [B + 1] row offsets;
    past [B] tokens cached before each chunk; cos/sin [>= P * page_size, D/2]; max_q the
    longest chunk; `reader` reads the pages (default: eagerly). Returns out [T, H, D] and,
    with `mass_window`, mass [B, P * page_size]."""
    batch = block_tables.shape[0]
    width = block_tables.shape[1] * kv.page_size
    reader = reader or PagedReader(compiled=False)
    k, v = reader.read(kv, table_slots(block_tables, width, kv.page_size), cos, sin,
                       q.dtype)  # [B, W, kvh, D], K rotated
    out = torch.empty_like(q)
    bounds = cu_q.tolist()
    starts = past.tolist()
    if mass_window is not None:
        mass = torch.zeros(batch, width, dtype=torch.float32, device=q.device)
        for b in range(batch):
            lo, hi = bounds[b], bounds[b + 1]
            total = starts[b] + hi - lo
            out[lo:hi], mass[b, :total] = dense_chunk_attention(
                q[lo:hi], k[b, :total], v[b, :total], starts[b], mass_window)
        return out, mass
    if max_q <= SHORT_CHUNK_ROWS and q.dtype == torch.float32 and \
            max_q * q.shape[1] * width <= SHORT_CHUNK_SCORES:
        for b in range(batch):
            lo, hi = bounds[b], bounds[b + 1]
            if hi > lo:
                total = starts[b] + hi - lo
                out[lo:hi] = product_attention(q[lo:hi], k[b, :total], v[b, :total],
                                               starts[b])[0]
        return out, None
    offsets = torch.arange(max_q, device=q.device)
    counts = cu_q[1:] - cu_q[:-1]
    clamped = torch.minimum(offsets[None, :], counts[:, None] - 1)  # padding repeats a row
    rows = cu_q[:-1, None] + clamped
    positions = past[:, None] + clamped
    allowed = torch.arange(width, device=q.device)[None, None, :] <= positions[:, :, None]
    result = torch.nn.functional.scaled_dot_product_attention(
        q[rows].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=allowed[:, None], enable_gqa=True,
    ).transpose(1, 2)  # [B, max_q, H, D]
    valid = offsets[None, :] < counts[:, None]
    out[rows[valid]] = result[valid]
    return out, None


if triton is not None:

    @triton.jit
    def _prefill_kernel(
        q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, tables_ptr, cu_ptr, past_ptr, cos_ptr, sin_ptr,
        out_ptr, lse_ptr,
        stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ss,
        stride_tb, stride_cos, stride_ot, stride_oh, stride_lt,
        scale,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        PAGE: tl.constexpr, DIM: tl.constexpr, HALF: tl.constexpr, QUANT: tl.constexpr,
        WANT_LSE: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0)
        block = tl.program_id(1)
        h = tl.program_id(2)
        kvh = h // GROUP
        first = tl.load(cu_ptr + b)
        count = tl.load(cu_ptr + b + 1) - first
        if block * BLOCK_M < count:
            start = tl.load(past_ptr + b)
            rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = rows < count
            query_pos = start + rows
            tokens = (first + rows).to(tl.int64)
            q1, q2 = load_query_halves(q_ptr + tokens * stride_qt + h * stride_qh, row_ok,
                                       HALF, DOT)
            hi = start + tl.minimum(count, (block + 1) * BLOCK_M)
            m = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_sum = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, DIM], tl.float32)
            for n0 in range(0, hi, BLOCK_N):
                k1, k2, slot, valid, pos = load_key_block(
                    k_ptr, ks_ptr, tables_ptr, cos_ptr, sin_ptr, b * stride_tb, kvh, n0, hi,
                    stride_ks, stride_kh, stride_ss, stride_cos, BLOCK_N, PAGE, HALF, QUANT,
                )
                scores = qk_scores(q1, q2, k1, k2, scale, DOT, PRECISION)
                allowed = valid[None, :] & (pos[None, :] <= query_pos[:, None])
                scores = tl.where(allowed, scores, float("-inf"))
                v = load_value_block(v_ptr, vs_ptr, slot, valid, kvh, stride_vs, stride_vh,
                                     stride_ss, DIM, QUANT, DOT)
                acc, m, l_sum = online_softmax_step(acc, m, l_sum, scores, v, DOT, PRECISION)
            d = tl.arange(0, DIM)
            out = acc / l_sum[:, None]
            tl.store(out_ptr + tokens[:, None] * stride_ot + h * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
            if WANT_LSE:
                tl.store(lse_ptr + tokens * stride_lt + h, m + tl.log(l_sum), mask=row_ok)

    @triton.jit
    def _window_mass_kernel(
        q_ptr, k_ptr, ks_ptr, tables_ptr, cu_ptr, past_ptr, cos_ptr, sin_ptr, lse_ptr,
        mass_ptr, window,
        stride_qt, stride_qh, stride_ks, stride_kh, stride_ss, stride_tb, stride_cos,
        stride_lt, stride_mb,
        scale,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        PAGE: tl.constexpr, HALF: tl.constexpr, QUANT: tl.constexpr,
        DOT: tl.constexpr, PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0)
        n0 = tl.program_id(1) * BLOCK_N
        kvh = tl.program_id(2)
        first = tl.load(cu_ptr + b)
        count = tl.load(cu_ptr + b + 1) - first
        start = tl.load(past_ptr + b)
        if n0 < start + count:
            k1, k2, _, valid, pos = load_key_block(
                k_ptr, ks_ptr, tables_ptr, cos_ptr, sin_ptr, b * stride_tb, kvh, n0,
                start + count, stride_ks, stride_kh, stride_ss, stride_cos,
                BLOCK_N, PAGE, HALF, QUANT,
            )
            total = tl.zeros([BLOCK_N], tl.float32)
            for g in range(0, GROUP):
                h = kvh * GROUP + g
                for r0 in range(tl.maximum(count - window, 0), count, BLOCK_M):
                    rows = r0 + tl.arange(0, BLOCK_M)
                    row_ok = rows < count
                    tokens = (first + rows).to(tl.int64)
                    q1, q2 = load_query_halves(q_ptr + tokens * stride_qt + h * stride_qh,
                                               row_ok, HALF, DOT)
                    scores = qk_scores(q1, q2, k1, k2, scale, DOT, PRECISION)
                    lse = tl.load(lse_ptr + tokens * stride_lt + h, mask=row_ok, other=0.0)
                    allowed = (row_ok[:, None] & valid[None, :]
                               & (pos[None, :] <= start + rows[:, None]))
                    probs = tl.where(allowed, tl.exp(scores - lse[:, None]), 0.0)
                    total += tl.sum(probs, 0)
            tl.atomic_add(mass_ptr + b * stride_mb + pos, total, mask=valid)


def paged_prefill_attention(
    q: torch.Tensor,
    kv: PagedKV,
    block_tables: torch.Tensor,
    cu_q: torch.Tensor,
    past: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    max_q: int,
    mass_window: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton path; same contract as `reference`. Blocks of queries x keys default to 64 x 64
    on CUDA and 16 x 32 when interpreted."""
    block_m = block_m or (64 if q.is_cuda else 16)
    block_n = block_n or (64 if q.is_cuda else 32)
    tokens, heads, dim = q.shape
    batch = block_tables.shape[0]
    width = block_tables.shape[1] * kv.page_size
    group = heads // kv.kv_heads
    out = torch.empty_like(q)
    want_mass = mass_window is not None
    lse = torch.empty(tokens if want_mass else 1, heads, dtype=torch.float32, device=q.device)
    flags = kernel_flags(kv)
    scale = 1.0 / math.sqrt(dim)
    common = dict(PAGE=kv.page_size, HALF=dim // 2, QUANT=flags["QUANT"], GROUP=group,
                  BLOCK_M=block_m, BLOCK_N=block_n, **dot_flags(q.dtype))
    _prefill_kernel[(batch, -(-max_q // block_m), heads)](
        q, kv.k, kv.v, flags["ks"], flags["vs"], block_tables, cu_q, past, cos, sin, out, lse,
        q.stride(0), q.stride(1), kv.k.stride(0), kv.k.stride(1), kv.v.stride(0),
        kv.v.stride(1), flags["stride_ss"], block_tables.stride(0), cos.stride(0),
        out.stride(0), out.stride(1), lse.stride(0), scale,
        DIM=dim, WANT_LSE=want_mass, **common,
    )
    if not want_mass:
        return out, None
    mass = torch.zeros(batch, width, dtype=torch.float32, device=q.device)
    _window_mass_kernel[(batch, -(-width // block_n), kv.kv_heads)](
        q, kv.k, flags["ks"], block_tables, cu_q, past, cos, sin, lse, mass, mass_window,
        q.stride(0), q.stride(1), kv.k.stride(0), kv.k.stride(1), flags["stride_ss"],
        block_tables.stride(0), cos.stride(0), lse.stride(0), mass.stride(0), scale,
        **common,
    )
    return out, mass
