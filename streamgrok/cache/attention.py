"""Attention over gathered cache tokens (the CPU path), with optional attention mass.

Attention mass is what eviction scores come from: for each cached token, the softmax
probability it received, summed over query heads and over the observed query rows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past: int,
    mass_rows: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Queries q [m, heads, d] at positions past..past+m-1 attend to k, v [past+m, kv_heads, d].

    Returns the output [m, heads, d] and, when `mass_rows` is given, the attention mass [n]
    that each key received from the last `mass_rows` queries (all heads summed).
    """
    m, heads, d = q.shape
    n, kv_heads, _ = k.shape
    causal = torch.ones(m, n, dtype=torch.bool, device=q.device).tril(diagonal=past)
    if mass_rows is None:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=causal,
            enable_gqa=True,
        )
        return out.transpose(0, 1), None
    group = heads // kv_heads
    qg = q.reshape(m, kv_heads, group, d).permute(1, 2, 0, 3)  # [kvh, g, m, d]
    kt = k.permute(1, 2, 0)  # [kvh, d, n]
    scores = (qg @ kt[:, None]) / math.sqrt(d)  # [kvh, g, m, n]
    probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    out = probs @ v.transpose(0, 1)[:, None]  # [kvh, g, m, d]
    mass = probs[:, :, m - min(mass_rows, m) :, :].sum(dim=(0, 1, 2))
    return out.permute(2, 0, 1, 3).reshape(m, heads, d), mass.float()


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    want_mass: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One query per sequence: q [b, heads, d] against padded k, v [b, n, kv_heads, d].

    `lengths[i]` keys of row i are valid. Returns output [b, heads, d] and, when asked, the
    attention mass [b, n] each key received (zero on padding).
    """
    b, heads, d = q.shape
    n, kv_heads = k.shape[1], k.shape[2]
    valid = torch.arange(n, device=q.device)[None, :] < lengths[:, None]  # [b, n]
    if not want_mass:
        out = F.scaled_dot_product_attention(
            q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=valid[:, None, None, :], enable_gqa=True,
        )
        return out[:, :, 0, :], None
    group = heads // kv_heads
    qg = q.reshape(b, kv_heads, group, d)
    scores = torch.einsum("bhgd,bnhd->bhgn", qg, k) / math.sqrt(d)
    probs = scores.masked_fill(~valid[:, None, None, :], float("-inf")).softmax(dim=-1)
    out = torch.einsum("bhgn,bnhd->bhgd", probs, v).reshape(b, heads, d)
    return out, probs.sum(dim=(1, 2)).float()
