"""Paged decode attention with split-K and exact per-token attention mass (Triton + reference).

One query token per sequence attends to its cached tokens through a page table. Keys are
stored *before* rotary (streamgrok's cache-relative positions) and rotated in registers by
their position in the sequence; the query arrives rotated. Each program handles one
(sequence, KV head, split): all query heads of that KV head (GQA) over a range of pages, with
an online softmax; a second kernel merges the splits with log-sum-exp.

Attention mass (the H2O signal): exact probabilities need the final softmax normaliser, which
is only known after the merge. We run a cheap third pass that re-reads K only (not V), recomputes
each score and adds exp(score - lse) summed over the query heads of the KV head into a
per-token buffer. Cost: one more read of K, i.e. about +50% of the bytes of plain attention
when mass is asked for, and nothing when it is not.
"""

from __future__ import annotations

import math

import torch

from streamgrok.model.rotary import apply_rotary

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch 2.14 here
    triton = None


def reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch oracle. q [B, H, D] (rotated); pools [slots, Hkv, D] (keys not rotated);
    block_tables [B, P]; lengths [B]; cos/sin [positions, D/2]. Returns out [B, H, D] and
    mass [B, P * page_size] (summed over query heads; zero past each length)."""
    batch, heads, dim = q.shape
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    width = block_tables.shape[1] * page_size
    out = torch.zeros_like(q, dtype=torch.float32)
    mass = torch.zeros(batch, width, dtype=torch.float32, device=q.device)
    for b in range(batch):
        n = int(lengths[b])
        pos = torch.arange(n, device=q.device)
        slots = block_tables[b][pos // page_size] * page_size + pos % page_size
        k = apply_rotary(k_pool[slots].float(), cos[:n].float(), sin[:n].float())
        v = v_pool[slots].float()
        qb = q[b].float().view(kv_heads, group, dim)
        scores = torch.einsum("hgd,nhd->hgn", qb, k) / math.sqrt(dim)
        probs = scores.softmax(-1)
        out[b] = torch.einsum("hgn,nhd->hgd", probs, v).reshape(heads, dim)
        mass[b, :n] = probs.sum(dim=(0, 1))
    return out.to(q.dtype), mass


if triton is not None:

    @triton.jit
    def _query_halves(q_ptr, b, heads, g_ok, stride_qb, stride_qh, HALF: tl.constexpr):
        """The two rotary halves of the (rotated) queries of one KV head group, [G, D/2]."""
        dh = tl.arange(0, HALF)
        rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
        q1 = tl.load(rows + dh[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32)
        q2 = tl.load(rows + HALF + dh[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32)
        return q1, q2

    @triton.jit
    def _page_scores(
        q1, q2, k_ptr, tables_ptr, cos_ptr, sin_ptr, b, kvh, page_index, length,
        stride_ks, stride_kh, stride_tb, stride_cos, scale,
        PAGE: tl.constexpr, HALF: tl.constexpr,
    ):
        """Scores [G, PAGE] of one page: keys loaded through the page table and rotated in
        registers by their cache position. Returns scores, slots and which tokens exist."""
        t = tl.arange(0, PAGE)
        dh = tl.arange(0, HALF)
        pos = page_index * PAGE + t
        valid = pos < length
        page = tl.load(tables_ptr + b * stride_tb + page_index)
        slot = page * PAGE + t
        base = k_ptr + slot[:, None] * stride_ks + kvh * stride_kh
        k1 = tl.load(base + dh[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        k2 = tl.load(base + HALF + dh[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + pos[:, None] * stride_cos + dh[None, :], mask=valid[:, None],
                    other=0.0)
        s = tl.load(sin_ptr + pos[:, None] * stride_cos + dh[None, :], mask=valid[:, None],
                    other=0.0)
        r1 = k1 * c - k2 * s
        r2 = k2 * c + k1 * s
        scores = (tl.dot(q1, tl.trans(r1)) + tl.dot(q2, tl.trans(r2))) * scale
        return scores, slot, valid, pos

    @triton.jit
    def _partial_kernel(
        q_ptr, k_ptr, v_ptr, tables_ptr, lengths_ptr, cos_ptr, sin_ptr,
        out_ptr, lse_ptr,
        stride_qb, stride_qh, stride_ks, stride_kh, stride_tb, stride_cos,
        stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_ls,
        scale, pages_per_split,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, PAGE: tl.constexpr, DIM: tl.constexpr,
        HALF: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        length = tl.load(lengths_ptr + b)
        g = tl.arange(0, BLOCK_G)
        g_ok = g < GROUP
        heads = kvh * GROUP + g
        d = tl.arange(0, DIM)
        q1, q2 = _query_halves(q_ptr, b, heads, g_ok, stride_qb, stride_qh, HALF)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, DIM], tl.float32)
        first_page = split * pages_per_split
        for p in range(0, pages_per_split):
            page_index = first_page + p
            if page_index * PAGE < length:
                scores, slot, valid, pos = _page_scores(
                    q1, q2, k_ptr, tables_ptr, cos_ptr, sin_ptr, b, kvh, page_index, length,
                    stride_ks, stride_kh, stride_tb, stride_cos, scale, PAGE, HALF,
                )
                scores = tl.where(valid[None, :], scores, float("-inf"))
                m_new = tl.maximum(m, tl.max(scores, 1))
                alpha = tl.exp(m - m_new)
                probs = tl.exp(scores - m_new[:, None])
                v = tl.load(v_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                            mask=valid[:, None], other=0.0).to(tl.float32)
                acc = acc * alpha[:, None] + tl.dot(probs, v)
                l_sum = l_sum * alpha + tl.sum(probs, 1)
                m = m_new
        lse = m + tl.log(l_sum)
        out = acc / l_sum[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os
                 + d[None, :], out, mask=g_ok[:, None])
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split * stride_ls, lse, mask=g_ok)

    @triton.jit
    def _mass_kernel(
        q_ptr, k_ptr, tables_ptr, lengths_ptr, cos_ptr, sin_ptr, lse_ptr, mass_ptr,
        stride_qb, stride_qh, stride_ks, stride_kh, stride_tb, stride_cos, stride_lb,
        stride_lh, stride_mb, scale,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, PAGE: tl.constexpr, HALF: tl.constexpr,
    ):
        b = tl.program_id(0)
        page_index = tl.program_id(1)
        kvh = tl.program_id(2)
        length = tl.load(lengths_ptr + b)
        if page_index * PAGE < length:
            g = tl.arange(0, BLOCK_G)
            g_ok = g < GROUP
            heads = kvh * GROUP + g
            q1, q2 = _query_halves(q_ptr, b, heads, g_ok, stride_qb, stride_qh, HALF)
            scores, _, valid, pos = _page_scores(
                q1, q2, k_ptr, tables_ptr, cos_ptr, sin_ptr, b, kvh, page_index, length,
                stride_ks, stride_kh, stride_tb, stride_cos, scale, PAGE, HALF,
            )
            lse = tl.load(lse_ptr + b * stride_lb + heads * stride_lh, mask=g_ok, other=0.0)
            probs = tl.exp(scores - lse[:, None])
            probs = tl.where(g_ok[:, None] & valid[None, :], probs, 0.0)
            tl.atomic_add(mass_ptr + b * stride_mb + pos, tl.sum(probs, 0), mask=valid)


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    page_size: int,
    splits: int = 1,
    want_mass: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton path (CUDA, or CPU tensors under TRITON_INTERPRET=1); same contract as
    `reference`. `splits` > 1 spreads each sequence's pages over more programs (split-K)."""
    batch, heads, dim = q.shape
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    pages = block_tables.shape[1]
    per_split = -(-pages // splits)
    partial = torch.empty(batch, heads, splits, dim, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, heads, splits), float("-inf"), dtype=torch.float32,
                     device=q.device)
    block_g = max(16, triton.next_power_of_2(group))  # tl.dot needs >= 16 rows
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    scale = 1.0 / math.sqrt(dim)
    _partial_kernel[(batch, kv_heads, splits)](
        q, k_pool, v_pool, block_tables, lengths, cos, sin, partial, lse,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), block_tables.stride(0),
        cos.stride(0), partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0),
        lse.stride(1), lse.stride(2), scale, per_split,
        GROUP=group, BLOCK_G=block_g, PAGE=page_size, DIM=dim, HALF=dim // 2,
    )
    # merge the splits with log-sum-exp (tiny: [B, H, splits]); a split past a sequence's end
    # has lse -inf and NaN partials, which get weight zero here
    total = torch.logsumexp(lse, dim=-1)
    weights = torch.nan_to_num(torch.exp(lse - total[..., None]))
    out = (torch.nan_to_num(partial) * weights[..., None]).sum(dim=2).to(q.dtype)
    mass = None
    if want_mass:
        mass = torch.zeros(batch, pages * page_size, dtype=torch.float32, device=q.device)
        total = total.contiguous()
        _mass_kernel[(batch, pages, kv_heads)](
            q, k_pool, block_tables, lengths, cos, sin, total, mass,
            q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
            block_tables.stride(0), cos.stride(0), total.stride(0), total.stride(1),
            mass.stride(0), scale,
            GROUP=group, BLOCK_G=block_g, PAGE=page_size, HALF=dim // 2,
        )
    return out, mass
