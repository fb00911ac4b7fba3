"""A sequence's token records and stream counters, and what is read or changed in them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from streamgrok.cache.tokens import (
    META_COLUMNS,
    MODALITY,
    PROTECTED,
    SOURCE,
    STREAM,
    TIME,
    LayerTokens,
)
from streamgrok.stream_tokens import Modality, TokenInfo


@dataclass
class SequenceState:
    """One sequence's per-layer token records and stream counters."""

    seq_id: int
    layers: list[LayerTokens]
    stream_pos: int = 0  # tokens ever appended (the next stream index)
    next_group: int = 0
    last_frame_source: int | None = None
    pinned: int = 0  # leading stream tokens never unprotected (the system prompt)
    tier_source: int | None = None  # the sequence whose host tier recall reads (a fork's
    # parent session)
    budget_bonus: list[int] = field(default_factory=list)  # recalled tokens a layer may hold
    # beyond its budget
    # unit CLIP embeddings of the frames still cached, by source: frame-aware eviction
    # drops a frame a newer one repeats first (see policies.frame_novelty)
    frame_embeddings: dict[int, torch.Tensor] = field(default_factory=dict)
    # a client's own context bounds (see `PagedKVCache.set_context`): each layer kept to at
    # most `context_target` tokens, evicted once past it by `context_slack`
    context_target: int | None = None
    context_slack: int | None = None

    def index_frame(self, source: int, embedding: torch.Tensor) -> None:
        """Keep a cached frame's CLIP embedding (its index) for frame-aware eviction."""
        self.frame_embeddings[int(source)] = embedding.detach().float().cpu()


def next_stream_rows(seq: SequenceState, info: TokenInfo) -> torch.Tensor:
    """Metadata rows [len(info), META_COLUMNS] of the sequence's next stream tokens (stream
    index, frame group, modality, time, source, protected); advances its stream counters."""
    n = len(info)
    if n == 1:  # a decode step's token: the same rows without a dozen small tensor ops
        return _next_stream_row(seq, info)
    is_frame = info.modality == int(Modality.FRAME)
    prev_frame = torch.cat([
        torch.tensor([seq.last_frame_source is not None]), is_frame[:-1]
    ])
    prev_source = torch.cat([
        torch.tensor([-1 if seq.last_frame_source is None else seq.last_frame_source]),
        info.source[:-1],
    ])
    continues = is_frame & prev_frame & (info.source == prev_source)
    group = seq.next_group + torch.cumsum((~continues).long(), 0) - 1
    rows = torch.empty(n, META_COLUMNS, dtype=torch.float64)
    rows[:, 0] = torch.arange(seq.stream_pos, seq.stream_pos + n, dtype=torch.float64)
    rows[:, 1] = group.double()
    rows[:, 2] = info.modality.double()
    rows[:, 3] = info.timestamp.double()
    rows[:, 4] = info.source.double()
    rows[:, 5] = info.protected.double()
    seq.stream_pos += n
    seq.next_group = int(group[-1]) + 1 if n else seq.next_group
    seq.last_frame_source = int(info.source[-1]) if n and bool(is_frame[-1]) else None
    return rows


def _next_stream_row(seq: SequenceState, info: TokenInfo) -> torch.Tensor:
    """`next_stream_rows` of one token."""
    modality, source = int(info.modality[0]), int(info.source[0])
    is_frame = modality == int(Modality.FRAME)
    continues = is_frame and seq.last_frame_source is not None and \
        source == seq.last_frame_source
    group = seq.next_group - 1 if continues else seq.next_group
    row = torch.tensor([[seq.stream_pos, group, modality, float(info.timestamp[0]), source,
                         float(bool(info.protected[0]))]], dtype=torch.float64)
    seq.stream_pos += 1
    seq.next_group = group + 1
    seq.last_frame_source = source if is_frame else None
    return row


def forget_evicted_frames(seq: SequenceState) -> None:
    """Drop the CLIP embeddings of frames no layer holds any more."""
    if not seq.frame_embeddings:
        return
    held: set[int] = set()
    for rec in seq.layers:
        frames = rec.column(MODALITY) == int(Modality.FRAME)
        held.update(rec.column(SOURCE)[frames].long().tolist())
    for source in [s for s in seq.frame_embeddings if s not in held]:
        del seq.frame_embeddings[source]


def retained_media(rec: LayerTokens) -> list[dict]:
    """What a layer's records hold of frames, notes and audio: one entry per source/time."""
    meta = rec.meta[: rec.length]
    media = meta[meta[:, MODALITY] != int(Modality.TEXT)]
    if media.numel() == 0:
        return []
    keys, counts = torch.unique(media[:, [MODALITY, SOURCE, TIME]], dim=0, return_counts=True)
    names = {int(m): m.name.lower() for m in Modality}
    return [{"modality": names[int(k[0])], "source": int(k[1]), "t": float(k[2]),
             "tokens": int(c)} for k, c in zip(keys, counts)]


def limit_layer_protection(rec: LayerTokens, max_protected: int, pinned: int) -> int:
    """Unprotect the layer's oldest protected tokens beyond `max_protected`, never the first
    `pinned` stream tokens; returns how many were unprotected."""
    protected = (rec.column(PROTECTED) > 0) & (rec.column(STREAM) >= pinned)
    return unprotect_oldest(rec, int(protected.sum()) - max_protected, pinned)


def demote_protected(rec: LayerTokens, budget: int, pinned: int, sinks: int) -> int:
    """Unprotect the oldest protected tokens after the pinned prefix until protected tokens
    and attention sinks fit `budget`; returns how many were unprotected."""
    mandatory = (rec.column(PROTECTED) > 0) | (rec.column(STREAM) < sinks)
    return unprotect_oldest(rec, int(mandatory.sum()) - budget, max(pinned, sinks))


def unprotect_oldest(rec: LayerTokens, count: int, first: int) -> int:
    """Unprotect up to `count` of the oldest protected tokens at stream index >= `first`."""
    if count <= 0:
        return 0
    candidates = (rec.column(PROTECTED) > 0) & (rec.column(STREAM) >= first)
    chosen = torch.nonzero(candidates).flatten()[:count]
    rec.meta[chosen, PROTECTED] = 0.0
    return chosen.numel()
