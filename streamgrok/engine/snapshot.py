"""The engine's numbers as one immutable value: what the engine thread publishes after every
round for metrics, `stats` events and the load governor to read from any thread."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


def _frozen(mapping: Mapping | None) -> Mapping | None:
    return None if mapping is None else MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class AnswerCounts:
    """Answers over the engine's life (`in_flight` and `waiting`: now)."""

    started: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    in_flight: int = 0  # started, not ended
    waiting: int = 0  # questions not yet reached in their session's stream


@dataclass(frozen=True)
class LastStep:
    """What the latest engine step ran."""

    decode_tokens: int
    prefill_tokens: int
    sequences: int


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine and cache counters at the end of an engine round. Mappings are read-only."""

    sessions: int = 0
    steps: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0  # time of the steps that decoded
    prefill_tokens: int = 0
    answers: AnswerCounts = field(default_factory=AnswerCounts)
    step_ms_p50: float = 0.0
    step_ms_p95: float = 0.0
    last_step: LastStep | None = None
    queue_tokens: Mapping[int, int] = field(default_factory=dict)  # session id -> tokens
    kv_pages_used: int = 0
    kv_pages_total: int = 0
    kv_bytes_used: int = 0
    parked_sessions: int = 0
    parked_bytes: int = 0
    evicted_tokens: int = 0
    eviction_passes: int = 0
    dropped_frames: int = 0
    dropped: Mapping[str, int] = field(default_factory=dict)  # reason -> items
    unprotected_tokens: int = 0
    host_tier: Mapping[str, Any] | None = None  # the host tier's counters, None without one
    errors: int = 0
    vision: Mapping[str, Any] | None = None  # the frame batcher's counters, with a tower

    def __post_init__(self) -> None:
        for name in ("queue_tokens", "dropped", "host_tier", "vision"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))
