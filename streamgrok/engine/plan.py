"""The plan of one engine step: decode first, then question prompts, then media prefill.

Continuous batching: every step re-plans from scratch, so new questions and appends join at the
next step and finished answers leave at once. Answers first: live frames past the freshness
bound are dropped before planning, and sessions with a question waiting behind their media are
fed before the others. Fairness: prefill is shared out per session (round-robin start, at most
an equal share each), so a session flooding frames only fills its own bounded queue.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum

import torch

from streamgrok.cache.contract import SequenceCache
from streamgrok.engine.config import EngineConfig
from streamgrok.engine.pending import AppendItem
from streamgrok.engine.state import AnswerPhase, AnswerState, SessionState
from streamgrok.stream_tokens import TokenInfo


class SpanKind(StrEnum):
    """What a span of a step is: one decoded token of an answer, a chunk of a question's
    turn (its prompt), or a chunk of the session's stream (media, notes, text)."""

    DECODE = "decode"
    PROMPT = "prompt"
    MEDIA = "media"


@dataclass
class Span:
    """Rows of the packed batch that belong to one sequence."""

    seq_id: int
    token_ids: torch.Tensor
    info: TokenInfo
    embeddings: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (row, vectors)
    kind: SpanKind = SpanKind.MEDIA
    answer: AnswerState | None = None
    samples: bool = False  # sample a token from this span's last row
    items: list[tuple[AppendItem, int]] = field(default_factory=list)  # media consumed
    session: SessionState | None = None

    def __len__(self) -> int:
        return self.token_ids.shape[0]

    @property
    def is_decode(self) -> bool:
        return self.kind is SpanKind.DECODE

    def release(self) -> None:
        """Give the claimed media back to its queue (the span will not run)."""
        for item, _ in self.items:
            item.in_flight = False


@dataclass
class StepPlan:
    spans: list[Span] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.spans

    def token_counts(self) -> dict[int, int]:
        """New tokens per sequence (what the cache reserves pages for)."""
        return {span.seq_id: len(span) for span in self.spans}

    def release(self) -> None:
        """Give every claimed media item back (the plan will not run)."""
        for span in self.spans:
            span.release()

    @property
    def decode_tokens(self) -> int:
        return sum(len(s) for s in self.spans if s.is_decode)

    @property
    def prefill_tokens(self) -> int:
        return sum(len(s) for s in self.spans if not s.is_decode)


class Planner:
    """Chooses each step's work under the token budget and the free pages (it changes no
    state but the media it claims for the plan and its own round-robin turns)."""

    def __init__(self, config: EngineConfig, cache: SequenceCache) -> None:
        self.config = config
        self.cache = cache
        self._decode_turn = 0
        self._prefill_turn = 0

    def plan(self, sessions: list[SessionState]) -> StepPlan:
        plan = StepPlan()
        budget = self.config.step_tokens
        free = self.cache.page_ledger()
        answers = [a for s in sessions for a in s.answers.values()
                   if not a.cancel_requested.is_set()]

        decoding = [a for a in answers
                    if a.phase is AnswerPhase.DECODE and a.next_token is not None]
        decoding = _rotate(decoding, self._decode_turn)[: min(self.config.max_batch, budget)]
        self._decode_turn += 1
        for answer in decoding:
            if free.take(answer.seq_id, 1):
                plan.spans.append(Span(
                    answer.seq_id, torch.tensor([answer.next_token]),
                    TokenInfo.text(1, protected=True), kind=SpanKind.DECODE, answer=answer,
                    samples=True,
                ))
                budget -= 1

        if plan.spans:  # decodes run this step: keep it short so time between tokens stays low
            budget = min(budget, self.config.decode_step_prefill)
        prompts = [a for a in answers if a.phase is AnswerPhase.PROMPT]
        for answer in prompts:
            share = min(answer.prompt.numel() - answer.prompt_done, budget)
            if share <= 0 or not free.take(answer.seq_id, share):
                continue
            ids = answer.prompt[answer.prompt_done : answer.prompt_done + share]
            plan.spans.append(Span(
                answer.seq_id, ids, TokenInfo.text(share, protected=True), kind=SpanKind.PROMPT,
                answer=answer, samples=answer.prompt_done + share == answer.prompt.numel(),
            ))
            budget -= share

        now = time.monotonic()
        for session in sessions:
            session.pending.drop_stale(self.config.media_freshness_s, now)
        feeding = [
            s for s in sessions
            if s.registered and isinstance(s.pending.head(), AppendItem)
            and s.pending.ready_for_prefill(self.config.media_batch_tokens,
                                            self.config.media_wait_s, now)
        ]
        feeding = _rotate(feeding, self._prefill_turn)
        self._prefill_turn += 1
        asking = {s.seq_id for s in feeding if s.pending.question_waiting()}
        feeding.sort(key=lambda s: s.seq_id not in asking)  # stable: the turns stay
        for i, session in enumerate(feeding):
            if budget <= 0:
                break
            # a session with a question waiting takes what it needs, the others share
            share = budget if session.seq_id in asking else \
                max(self.config.min_prefill_share, budget // (len(feeding) - i))
            span = _media_span(session, min(share, budget))
            if span is None:
                continue
            if free.take(session.seq_id, len(span)):
                plan.spans.append(span)
                budget -= len(span)
            else:
                span.release()
        return plan


def _rotate(items: list, turn: int) -> list:
    if not items:
        return items
    k = turn % len(items)
    return items[k:] + items[:k]


def _media_span(session: SessionState, share: int) -> Span | None:
    """Take up to `share` tokens from the head items of a session's pending queue."""
    ids, infos, embeddings, consumed = [], [], [], []
    taken = 0
    for item, start, n in session.pending.claim(share):
        ids.append(item.token_ids[start : start + n])
        infos.append(item.info.slice(start, start + n))
        if item.embeddings is not None:
            embeddings.append((taken, item.embeddings[start : start + n]))
        consumed.append((item, n))
        taken += n
    if not taken:
        return None
    return Span(session.seq_id, torch.cat(ids), TokenInfo.concat(infos), embeddings,
                items=consumed, session=session)
