"""Eviction policies: which tokens of one (sequence, layer) to keep.

Every policy shares one selection rule and differs only in its importance score:

1. mandatory: protected tokens and attention sinks (the first `sink_tokens` of the stream);
2. the most recent `window` tokens;
3. the rest ranked by the policy's score, best first, until the layer budget is full.

Selection works on groups: a group is one token, or all tokens of one frame when eviction is
frame-aware, so a frame is kept or evicted whole. Groups are ranked by mean token score (for
frames of equal size this is the summed score).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from streamgrok.cache.config import CacheConfig
from streamgrok.cache.tokens import GROUP, MODALITY, PROTECTED, SOURCE, STREAM, LayerTokens
from streamgrok.errors import CacheFullError
from streamgrok.modality import Modality


@dataclass
class LayerView:
    """What a scorer may look at: the layer's records and, lazily, its keys and values."""

    tokens: LayerTokens
    read_kv: Callable[[], tuple[torch.Tensor, torch.Tensor]]  # [n, kv_heads, head_dim] each
    # unit CLIP embeddings of the sequence's frames by source (the frames' index), when known
    frame_embeddings: dict[int, torch.Tensor] | None = None


class Scorer(Protocol):
    """Importance per cached token (higher = keep)."""

    accumulates_attention: bool
    observation_window: int | None

    def score(self, view: LayerView) -> torch.Tensor: ...


class RecencyScorer:
    """StreamingLLM: nothing but sinks and the most recent tokens survive."""

    accumulates_attention = False
    observation_window = None

    def score(self, view: LayerView) -> torch.Tensor:
        return view.tokens.column(STREAM).float()


class AttentionMassScorer:
    """H2O heavy hitters: attention mass accumulated (with decay) by the attention itself."""

    accumulates_attention = True
    observation_window = None

    def score(self, view: LayerView) -> torch.Tensor:
        return view.tokens.scores()


