"""The scheduler: owner of every session and answer and of each state transition.

It runs on the engine thread only. `schedule()` admits questions (forking the session's
sequence) and plans the step; `update()` applies what the step produced (media consumed,
prompt progress, sampled tokens, finished answers); `evict()` brings sequences back to their
budgets. Every change a consumer must hear about goes into `outputs`, handed to the event loop
once per step. Nothing here needs a thread or a model, so it is unit-tested directly.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter, deque
from collections.abc import Callable

import torch

from streamgrok.cache.contract import RecallingCache, ResumableCache, SequenceCache
from streamgrok.cache.parking import SequenceSnapshot
from streamgrok.engine.config import EngineConfig
from streamgrok.engine.events import AnswerDelta, AnswerDone, AnswerFailed, StepOutputs
from streamgrok.engine.metrics import EngineStats, StepRecord, percentile
from streamgrok.engine.pending import AppendItem, QuestionMarker
from streamgrok.engine.plan import Planner, Span, SpanKind, StepPlan
from streamgrok.engine.snapshot import AnswerCounts, EngineSnapshot, LastStep
from streamgrok.engine.state import AnswerState, SessionState
from streamgrok.errors import CacheFullError
from streamgrok.stream_tokens import TokenInfo

log = logging.getLogger(__name__)


class Scheduler:
    """Sessions, answers and their transitions; plans and applies engine steps."""

    def __init__(self, config: EngineConfig, cache: SequenceCache, ids: itertools.count,
                 end_of_turn: list[int], protected_limit: int | None) -> None:
        self.config = config
        self.cache = cache
        self.planner = Planner(config, cache)
        self.sessions: dict[int, SessionState] = {}
        self.stats = EngineStats(recent=deque(maxlen=config.recent_steps))
        self.outputs = StepOutputs()
        self._ids = ids
        self._end_of_turn = end_of_turn
        self._protected_limit = protected_limit
        # what this cache can do beyond the scheduler's side (None where it cannot)
        self.resumable = cache if isinstance(cache, ResumableCache) else None
        self.recalling = cache if cache.tier is not None and isinstance(cache, RecallingCache) \
            else None

    # -- commands --------------------------------------------------------------------------

    def register(self, state: SessionState) -> None:
        """Start a session's sequence (sharing a published system-prompt prefix)."""
        self.sessions[state.session_id] = state
        try:
            reused = self.cache.add_sequence(
                state.seq_id, prefix_tokens=state.system_tokens or None,
                pinned=len(state.system_tokens),
            )
        except Exception as exc:
            log.exception("session %d could not start", state.session_id)
            self.stats.errors += 1
            self.close(state, error=f"session could not start: {exc}")
            return
        head = state.pending.head()
        if reused and isinstance(head, AppendItem):
            head.done = reused
            if head.remaining == 0:
                state.pending.pop_head()
        state.registered = True

    def restore(self, state: SessionState, snapshot: SequenceSnapshot) -> None:
        """Start a session from a snapshot of another process's, parked."""
        self.sessions[state.session_id] = state
        try:
            if self.resumable is None:
                raise ValueError("this engine's cache cannot restore sessions (KV parallelism)")
            self.resumable.import_sequence(state.seq_id, snapshot)
        except Exception as exc:
            log.warning("session %d could not be restored: %s", state.session_id, exc)
            self.close(state, error=f"session could not be restored: {exc}")
            return
        state.parked = state.registered = state.prefix_published = True

    def export(self, state: SessionState) -> tuple[SequenceSnapshot | None, Exception | None]:
        """A parked session's sequence as a snapshot, or the reason there is none."""
        if state.closing or not state.parked or self.resumable is None:
            return None, RuntimeError("only a parked, open session can be exported")
        try:
            return self.resumable.export_sequence(state.seq_id), None
        except Exception as exc:
            return None, exc

    def close(self, state: SessionState, error: str | None = None) -> None:
        """Free a session; its answers end as cancelled, or with `error` when it failed."""
        if state.closing:
            return
        state.error = error
        state.closing = True
        for answer in list(state.answers.values()):
            if error is None:
                self._end_answer(state, answer, "cancelled")
            else:
                self._abort_answer(state, answer, error)
        for item in state.pending.snapshot():
            if isinstance(item, QuestionMarker):
                if error is None:
                    self._cancel_waiting(item.answer)
                else:
                    self._fail(item.answer, error)
        state.pending.clear()
        self.stats.dropped.update(state.pending.dropped)  # it leaves the snapshot sum
        if state.seq_id in self.cache.sequences:
            self.cache.remove_sequence(state.seq_id)
        self.sessions.pop(state.session_id, None)
        self._call_off_park(state)
        state.on_closed()

    def request_park(self, state: SessionState, reply: Callable[[int], None]) -> None:
        """Park the session's KV (see `Engine.park_session`) once it is idle; `reply` gets
        the parked bytes on the event loop (0: not parked)."""
        if state.closing or self.resumable is None:
            self.outputs.wake(lambda: reply(0))  # closed, or a cache that cannot park
            return
        state.park_waiters.append(reply)
        self._park_idle()

    def unpark(self, state: SessionState) -> Exception | None:
        """Bring a parked session back (or call off its pending park); the CacheFullError
        when the pool lacks the pages (it stays parked)."""
        self._call_off_park(state)
        if not state.parked or state.closing or self.resumable is None:
            return None
        try:
            self.resumable.unpark(state.seq_id)
        except CacheFullError as exc:
            return exc
        state.parked = False
        return None

    def _call_off_park(self, state: SessionState) -> None:
        waiters, state.park_waiters = state.park_waiters, []
        for reply in waiters:
            self.outputs.wake(lambda reply=reply: reply(0))

    def _park_idle(self) -> None:
        """Park the sessions asked to park that have nothing running or queued."""
        if self.resumable is None:
            return
        for state in self.sessions.values():
            if (not state.park_waiters or state.closing or not state.registered
                    or state.answers or len(state.pending)):
                continue
            parked = self.resumable.park(state.seq_id)
            state.parked = True
            self.stats.parks += 1
            waiters, state.park_waiters = state.park_waiters, []
            for reply in waiters:
                self.outputs.wake(lambda reply=reply, parked=parked: reply(parked))

    def close_all(self) -> None:
        for session in list(self.sessions.values()):
            self.close(session)

    def fail_everything(self, message: str) -> None:
        """Last resort after a bug in the engine loop itself: fail every running answer."""
        for session in list(self.sessions.values()):
            for answer in list(session.answers.values()):
                self._abort_answer(session, answer, message)

    # -- one step --------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Reap cancelled answers, admit questions reached in the stream, plan the step."""
        self._reap_cancelled()
        self._park_idle()
        self._admit_questions()
        return self.planner.plan(self.active_sessions())

    def update(self, plan: StepPlan, sampled: dict[int, int], failed: dict[int, Exception],
               seconds: float) -> None:
        """Apply a step's results: `sampled` tokens and `failed` spans, by span index."""
        now = time.monotonic()
        self.stats.errors += len(failed)
        for index, span in enumerate(plan.spans):
            if index in failed:
                self._fail_span(span, f"engine step failed: {failed[index]}")
            elif span.kind is SpanKind.MEDIA:
                self._consume(span)
            else:
                answer = span.answer
                if span.kind is SpanKind.PROMPT:
                    answer.prompt_done += len(span)
                    self._take_recall(answer)
                if index in sampled:
                    self._on_token(answer, sampled[index], now)
        self.stats.record(StepRecord(seconds, plan.decode_tokens, plan.prefill_tokens,
                                     len(plan.spans)))

    def evict(self) -> None:
        """Evict every sequence over budget; one that cannot be evicted fails its owner (that
        answer, or that session) and nobody else. Then publish finished system prompts."""
        failed: dict[int, Exception] = {}
        self.cache.evict(failed=failed)
        for seq_id, exc in failed.items():
            log.warning("sequence %d could not be evicted: %s", seq_id, exc)
            self.stats.errors += 1
            self._fail_sequence(seq_id, f"the KV cache could not make room: {exc}")
        self._publish_prefixes()

    def snapshot(self) -> EngineSnapshot:
        """Engine and cache numbers now, as an immutable value."""
        stats = self.stats
        recent = list(stats.recent)
        step_ms = [r.seconds * 1e3 for r in recent]
        pool = self.cache.pool
        sessions = list(self.sessions.values())
        dropped = Counter(stats.dropped)
        for session in sessions:
            dropped.update(session.pending.dropped)
        return EngineSnapshot(
            sessions=len(sessions),
            steps=stats.steps,
            decode_tokens=stats.decode_tokens,
            decode_seconds=stats.decode_seconds,
            prefill_tokens=stats.prefill_tokens,
            answers=AnswerCounts(
                started=stats.answers_started,
                finished=stats.answers_finished,
                cancelled=stats.answers_cancelled,
                failed=stats.answers_failed,
                in_flight=sum(len(s.answers) for s in sessions),
                waiting=sum(s.pending.questions_waiting() for s in sessions),
            ),
            step_ms_p50=percentile(step_ms, 50),
            step_ms_p95=percentile(step_ms, 95),
            last_step=None if not recent else LastStep(
                decode_tokens=recent[-1].decode_tokens,
                prefill_tokens=recent[-1].prefill_tokens,
                sequences=recent[-1].sequences,
            ),
            queue_tokens={s.session_id: s.pending.pending_tokens() for s in sessions},
            kv_pages_used=pool.used_pages,
            kv_pages_total=pool.num_pages,
            kv_bytes_used=pool.used_pages * self.cache.page_bytes,
            parked_sessions=sum(1 for s in sessions if s.parked),
            parked_bytes=self.resumable.parked_bytes if self.resumable else 0,
            evicted_tokens=self.cache.stats.evicted_tokens,
            eviction_passes=self.cache.stats.eviction_passes,
            dropped_frames=sum(dropped.values()),
            dropped=dict(dropped),
            unprotected_tokens=stats.unprotected_tokens,
            host_tier=self._tier_snapshot(),
            errors=stats.errors,
        )

    def _tier_snapshot(self) -> dict | None:
        tier = self.cache.tier
        if tier is None:
            return None
        stats = tier.stats
        rates = list(self.stats.hit_rates)
        return {
            "bytes_used": tier.used_bytes, "bytes_capacity": tier.capacity_pages * tier.page_bytes,
            "tokens": tier.tokens, "stored_tokens": stats.stored_tokens,
            "dropped_tokens": stats.dropped_tokens, "recalls": stats.recalls,
            "disk_bytes_used": tier.disk_bytes, "spilled_tokens": stats.spilled_tokens,
            "recalled_tokens": stats.recalled_tokens, "recall_bytes": stats.recall_bytes,
            "guard_recalls": stats.guard_recalls, "recall_limited": self.stats.recall_limited,
            "stream_recalls": stats.stream_recalls, "restored_tokens": stats.restored_tokens,
            "kv_hit_rate_mean": sum(rates) / len(rates) if rates else None,
        }

    def take_outputs(self) -> StepOutputs:
        outputs, self.outputs = self.outputs, StepOutputs()
        return outputs

    def active_sessions(self) -> list[SessionState]:
        return [s for s in self.sessions.values()
                if s.registered and not s.closing and not s.parked]

    # -- transitions -----------------------------------------------------------------------

    def _reap_cancelled(self) -> None:
        for session in self.active_sessions():
            for answer in list(session.answers.values()):
                if answer.cancel_requested.is_set():
                    self._end_answer(session, answer, "cancelled")

    def _admit_questions(self) -> None:
        busy = any(s.answers for s in self.active_sessions())
        for session in self.active_sessions():
            pending = session.pending
            for head, pop in ((pending.own_context_head, pending.pop_own_context),
                              (pending.head, pending.pop_head)):
                while isinstance(marker := head(), QuestionMarker):
                    outcome = self._admit(session, marker, busy)
                    if outcome == "wait":
                        break
                    pop()
                    busy = busy or outcome == "started"

    def _admit(self, session: SessionState, marker: QuestionMarker, busy: bool) -> str:
        """Start a question's sequence: "started", "ended" (cancelled or failed), or "wait"
        (no pages now, but running answers will free some)."""
        answer: AnswerState = marker.answer
        if answer.cancel_requested.is_set():
            self._cancel_waiting(answer)
            return "ended"
        seq_id = next(self._ids)
        try:
            if marker.own_context:
                self._start_own_context(session, answer, seq_id)
            else:
                self.cache.fork(session.seq_id, seq_id)
        except CacheFullError as exc:
            if busy:
                return "wait"
            self._fail(answer, f"cannot start the answer: {exc}")
            return "ended"
        answer.seq_id = seq_id
        if self.recalling is not None and not marker.own_context:
            self.recalling.recall_next_pass(seq_id, room=answer.sampling.max_tokens + 1)
        session.answers[answer.answer_id] = answer
        self.stats.answers_started += 1
        return "started"

    def _start_own_context(self, session: SessionState, answer: AnswerState,
                           seq_id: int) -> None:
        """A new sequence of the session's system prompt (its published pages shared) and
        the question; the system tokens not shared are prefilled with the question."""
        system = session.system_tokens
        reused = self.cache.add_sequence(seq_id, prefix_tokens=system or None,
                                         pinned=len(system))
        answer.prompt = torch.cat([torch.tensor(system[reused:], dtype=torch.long),
                                   answer.prompt])

    def _take_recall(self, answer: AnswerState) -> None:
        """What recall did during the question's first prefill chunk, for its metrics."""
        if self.recalling is None or answer.metrics.recall is not None:
            return
        result = self.recalling.take_recall(answer.seq_id)
        if result is None:
            return
        answer.metrics.recall = result.as_dict()
        self.stats.hit_rates.append(result.hit_rate)
        if result.limited:
            self.stats.recall_limited += 1

    def _consume(self, span: Span) -> None:
        session = span.session
        for item, n in span.items:
            item.done += n
            item.in_flight = False
            if item.index_embedding is not None and item.remaining == 0:
                self.cache.index_frame(span.seq_id, int(item.info.source[0]),
                                       item.index_embedding)
        while isinstance(head := session.pending.head(), AppendItem) and head.remaining == 0:
            session.pending.pop_head()
        self.outputs.wake(session.notify_space)

    def _on_token(self, answer: AnswerState, token: int, now: float) -> None:
        if answer.metrics.first_token_at is None:
            answer.metrics.first_token_step = self.stats.steps + 1
        answer.metrics.on_token(now)
        session = self.sessions.get(answer.session_id)
        if token in answer.stop_ids:
            self._end_answer(session, answer, "stop")
            return
        answer.generated.append(token)
        delta = answer.detokenizer.push(token)
        if delta:
            self.outputs.emit(answer.deliver, AnswerDelta(delta))
        if len(answer.generated) >= answer.sampling.max_tokens:
            self._end_answer(session, answer, "length")
            return
        answer.next_token = token

    def _end_answer(self, session: SessionState, answer: AnswerState, reason: str) -> None:
        tail = answer.detokenizer.flush()
        if tail and reason != "cancelled":
            self.outputs.emit(answer.deliver, AnswerDelta(tail))
        answer.metrics.finish_reason = reason
        if answer.seq_id is not None and answer.seq_id in self.cache.sequences:
            self.cache.remove_sequence(answer.seq_id)
        session.answers.pop(answer.answer_id, None)
        if reason == "cancelled":
            self.stats.answers_cancelled += 1
        else:
            self.stats.answers_finished += 1
            if answer.append_to_context and not session.closing:
                self._remember(session, answer)
        self.outputs.emit(answer.deliver, AnswerDone(answer.metrics))

    def _remember(self, session: SessionState, answer: AnswerState) -> None:
        """The question and its answer join the session's context as (protected) text."""
        ids = answer.prompt.tolist() + answer.generated + self._end_of_turn
        limit = self._protected_limit
        room = None if limit is None else limit - len(session.system_tokens)
        protect = self.config.protect_answers and (room is None or len(ids) <= room)
        session.pending.put(AppendItem(TokenInfo.text(len(ids), protected=protect),
                                       torch.tensor(ids, dtype=torch.long)))
        if protect and room is not None:
            self.stats.unprotected_tokens += self.cache.limit_protected(
                session.seq_id, room - len(ids))

    def _publish_prefixes(self) -> None:
        for session in self.active_sessions():
            if session.prefix_published or not session.system_tokens:
                continue
            seq = self.cache.sequences.get(session.seq_id)
            if seq is not None and seq.stream_pos >= len(session.system_tokens):
                self.cache.publish_prefix(session.seq_id, session.system_tokens)
                session.prefix_published = True

    def _cancel_waiting(self, answer: AnswerState) -> None:
        answer.metrics.finish_reason = "cancelled"
        self.stats.answers_cancelled += 1
        self.outputs.emit(answer.deliver, AnswerDone(answer.metrics))

    def _fail(self, answer: AnswerState, message: str) -> None:
        answer.metrics.finish_reason = "error"
        self.stats.answers_failed += 1
        self.outputs.emit(answer.deliver, AnswerFailed(message))

    def _abort_answer(self, session: SessionState | None, answer: AnswerState,
                      message: str) -> None:
        """Free the answer's fork, forget it, and send its consumer the error."""
        if answer.seq_id in self.cache.sequences:
            self.cache.remove_sequence(answer.seq_id)
        if session is not None:
            session.answers.pop(answer.answer_id, None)
        self._fail(answer, message)

    def _fail_span(self, span: Span, message: str) -> None:
        """A span whose forward pass failed: its answer fails, or its media is dropped."""
        if span.answer is not None:
            self._abort_answer(self.sessions.get(span.answer.session_id), span.answer, message)
            return
        for item, _ in span.items:  # drop the media that broke the step
            item.done = len(item)
        self.stats.dropped["failed"] += sum(1 for item, _ in span.items if item.droppable)
        self._consume(span)

    def _fail_sequence(self, seq_id: int, message: str) -> None:
        for session in list(self.sessions.values()):
            if session.seq_id == seq_id:
                self.close(session, error=message)
                return
            for answer in list(session.answers.values()):
                if answer.seq_id == seq_id:
                    self._abort_answer(session, answer, message)
                    return
