"""The Engine: a worker thread that runs scheduler steps; sessions talk to it from asyncio."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator

import torch

from streamgrok.cache.config import CacheConfig
from streamgrok.cache.paged_cache import PagedKVCache
from streamgrok.engine.config import EngineConfig
from streamgrok.engine.metrics import EngineStats, StepRecord, percentile
from streamgrok.engine.pending import AppendItem, PendingQueue, QuestionMarker
from streamgrok.engine.runner import ModelRunner
from streamgrok.engine.scheduler import Scheduler, Span, StepPlan
from streamgrok.engine.session import Answer, Session
from streamgrok.engine.state import AnswerState, SessionState
from streamgrok.errors import CacheFullError, RequestTooLarge, StreamgrokError
from streamgrok.model.detokenizer import IncrementalDetokenizer
from streamgrok.model.loader import LoadedModel
from streamgrok.model.sampling import SamplingParams, new_generator
from streamgrok.stream_tokens import TokenInfo

log = logging.getLogger(__name__)


class Engine:
    """Serves many sessions with one model. Use `async with Engine(...) as engine:`."""

    def __init__(
        self,
        loaded: LoadedModel,
        cache_config: CacheConfig | None = None,
        config: EngineConfig | None = None,
    ) -> None:
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.config
        self.config = config or EngineConfig()
        self.cache = PagedKVCache(
            loaded.config, cache_config or CacheConfig(), loaded.model.dtype, loaded.model.device,
            kernels=loaded.model.kernels,
        )
        self.scheduler = Scheduler(self.config, self.cache)
        self.runner = ModelRunner(loaded.model, self.cache, self.config.nano_batches,
                                  self.config.length_ratio)
        self.stats = EngineStats(recent=deque(maxlen=self.config.recent_steps))
        self._sessions: dict[int, SessionState] = {}  # engine thread only (see _register)
        self._session_slots = threading.BoundedSemaphore(self.config.max_sessions)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._hold = threading.Event()  # paused(): asked to stay between steps
        self._holding = threading.Event()  # the engine thread is staying between steps
        self._ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._end_of_turn = self._end_of_turn_tokens()

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> Engine:
        self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def start(self) -> None:
        """Start the worker thread (call from inside the running event loop)."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="streamgrok-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the worker after its current step."""
        self._stopping.set()
        self.wake()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    def wake(self) -> None:
        self._wakeup.set()

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """Hold the engine between steps while the block queues work, so that everything
        queued inside it is scheduled together when the block ends (reproducible batches, and
        a way to submit related work atomically). Not reentrant."""
        self._hold.set()
        self.wake()
        try:
            await asyncio.to_thread(self._wait_until_holding)
            yield
        finally:
            self._hold.clear()
            self.wake()

    # -- asyncio-side API ------------------------------------------------------------------

    def new_session(self, system_prompt: str | None = None) -> Session:
        """A new streaming context, starting with the system prompt (protected, shared)."""
        session_id = next(self._ids)
        system_tokens = []
        if system_prompt is not None:
            system_tokens = self.tokenizer.encode(
                self.tokenizer.render_chat([{"role": "system", "content": system_prompt}],
                                           add_generation_prompt=False))
        self._check_protected_fits("the system prompt", len(system_tokens))
        if not self._session_slots.acquire(blocking=False):
            raise StreamgrokError(f"too many sessions (max {self.config.max_sessions})")
        space = asyncio.Event()
        loop = self._require_loop()
        state = SessionState(
            session_id, next(self._ids),
            PendingQueue(self.config.frame_queue, self.config.text_queue_tokens),
            system_tokens, notify_space=lambda: loop.call_soon_threadsafe(space.set),
        )
        if system_tokens:
            state.pending.put(AppendItem(TokenInfo.text(len(system_tokens), protected=True),
                                         torch.tensor(system_tokens, dtype=torch.long)))
        self._commands.put(("register", state))
        self.wake()
        return Session(self, state, space)

    def submit_question(
        self,
        session: SessionState,
        question: str,
        sampling: SamplingParams | None,
        raw: bool,
        remember: bool,
    ) -> Answer:
        sampling = sampling or SamplingParams()
        turn = question if raw else self.render_turn(session, "user", question, True)
        prompt = self.tokenizer.encode(turn)
        self._check_protected_fits("the question", len(session.system_tokens) + len(prompt))
        out: asyncio.Queue = asyncio.Queue(maxsize=sampling.max_tokens + 4)
        loop = self._require_loop()
        state = AnswerState(
            answer_id=next(self._ids),
            session_id=session.session_id,
            prompt=torch.tensor(prompt, dtype=torch.long),
            sampling=sampling,
            generator=None if sampling.greedy else new_generator(sampling),
            detokenizer=IncrementalDetokenizer(self.tokenizer),
            stop_ids=self.tokenizer.stop_ids | sampling.stop_token_ids,
            emit=lambda kind, payload: loop.call_soon_threadsafe(out.put_nowait, (kind, payload)),
            append_to_context=remember,
        )
        state.metrics.prompt_tokens = len(prompt)
        state.metrics.asked_step = self.stats.steps
        self.stats.answers_started += 1
        session.pending.put(QuestionMarker(state))
        self.wake()
        return Answer(state, out, self)

    async def close_session(self, state: SessionState) -> None:
        done = self._require_loop().create_future()
        self._commands.put(("close", state, done))
        self.wake()
        await done

    async def generate(
        self, prompt: str, sampling: SamplingParams | None = None, chat: bool = True
    ) -> AsyncIterator[str]:
        """One-shot text request on the same machinery: a short-lived session."""
        session = self.new_session()
        try:
            answer = session.ask(prompt, sampling, raw=not chat, remember=False)
            async for delta in answer:
                yield delta
        finally:
            await session.close()

    def record_drops(self, dropped: list[AppendItem]) -> None:
        self.stats.dropped_frames += len(dropped)
        self.stats.dropped_frame_tokens += sum(len(d) for d in dropped)

    def snapshot(self) -> dict:
        """Engine and cache numbers for metrics and the `stats` event."""
        recent = list(self.stats.recent)
        step_ms = [r.seconds * 1e3 for r in recent]
        pool = self.cache.pool
        return {
            "sessions": len(self._sessions),
            "steps": self.stats.steps,
            "decode_tokens": self.stats.decode_tokens,
            "prefill_tokens": self.stats.prefill_tokens,
            "answers": {
                "started": self.stats.answers_started,
                "finished": self.stats.answers_finished,
                "cancelled": self.stats.answers_cancelled,
                "failed": self.stats.answers_failed,
            },
            "step_ms_p50": percentile(step_ms, 50),
            "step_ms_p95": percentile(step_ms, 95),
            "last_step": None if not recent else {
                "decode_tokens": recent[-1].decode_tokens,
                "prefill_tokens": recent[-1].prefill_tokens,
                "sequences": recent[-1].sequences,
            },
            "queue_tokens": {s.session_id: s.pending.pending_tokens()
                             for s in list(self._sessions.values())},
            "kv_pages_used": pool.used_pages,
            "kv_pages_total": pool.num_pages,
            "kv_bytes_used": pool.used_pages * self.cache.page_bytes,
            "evicted_tokens": self.cache.stats.evicted_tokens,
            "eviction_passes": self.cache.stats.eviction_passes,
            "dropped_frames": self.stats.dropped_frames,
            "unprotected_tokens": self.stats.unprotected_tokens,
            "errors": self.stats.errors,
        }

    def protected_limit(self) -> int | None:
        """Most protected tokens (system prompt, a question, a remembered turn) one session
        may hold: `max_protected_fraction` of the smallest layer budget."""
        budget = self.cache.min_budget()
        return None if budget is None else int(budget * self.config.max_protected_fraction)

    def _check_protected_fits(self, what: str, tokens: int) -> None:
        limit = self.protected_limit()
        if limit is not None and tokens > limit:
            raise RequestTooLarge(
                f"{what} needs {tokens} protected tokens, more than the session may hold "
                f"({limit}: {self.config.max_protected_fraction:.0%} of the KV budget of "
                f"{self.cache.min_budget()} tokens); shorten it or raise the KV budget"
            )

    def _require_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise StreamgrokError("the engine is not started (use `async with Engine(...)`)")
        return self._loop

    def render_turn(
        self, session: SessionState, role: str, content: str, generation_prompt: bool
    ) -> str:
        """One chat turn as the model's template writes it after the session's system turn."""
        tok = self.tokenizer
        message = {"role": role, "content": content}
        if not session.system_tokens:
            return tok.render_chat([message], add_generation_prompt=generation_prompt)
        system = {"role": "system", "content": "."}
        before = tok.render_chat([system], add_generation_prompt=False)
        after = tok.render_chat([system, message], add_generation_prompt=generation_prompt)
        return after[len(before):]

    def _end_of_turn_tokens(self) -> list[int]:
        """What closes a remembered answer: end of turn in the chat template, else a newline."""
        newline = self.tokenizer.encode("\n")
        return [self.tokenizer.eos_id, *newline] if self.tokenizer.chat_template else newline

    # -- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            idle = True
            while not self._stopping.is_set():
                if self._hold.is_set():
                    self._stay_between_steps()
                    continue
                try:
                    idle = self._iterate(idle)
                except Exception as exc:  # keep serving: fail what was in flight, go on
                    log.exception("engine iteration failed")
                    self.stats.errors += 1
                    self._fail_in_flight(f"engine error: {exc}")
            self._shutdown()

    def _wait_until_holding(self) -> None:
        while not self._holding.wait(timeout=0.05):
            if self._thread is None or not self._thread.is_alive():
                raise StreamgrokError("the engine is not running")

    def _stay_between_steps(self) -> None:
        self._holding.set()
        while self._hold.is_set() and not self._stopping.is_set():
            self._wakeup.wait(timeout=0.05)
            self._wakeup.clear()
        self._holding.clear()

    def _iterate(self, idle: bool) -> bool:
        """One scheduling round; returns whether the engine is idle afterwards."""
        self._apply_commands()
        self._reap_cancelled()
        self._admit_questions()
        plan = self.scheduler.plan(self._active_sessions())
        if plan.empty:
            self._wakeup.wait(timeout=0.05)
            self._wakeup.clear()
            return True
        if idle and self.config.merge_window_s > 0:
            plan.release()
            time.sleep(self.config.merge_window_s)  # let concurrent arrivals join this step
            return False
        self._step(plan)
        return False

    def _fail_in_flight(self, message: str) -> None:
        for session in list(self._sessions.values()):
            for answer in list(session.answers.values()):
                self._abort_answer(session, answer, message)

    def _abort_answer(self, session: SessionState | None, answer: AnswerState,
                      message: str) -> None:
        """Free the answer's fork, forget it, and send its consumer the error."""
        if answer.seq_id in self.cache.sequences:
            self.cache.remove_sequence(answer.seq_id)
        if session is not None:
            session.answers.pop(answer.answer_id, None)
        self._fail(answer, message)

    def _active_sessions(self) -> list[SessionState]:
        return [s for s in self._sessions.values() if s.registered and not s.closing]

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "register":
                self._register(command[1])
            elif command[0] == "close":
                _, state, done = command
                self._close(state)
                self._require_loop().call_soon_threadsafe(_resolve, done)

    def _register(self, state: SessionState) -> None:
        self._sessions[state.session_id] = state
        try:
            reused = self.cache.add_sequence(
                state.seq_id, prefix_tokens=state.system_tokens or None,
                pinned=len(state.system_tokens),
            )
        except Exception as exc:
            log.exception("session %d could not start", state.session_id)
            self.stats.errors += 1
            self._close(state, error=f"session could not start: {exc}")
            return
        head = state.pending.head()
        if reused and isinstance(head, AppendItem):
            head.done = reused
            if head.remaining == 0:
                state.pending.pop_head()
        state.registered = True

    def _close(self, state: SessionState, error: str | None = None) -> None:
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
        if state.seq_id in self.cache.sequences:
            self.cache.remove_sequence(state.seq_id)
        self._sessions.pop(state.session_id, None)
        self._session_slots.release()

    def _reap_cancelled(self) -> None:
        for session in self._active_sessions():
            for answer in list(session.answers.values()):
                if answer.cancel_requested.is_set():
                    self._end_answer(session, answer, "cancelled")

    def _admit_questions(self) -> None:
        busy = any(s.answers for s in self._active_sessions())
        for session in self._active_sessions():
            while isinstance(marker := session.pending.head(), QuestionMarker):
                answer: AnswerState = marker.answer
                if answer.cancel_requested.is_set():
                    session.pending.pop_head()
                    self._cancel_waiting(answer)
                    continue
                seq_id = next(self._ids)
                try:
                    self.cache.fork(session.seq_id, seq_id)
                except CacheFullError as exc:
                    if busy:
                        break  # pages come back as running answers finish
                    session.pending.pop_head()
                    self._fail(answer, f"cannot start the answer: {exc}")
                    continue
                session.pending.pop_head()
                answer.seq_id = seq_id
                session.answers[answer.answer_id] = answer
                busy = True

    def _step(self, plan: StepPlan) -> None:
        started = time.perf_counter()
        sampled, failed = self._run_plan(plan)
        now = time.monotonic()
        for index, span in enumerate(plan.spans):
            if index in failed:
                self._fail_span(span, f"engine step failed: {failed[index]}")
            elif span.kind == "media":
                self._consume(span)
            else:
                answer = span.answer
                if span.kind == "prompt":
                    answer.prompt_done += len(span)
                if index in sampled:
                    self._on_token(answer, sampled[index], now)
        self._evict()
        self._publish_prefixes()
        self.stats.record(StepRecord(time.perf_counter() - started, plan.decode_tokens,
                                     plan.prefill_tokens, len(plan.spans)))

    def _run_plan(self, plan: StepPlan) -> tuple[dict[int, int], dict[int, Exception]]:
        """Run the plan on pages reserved before the forward pass. If it fails, the cache is
        rolled back and each span runs alone, so the failure is attributed to the span that
        caused it and the others still make progress. Returns (sampled, failed) by span."""
        try:
            return self._run_reserved(plan), {}
        except Exception as exc:
            if len(plan.spans) == 1:
                log.exception("engine step failed")
                self.stats.errors += 1
                return {}, {0: exc}
        sampled, failed = {}, {}
        for index, span in enumerate(plan.spans):
            try:
                got = self._run_reserved(StepPlan([span]))
            except Exception as exc:  # a bad input must not take the engine down
                log.exception("engine step failed for sequence %d", span.seq_id)
                self.stats.errors += 1
                failed[index] = exc
                continue
            if 0 in got:
                sampled[index] = got[0]
        return sampled, failed

    def _run_reserved(self, plan: StepPlan) -> dict[int, int]:
        self.cache.reserve(plan.token_counts())
        try:
            sampled = self.runner.run(plan)
        except BaseException:
            self.cache.rollback()
            raise
        self.cache.commit()
        return sampled

    def _evict(self) -> None:
        """Evict every sequence over budget; one that cannot be evicted fails its owner (that
        answer, or that session) and nobody else."""
        failed: dict[int, Exception] = {}
        self.cache.evict(failed=failed)
        for seq_id, exc in failed.items():
            log.warning("sequence %d could not be evicted: %s", seq_id, exc)
            self.stats.errors += 1
            self._fail_sequence(seq_id, f"the KV cache could not make room: {exc}")

    def _fail_sequence(self, seq_id: int, message: str) -> None:
        for session in list(self._sessions.values()):
            if session.seq_id == seq_id:
                self._close(session, error=message)
                return
            for answer in list(session.answers.values()):
                if answer.seq_id == seq_id:
                    self._abort_answer(session, answer, message)
                    return

    def _consume(self, span) -> None:
        session = span.session
        for item, n in span.items:
            item.done += n
            item.in_flight = False
        while isinstance(head := session.pending.head(), AppendItem) and head.remaining == 0:
            session.pending.pop_head()
        session.notify_space()

    def _on_token(self, answer: AnswerState, token: int, now: float) -> None:
        if answer.metrics.first_token_at is None:
            answer.metrics.first_token_step = self.stats.steps + 1
        answer.metrics.on_token(now)
        session = self._sessions.get(answer.session_id)
        if token in answer.stop_ids:
            self._end_answer(session, answer, "stop")
            return
        answer.generated.append(token)
        delta = answer.detokenizer.push(token)
        if delta:
            answer.emit("delta", delta)
        if len(answer.generated) >= answer.sampling.max_tokens:
            self._end_answer(session, answer, "length")
            return
        answer.next_token = token

    def _end_answer(self, session: SessionState, answer: AnswerState, reason: str) -> None:
        tail = answer.detokenizer.flush()
        if tail and reason != "cancelled":
            answer.emit("delta", tail)
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
        answer.emit("done", answer.metrics)

    def _remember(self, session: SessionState, answer: AnswerState) -> None:
        """The question and its answer join the session's context as (protected) text."""
        ids = answer.prompt.tolist() + answer.generated + self._end_of_turn
        limit = self.protected_limit()
        room = None if limit is None else limit - len(session.system_tokens)
        protect = self.config.protect_answers and (room is None or len(ids) <= room)
        session.pending.put(AppendItem(TokenInfo.text(len(ids), protected=protect),
                                       torch.tensor(ids, dtype=torch.long)))
        if protect and room is not None:
            self.stats.unprotected_tokens += self.cache.limit_protected(
                session.seq_id, room - len(ids))

    def _publish_prefixes(self) -> None:
        for session in self._active_sessions():
            if session.prefix_published or not session.system_tokens:
                continue
            seq = self.cache.sequences.get(session.seq_id)
            if seq is not None and seq.stream_pos >= len(session.system_tokens):
                self.cache.publish_prefix(session.seq_id, session.system_tokens)
                session.prefix_published = True

    def _cancel_waiting(self, answer: AnswerState) -> None:
        answer.metrics.finish_reason = "cancelled"
        self.stats.answers_cancelled += 1
        answer.emit("done", answer.metrics)

    def _fail(self, answer: AnswerState, message: str) -> None:
        answer.metrics.finish_reason = "error"
        self.stats.answers_failed += 1
        answer.emit("error", message)

    def _fail_span(self, span: Span, message: str) -> None:
        """A span whose forward pass failed: its answer fails, or its media is dropped."""
        if span.answer is not None:
            self._abort_answer(self._sessions.get(span.answer.session_id), span.answer, message)
            return
        for item, _ in span.items:  # drop the media that broke the step
            item.done = len(item)
        self.stats.dropped_frames += sum(1 for item, _ in span.items if item.droppable)
        self._consume(span)

    def _shutdown(self) -> None:
        for session in list(self._sessions.values()):
            self._close(session)


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
