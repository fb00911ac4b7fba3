"""Latency and throughput records for answers and for the engine."""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field


@dataclass
class AnswerMetrics:
    """Timings of one answer (monotonic seconds)."""

    asked_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    tokens: int = 0
    finish_reason: str | None = None
    asked_step: int = 0  # engine steps completed when the question was asked
    first_token_step: int | None = None  # the step that produced the first token
    recall: dict | None = None  # what recall from the host tier did (RecallResult.as_dict)

    def on_token(self, now: float) -> None:
        if self.first_token_at is None:
            self.first_token_at = now
        self.token_times.append(now)
        self.tokens += 1

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds."""
        return None if self.first_token_at is None else self.first_token_at - self.asked_at

    @property
    def gaps(self) -> list[float]:
        """Time between consecutive tokens, seconds."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    def as_dict(self) -> dict:
        gaps = self.gaps
        return {
            "ttft_ms": None if self.ttft is None else round(self.ttft * 1e3, 2),
            "tbt_ms_mean": round(sum(gaps) / len(gaps) * 1e3, 2) if gaps else None,
            "tbt_ms": [round(g * 1e3, 2) for g in gaps],
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "finish_reason": self.finish_reason,
            **(self.recall or {}),
        }


@dataclass
class StepRecord:
    """What one engine step did."""

    seconds: float
    decode_tokens: int
    prefill_tokens: int
    sequences: int


@dataclass
class EngineStats:
    """Counters and recent history of the engine (the server exports these)."""

    steps: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0  # time of the steps that decoded (prefill mixed in included)
    prefill_tokens: int = 0
    answers_started: int = 0
    answers_finished: int = 0
    answers_cancelled: int = 0
    answers_failed: int = 0
    dropped: Counter = field(default_factory=Counter)  # closed sessions and failed steps
    unprotected_tokens: int = 0
    parks: int = 0  # sessions whose KV was parked in host memory
    recall_limited: int = 0  # answers whose recall the trained context or free pages cut short
    hit_rates: deque = field(default_factory=lambda: deque(maxlen=256))  # recent answers
    errors: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=1024))

    def record(self, step: StepRecord) -> None:
        self.steps += 1
        self.decode_tokens += step.decode_tokens
        if step.decode_tokens:
            self.decode_seconds += step.seconds
        self.prefill_tokens += step.prefill_tokens
        self.recent.append(step)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by nearest rank; nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]

