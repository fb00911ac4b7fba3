"""Recall: a question's queries score the host tier's pages and the best come back.

For one layer of an answer's fork, with the question's last queries (unrotated, and the cache
positions they had):

1. exact attention of those queries over the tokens resident in the fork gives, per query and
   head, the log-sum-exp `lse` of their logits;
2. every host page is scored by an upper bound on the logit any of its keys can get: a page's
   keys lie in a ball (center c, radius r) per KV head, so q . R(p) k <= q . R(p) c + |q| r for
   the rotation R(p) of the position p the page would take back in the fork (its insertion
   point among the resident tokens). The page's score is the largest bound minus `lse` over
   queries and heads: the log of the most attention one of its tokens could draw, relative to
   everything resident;
3. pages are taken best first by that score within the recall budget (tokens per layer): the
   pages where some head may attend sharply. The estimated hit rate, the share of attention
   resident after recall, counts each page's mass as its token count times the mean exp of
   its logits minus `lse`, with the logits as normal around the center's (variance from the
   keys' variance per rotary plane, which a rotation keeps, times the query's squared length
   there): exp(var / 2), or less where n keys cannot sample the tail that carries it. When
   the estimate is below the guard's threshold, more pages are taken, those adding most to
   it first, until it is met or the position cap (the model's trained context) is hit.

The engine recalls inside the question's own prefill (`recaller`): at each layer, before the
question attends, its queries at that layer choose what comes back to that layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from streamgrok.cache.tokens import STREAM
from streamgrok_kernels.ops import KernelOps


@dataclass
class QueryCapture:
    """The last queries of an answer's prompt, per layer: unrotated [R, H, D] and the cache
    positions they were computed at [R]."""

    keep: int
    layers: list[tuple[torch.Tensor, torch.Tensor] | None] = field(default_factory=list)

    def add(self, layer: int, q: torch.Tensor, positions: torch.Tensor) -> None:
        while len(self.layers) <= layer:
            self.layers.append(None)
        old = self.layers[layer]
        if old is not None:
            q, positions = torch.cat([old[0], q]), torch.cat([old[1], positions])
        self.layers[layer] = (q[-self.keep:].clone(), positions[-self.keep:].clone())


@dataclass
class PageChoice:
    """Which host pages of one layer come back, and what recall estimates of that."""

    index: torch.Tensor  # page indices into the tier layer, best first
    hit_rate: float  # estimated share of attention resident after recall
    guard: bool  # the guard took pages beyond the recall budget
    limited: bool = False  # the position cap kept pages back that were wanted


@dataclass
class RecallResult:
    """What one answer's recall did, over all layers."""

    tokens: int = 0  # tokens brought back, summed over layers
    layer_tokens: list[int] = field(default_factory=list)
    hit_rate: float = 1.0  # estimated, mean over layers (1.0: nothing was off the working set)
    guard: bool = False  # the guard extended at least one layer's recall
    limited: bool = False  # cut short by the position cap or free pages
    bytes_moved: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"kv_hit_rate": round(self.hit_rate, 4), "recalled_tokens": self.tokens,
                "recall_guard": self.guard, "recall_ms": round(self.seconds * 1e3, 2)}


