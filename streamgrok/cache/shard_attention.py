"""Exact attention over keys split across ranks: each rank attends to its shard and returns
its partial output with the log-sum-exp of its scores; the merge weighs the partials by
exp(lse_rank - lse_all), the same algebra as split-K decoding (flash-decoding)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class ShardPartial:
    """One rank's attention over its keys for some queries."""

    out: torch.Tensor  # [queries, heads, head_dim] float32, normalised over this shard
    lse: torch.Tensor  # [queries, heads] float32; -inf where the shard has no allowed key
    scores: torch.Tensor | None  # [queries, heads, keys] float32 logits (kept for the mass)


def shard_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    keep_scores: bool,
) -> ShardPartial:
    """Causal attention of rotated q [n, H, D] at `query_positions` [n] over this shard's
    rotated k, v [m, kv_heads, D] at `key_positions` [m] (a key is visible to a query at the
    same or a later position). Grouped-query heads share their KV head."""
    n, heads, dim = q.shape
    m, kv_heads, _ = k.shape
    group = heads // kv_heads
    qg = q.float().reshape(n, kv_heads, group, dim).permute(1, 2, 0, 3)  # [kvh, g, n, D]
    kf = k.float().permute(1, 2, 0)  # [kvh, D, m]
    scores = (qg @ kf[:, None]) / math.sqrt(dim)  # [kvh, g, n, m]
    visible = key_positions[None, :] <= query_positions[:, None]  # [n, m]
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [kvh, g, n]
    probs = torch.exp(scores - lse.clamp_min(torch.finfo(torch.float32).min)[..., None])
    out = probs @ v.float().transpose(0, 1)[:, None]  # [kvh, g, n, D]
    return ShardPartial(
        out=out.permute(2, 0, 1, 3).reshape(n, heads, dim),
        lse=lse.permute(2, 0, 1).reshape(n, heads),
        scores=scores.permute(2, 0, 1, 3).reshape(n, heads, m) if keep_scores else None,
    )


def empty_partial(queries: int, heads: int, dim: int, device: torch.device) -> ShardPartial:
    """The partial of a shard that holds no key of the sequence."""
    return ShardPartial(
        out=torch.zeros(queries, heads, dim, device=device),
        lse=torch.full((queries, heads), float("-inf"), device=device),
        scores=torch.zeros(queries, heads, 0, device=device),
    )


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine per-rank partials outs [R, n, H, D], lses [R, n, H] into the attention over all
    keys: (out [n, H, D], lse [n, H]). Every query must see a key on some rank."""
    total = torch.logsumexp(lses, dim=0)  # [n, H]
    weights = torch.exp(lses - total[None])  # 0 for ranks without keys
    return (weights[..., None] * outs).sum(dim=0), total


def shard_mass(scores: torch.Tensor, total_lse: torch.Tensor, last_queries: int) -> torch.Tensor:
    """Attention probability each of this shard's keys got from the last `last_queries`
    queries, summed over heads, normalised over all ranks' keys: [m]."""
    rows = slice(scores.shape[0] - min(last_queries, scores.shape[0]), None)
    return torch.exp(scores[rows] - total_lse[rows, :, None]).sum(dim=(0, 1))
