"""A session's bounded queue of pending appends, with a drop policy per kind of item.

Live media waits at most a freshness bound: a live frame not prefilled within it is dropped
(reason "stale"), the oldest live frames go when the queue is full ("full"), and a state note
(the observer's description of the picture now) replaces a waiting older one with the same
key ("superseded"). Text, transcripts and remembered answers are never dropped; the queue
holds them within a token bound instead. So what stands between a question and its answer
is bounded: the fresh media, one state note, and the text.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import torch

from streamgrok.stream_tokens import TokenInfo


@dataclass(eq=False)
class AppendItem:
    """Tokens (ids, or embedding vectors for frame tokens) waiting to be prefilled.

    `droppable` items (live video frames) are dropped oldest-first when the queue is full
    and when they wait past the freshness bound; an item with a `state_key` is replaced by a
    newer one with the same key while it waits; others (text, transcripts, questions'
    answers) are never dropped.
    """

    info: TokenInfo
    token_ids: torch.Tensor  # [n] int64 (placeholder zeros for embedding rows)
    embeddings: torch.Tensor | None = None  # [n, hidden] for frame tokens
    droppable: bool = False
    state_key: str | None = None
    done: int = 0  # tokens of this item already prefilled
    in_flight: bool = False  # part of the step being run (never dropped then)
    queued_at: float = field(default_factory=time.monotonic)
    index_embedding: torch.Tensor | None = None  # the frame's CLIP embedding, when known

    def __len__(self) -> int:
        return self.token_ids.shape[0]

    @property
    def remaining(self) -> int:
        return len(self) - self.done

    @property
    def waiting(self) -> bool:
        """Not started and not part of a running step (so it may still be dropped)."""
        return not self.done and not self.in_flight


@dataclass(eq=False)
class QuestionMarker:
    """Where in the stream a question was asked; reached only after earlier items, unless
    it is answered over a context of its own (`own_context`: the system prompt and the
    question alone), which waits for nothing. `answer` is the engine's AnswerState (typed
    loosely to keep this module standalone)."""

    answer: object
    own_context: bool = False


@dataclass
class PendingQueue:
    """Thread-safe: the asyncio side puts, the engine thread takes."""

    frame_capacity: int
    text_capacity_tokens: int
    items: deque = field(default_factory=deque)
    own_context: deque = field(default_factory=deque)  # questions that wait for no item
    dropped: Counter = field(default_factory=Counter)  # reason -> items dropped
    dropped_tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def dropped_items(self) -> int:
        return sum(self.dropped.values())

    def text_room(self) -> int:
        """Tokens of non-droppable items that can still be queued."""
        with self._lock:
            used = sum(i.remaining for i in self.items
                       if isinstance(i, AppendItem) and not i.droppable)
        return self.text_capacity_tokens - used

    def put(self, item: AppendItem | QuestionMarker) -> list[AppendItem]:
        """Queue an item; returns what it pushed out: live frames over the capacity (oldest
        first) and the waiting state note it replaces."""
        dropped = []
        with self._lock:
            if isinstance(item, QuestionMarker) and item.own_context:
                self.own_context.append(item)
                return dropped
            key = getattr(item, "state_key", None)
            if key is not None:
                old = [i for i in self.items if isinstance(i, AppendItem)
                       and i.state_key == key and i.waiting]
                self._remove(old, "superseded")
                dropped += old
            self.items.append(item)
            frames = [i for i in self.items if isinstance(i, AppendItem) and i.droppable]
            excess = len(frames) - self.frame_capacity
            # one being prefilled finishes, never cut it
            victims = [i for i in frames if i.waiting][: max(0, excess)]
            self._remove(victims, "full")
            dropped += victims
        return dropped

    def drop_stale(self, max_age_s: float, now: float) -> int:
        """Drop the waiting live frames queued more than `max_age_s` ago; how many."""
        with self._lock:
            stale = [i for i in self.items if isinstance(i, AppendItem) and i.droppable
                     and i.waiting and now - i.queued_at > max_age_s]
            self._remove(stale, "stale")
        return len(stale)

    def question_waiting(self) -> bool:
        """Whether a question waits behind queued media."""
        with self._lock:
            return any(isinstance(i, QuestionMarker) for i in self.items)

    def questions_waiting(self) -> int:
        """How many questions wait here, not yet started."""
        with self._lock:
            return len(self.own_context) + sum(isinstance(i, QuestionMarker) for i in self.items)

    def _remove(self, victims: list[AppendItem], reason: str) -> None:
        for victim in victims:
            self.items.remove(victim)
        if victims:
            self.dropped[reason] += len(victims)
            self.dropped_tokens += sum(len(v) for v in victims)

    def snapshot(self) -> list[AppendItem | QuestionMarker]:
        """The queued items, in order, as of now (questions of their own context first)."""
        with self._lock:
            return [*self.own_context, *self.items]

    def own_context_head(self) -> QuestionMarker | None:
        """The oldest question answered over a context of its own, not yet started."""
        with self._lock:
            return self.own_context[0] if self.own_context else None

    def pop_own_context(self) -> None:
        with self._lock:
            self.own_context.popleft()

    def claim(self, share: int) -> list[tuple[AppendItem, int, int]]:
        """Up to `share` tokens from the head appends, as (item, start, count), marked in
        flight under the lock so a concurrent `put` can never drop them."""
        claimed, taken = [], 0
        with self._lock:
            for item in self.items:
                if not isinstance(item, AppendItem) or taken >= share:
                    break
                n = min(item.remaining, share - taken)
                item.in_flight = True
                claimed.append((item, item.done, n))
                taken += n
        return claimed

    def head(self) -> AppendItem | QuestionMarker | None:
        with self._lock:
            return self.items[0] if self.items else None

    def pop_head(self) -> None:
        with self._lock:
            self.items.popleft()

    def ready_for_prefill(self, min_tokens: int, max_wait: float, now: float) -> bool:
        """Whether enough media waits (or long enough, or a question waits behind it)."""
        with self._lock:
            if not self.items:
                return False
            if any(isinstance(i, QuestionMarker) for i in self.items):
                return True
            head = self.items[0]
            if isinstance(head, AppendItem) and now - head.queued_at >= max_wait:
                return True
            return sum(i.remaining for i in self.items) >= min_tokens

    def pending_tokens(self) -> int:
        with self._lock:
            return sum(i.remaining for i in self.items if isinstance(i, AppendItem))

    def __len__(self) -> int:
        with self._lock:
            return len(self.items)

    def clear(self) -> None:
        with self._lock:
            self.items.clear()
            self.own_context.clear()