def causal_logits(q_rot: torch.Tensor, k_rot: torch.Tensor, positions: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """Attention logits [R, kvh, H/kvh, n] of queries q_rot [R, H, D] at `positions` [R] over
    keys k_rot [n, kvh, D] (both rotated by their positions), -inf past each query."""
    rows, heads, dim = q_rot.shape
    kv_heads = k_rot.shape[1]
    qg = q_rot.float().view(rows, kv_heads, heads // kv_heads, dim)
    logits = torch.einsum("rkgd,nkd->rkgn", qg, k_rot.float()) * scale
    future = torch.arange(k_rot.shape[0], device=q_rot.device)[None, :] > positions[:, None]
    return logits.masked_fill(future[:, None, None, :], float("-inf"))


def resident_lse(q_rot: torch.Tensor, k_rot: torch.Tensor, positions: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """log-sum-exp over the resident keys of each query's logits; [R, kvh, H/kvh]."""
    return torch.logsumexp(causal_logits(q_rot, k_rot, positions, scale), dim=-1)


def score_pages(q_rot: torch.Tensor, lse: torch.Tensor, centers_rot: torch.Tensor,
                radii: torch.Tensor, plane_vars: torch.Tensor, counts: torch.Tensor,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Page scores [P] (the largest bound on a token's logit minus `lse`, over queries and
    heads) and estimated attention mass [R * H, P] relative to the resident mass, for host
    pages with rotated centers [P, kvh, D], radii [P, kvh], per-plane key variances
    [P, kvh, D/2] and token counts [P]."""
    rows, heads, dim = q_rot.shape
    kv_heads = centers_rot.shape[1]
    qg = q_rot.float().view(rows, kv_heads, heads // kv_heads, dim)
    center = torch.einsum("rkgd,pkd->rkgp", qg, centers_rot.float()) * scale
    reach = torch.linalg.vector_norm(qg, dim=-1)[..., None] * radii.float().T[None, :, None, :]
    bound = center + reach * scale - lse[..., None]
    # the page's logits have the center's as mean and variance var = scale^2 times the sum
    # over rotary planes of the plane's key variance times the query's squared length in it
    # (a rotation keeps both). For normal logits the mean exp is exp(var / 2); n keys only
    # reach that when n is large against the spread, since the tail that carries it is
    # sampled a few times at most. So the estimate is the smaller of exp(var / 2) and one
    # key at the expected largest of n draws (sigma sqrt(2 ln n)) with the rest at the mean.
    # Never above the ball's bound.
    half = dim // 2
    q_planes = qg[..., :half] ** 2 + qg[..., half:] ** 2  # [R, kvh, G, D/2]
    variance = torch.einsum("rkgj,pkj->rkgp", q_planes, plane_vars.float()) * scale ** 2
    n = counts.to(center.device, torch.float32).clamp(min=1)
    largest = (2 * torch.log(n) * variance).sqrt()
    one_key = torch.logaddexp(largest, torch.log(n - 1)) - torch.log(n)
    mean_exp = torch.minimum(center + torch.minimum(variance / 2, one_key) - lse[..., None],
                             bound)
    mass = n * torch.exp(mean_exp)
    return bound.amax(dim=(0, 1, 2)), mass.reshape(-1, centers_rot.shape[0])


def page_gains(mass: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From estimated masses [Q, P] (per query and head, relative to the resident mass): what
    each page adds to the estimated hit rate [P], and that rate with no page taken (a scalar
    tensor). A query's hit rate after taking pages S is (1 + their mass) / (1 + its total),
    so the mean over queries is that base plus the gains of S summed. In float64: with every
    page taken the rate must come out as 1, which a guard asked for 1 waits for."""
    mass = mass.double()
    weight = 1.0 / (1.0 + mass.sum(1, keepdim=True))
    return (mass * weight).mean(0), weight.mean()


def choose_pages(score: torch.Tensor, gain: torch.Tensor, base: torch.Tensor,
                 counts: torch.Tensor, budget_tokens: int, cap_tokens: int,
                 min_hit_rate: float) -> PageChoice:
    """Best-scored pages first, as many as fit `budget_tokens` (the pages where some head
    may attend sharply); then, while the estimated hit rate (`base` plus the `gain` of each
    page taken, `page_gains`) is below `min_hit_rate`, more, those adding most first, never
    past `cap_tokens` in all."""
    # small arrays, many layers: numpy's per-call cost is a tenth of torch's
    gain = gain.detach().cpu().numpy()
    sizes = counts.cpu().numpy()
    by_score = np.argsort(-score.detach().cpu().numpy(), kind="stable")
    within = int((np.cumsum(sizes[by_score]) <= budget_tokens).sum())
    rest = np.ones(score.numel(), dtype=bool)
    rest[by_score[:within]] = False
    rest = np.flatnonzero(rest)
    order = np.concatenate([by_score[:within], rest[np.argsort(-gain[rest], kind="stable")]])
    hit = float(base) + np.concatenate([[0.0], np.cumsum(gain[order])])  # after k pages
    capped = int((np.cumsum(sizes[order]) <= cap_tokens).sum())
    wanted = within
    guard = False
    if float(hit[min(wanted, capped)]) < min_hit_rate:
        reached = np.flatnonzero(hit >= min_hit_rate)
        needed = int(reached[0]) if reached.size else hit.size - 1
        guard = needed > wanted and capped > wanted
        wanted = max(wanted, needed)
    taken = min(wanted, capped)
    return PageChoice(torch.from_numpy(order[:taken].astype(np.int64)), float(hit[taken]),
                      guard, limited=wanted > capped)


def rotate(kernels: KernelOps, x: torch.Tensor, positions: torch.Tensor,
           tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [n, heads, D] rotated by integer positions [n]."""
    cos, sin = tables
    return kernels.rotate(x, positions.to(x.device, torch.int64), cos, sin)


def attention_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def insert_tokens(pool, kernels: KernelOps, rec, k: torch.Tensor, v: torch.Tensor,
                  meta: torch.Tensor, release_old: bool = True) -> list[int]:
    """Put recalled tokens (K/V [m, kvh, D] unrotated, records [m, META_COLUMNS], both in
    stream order) back into the layer `rec` in stream order, on fresh pages of `pool`: the
    resident entries are copied as stored, the recalled ones written like new tokens. The old
    pages are released (shared ones stay with their other owner) unless `release_old` is
    False: then the caller holds them (to put the layer back: `Recaller.end_step`) and must
    release them. Returns the old pages. Raises CacheFullError, changing nothing, when the pool has
    too few free pages."""
    n, m = rec.length, k.shape[0]
    resident_stream = rec.column(STREAM).contiguous()
    recalled_stream = meta[:, STREAM].contiguous()
    # both runs are in stream order: each token's place in the merged layer is its index in
    # its own run plus how many of the other run go before it (resident first on a tie)
    to_resident = torch.searchsorted(recalled_stream, resident_stream) + torch.arange(n)
    to_recalled = torch.searchsorted(resident_stream, recalled_stream, right=True) + \
        torch.arange(m)
    pages = pool.allocate(math.ceil((n + m) / pool.page_size))
    old_slots, old_pages = rec.slots(), rec.pages
    rec.set_pages(pages)
    slots = rec.slot_table()
    device = pool.paged_kv().k.device
    pool.move_raw(old_slots.to(device), slots[to_resident].to(device))
    kernels.kv_append(pool.paged_kv(), slots[to_recalled].to(device), k, v)
    merged = meta.new_empty(n + m, meta.shape[1])
    merged[to_resident], merged[to_recalled] = rec.meta[:n], meta
    score = rec.score.new_zeros(n + m)
    score[to_resident.to(score.device)] = rec.score[:n]
    rec.replace_records(merged, score)
    if release_old:
        pool.release(old_pages)
    return old_pages
