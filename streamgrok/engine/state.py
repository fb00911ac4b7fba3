"""Engine-thread state of sessions and answers (only the engine thread mutates it)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import torch

from streamgrok.engine.events import Deliver
from streamgrok.engine.metrics import AnswerMetrics
from streamgrok.engine.pending import PendingQueue
from streamgrok.model.detokenizer import IncrementalDetokenizer
from streamgrok.model.sampling import SamplingParams


class AnswerPhase(StrEnum):
    """Where an answer is: its question not yet reached in the stream, its prompt being
    prefilled, or its tokens being decoded."""

    WAITING = "waiting"
    PROMPT = "prompt"
    DECODE = "decode"


@dataclass
class AnswerState:
    """One question being answered on its own fork of the session's sequence."""

    answer_id: int
    session_id: int
    prompt: torch.Tensor  # the question turn's token ids
    sampling: SamplingParams
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer
    stop_ids: frozenset[int]
    deliver: Deliver  # runs on the event loop (StepOutputs.deliver calls it)
    append_to_context: bool = True
    seq_id: int | None = None  # the fork, once the question is reached in the stream
    prompt_done: int = 0
    generated: list[int] = field(default_factory=list)
    next_token: int | None = None
    metrics: AnswerMetrics = field(default_factory=AnswerMetrics)
    cancel_requested: threading.Event = field(default_factory=threading.Event)

    @property
    def phase(self) -> AnswerPhase:
        """Where the answer is: waiting for its turn in the stream, prefilling its prompt,
        or decoding."""
        if self.seq_id is None:
            return AnswerPhase.WAITING
        return AnswerPhase.PROMPT if self.prompt_done < self.prompt.numel() \
            else AnswerPhase.DECODE


@dataclass
class SessionState:
    """A long-lived streaming context: its main sequence and pending appends."""

    session_id: int
    seq_id: int
    pending: PendingQueue
    system_tokens: list[int]
    notify_space: Callable[[], None]  # on the event loop: text room was freed
    on_closed: Callable[[], None] = lambda: None  # on the engine thread, once
    answers: dict[int, AnswerState] = field(default_factory=dict)
    registered: bool = False
    prefix_published: bool = False
    closing: bool = False
    error: str | None = None  # why the engine ended the session, if it failed
    context: tuple[int, int] | None = None  # a client's (target, trigger) tokens, if set
    parked: bool = False  # its KV waits in host memory; nothing of it is scheduled
    park_waiters: list[Callable[[int], None]] = field(default_factory=list)  # park requested:
    # called on the event loop with the parked bytes (0: the park was called off)