class ObservationScorer:
    """SnapKV: attention mass from each chunk's last `window` queries, max-pooled so that
    neighbours of important tokens survive with them."""

    accumulates_attention = True

    def __init__(self, window: int, pool: int) -> None:
        self.observation_window = window
        self.pool = pool

    def score(self, view: LayerView) -> torch.Tensor:
        raw = view.tokens.scores()
        if self.pool <= 1 or raw.numel() < self.pool:
            return raw
        return F.max_pool1d(raw[None, None], self.pool, stride=1, padding=self.pool // 2)[0, 0]


class RedundancyScorer:
    """Score-free (InfiniPot-V TaR + VaN): a token whose key is nearly repeated by a more
    recent key is redundant (static video, repeated filler); novel tokens with large values
    are kept. Needs no attention probabilities, so it works with any attention kernel."""

    accumulates_attention = False
    observation_window = None

    def __init__(self, refs: int) -> None:
        self.refs = refs

    def score(self, view: LayerView) -> torch.Tensor:
        keys, values = view.read_kv()
        n = keys.shape[0]
        keys = F.normalize(keys.float(), dim=-1).transpose(0, 1)  # [heads, n, d]
        start = max(0, n - self.refs)
        refs = keys[:, start:]  # the most recent tokens serve as references
        sim = keys @ refs.transpose(1, 2)  # [heads, n, r]
        later = torch.arange(start, n)[None, :] > torch.arange(n)[:, None]  # ref newer than i
        sim = sim.masked_fill(~later[None], -1.0)
        redundancy = sim.amax(dim=-1).mean(dim=0)  # [n]
        value_norm = values.float().norm(dim=-1).mean(dim=-1)
        return (1.0 - redundancy) * (value_norm / value_norm.mean().clamp_min(1e-6))


def make_scorer(config: CacheConfig) -> Scorer:
    """The scorer of the configured policy."""
    if config.policy in ("full", "sink_window"):
        return RecencyScorer()
    if config.policy == "h2o":
        return AttentionMassScorer()
    if config.policy in ("snapkv", "pyramid"):
        return ObservationScorer(config.snapkv_window, config.snapkv_pool)
    if config.policy == "redundancy":
        return RedundancyScorer(config.redundancy_refs)
    raise ValueError(f"unknown eviction policy {config.policy!r}")


def select_keep(
    view: LayerView,
    budget: int,
    scorer: Scorer,
    config: CacheConfig,
) -> torch.Tensor:
    """Sorted indices of the tokens to keep; at most `budget` of them."""
    tokens = view.tokens
    n = tokens.length
    if n <= budget:
        return torch.arange(n)
    group_col = GROUP if config.frame_aware else STREAM
    mandatory_tok = (tokens.column(PROTECTED) > 0) | (tokens.column(STREAM) < config.sink_tokens)
    # mandatory tokens split off from their frame, so a sink never drags a whole frame along
    key = tokens.column(group_col) * 2 + mandatory_tok.double()
    _, group = torch.unique_consecutive(key, return_inverse=True)
    num_groups = int(group[-1]) + 1
    sizes = torch.bincount(group, minlength=num_groups)
    mandatory = torch.bincount(group, weights=mandatory_tok.double(), minlength=num_groups) > 0
    mandatory_size = int(sizes[mandatory].sum())
    if mandatory_size > budget:
        raise CacheFullError(
            f"protected tokens and attention sinks ({mandatory_size}) exceed the layer budget "
            f"({budget}); raise the KV budget or protect less"
        )
    keep = mandatory.clone()
    room = budget - mandatory_size

    window = room if isinstance(scorer, RecencyScorer) else min(room, _window(config, budget))
    newest_first = torch.arange(num_groups - 1, -1, -1)
    candidate = ~keep[newest_first]
    sizes_newest = torch.where(candidate, sizes[newest_first], 0)
    in_window = candidate & (sizes_newest.cumsum(0) <= window)
    keep[newest_first[in_window]] = True
    room -= int(sizes[newest_first[in_window]].sum())

    if room > 0 and not bool(keep.all()):
        token_score = scorer.score(view).double()
        group_score = torch.bincount(group, weights=token_score, minlength=num_groups) / sizes
        if config.frame_aware and view.frame_embeddings and not isinstance(scorer,
                                                                            RecencyScorer):
            group_score = group_score * frame_novelty(tokens, group, num_groups,
                                                      view.frame_embeddings,
                                                      config.frame_repeat_similarity)
        group_score = group_score.masked_fill(keep, float("-inf"))
        order = torch.argsort(group_score, descending=True, stable=True)
        order = order[~keep[order]]
        fits = sizes[order].cumsum(0) <= room
        keep[order[fits]] = True
    return torch.nonzero(keep[group], as_tuple=False).flatten()


def frame_novelty(tokens: LayerTokens, group: torch.Tensor, num_groups: int,
                  embeddings: dict[int, torch.Tensor], repeat: float) -> torch.Tensor:
    """A factor per group: a frame whose CLIP embedding a newer cached frame repeats (cosine
    similarity >= `repeat`: the same static scene) says nothing the newer one does not, and
    goes before every other group (factor 1e-3, which keeps their own order); the rest 1."""
    factor = torch.ones(num_groups, dtype=torch.float64)
    first = torch.zeros(num_groups, dtype=torch.int64)
    first.scatter_reduce_(0, group, torch.arange(group.numel()), "amin", include_self=False)
    is_frame = tokens.column(MODALITY)[first] == int(Modality.FRAME)
    sources = tokens.column(SOURCE)[first].long()
    frames = [g for g in torch.nonzero(is_frame).flatten().tolist()
              if int(sources[g]) in embeddings]
    if len(frames) < 2:
        return factor
    vectors = torch.stack([embeddings[int(sources[g])].float() for g in frames])
    sim = vectors @ vectors.T
    newer = torch.arange(len(frames))[None, :] > torch.arange(len(frames))[:, None]
    repeated = sim.masked_fill(~newer, -1.0).amax(dim=1) >= repeat
    factor[torch.tensor(frames)[repeated]] = 1e-3
    return factor


def _window(config: CacheConfig, budget: int) -> int:
    return budget // 4 if config.window_tokens is None else config.window_tokens
