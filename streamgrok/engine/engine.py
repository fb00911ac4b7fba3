"""The Engine: lifecycle, the asyncio API and the bridge to the engine thread.

Commands cross into the engine thread on one queue (NewSession, CloseSession, SessionInfo;
appends and questions on each session's bounded pending queue, in stream order). The engine
thread runs `schedule -> run -> update -> evict` and hands each round's events and a fresh
immutable snapshot back in one call. The scheduler (scheduler.py) owns every state change.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import torch

from streamgrok.cache.config import CacheConfig
from streamgrok.cache.contract import ContextCache, SequenceCache
from streamgrok.cache.kv_group import KVGroup
from streamgrok.cache.paged_cache import PagedKVCache
from streamgrok.cache.parking import SequenceSnapshot
from streamgrok.engine.commands import (
    CloseSession,
    ExportSession,
    NewSession,
    ParkSession,
    RestoreSession,
    SessionInfo,
    SetContext,
    UnparkSession,
)
from streamgrok.engine.config import EngineConfig
from streamgrok.engine.events import AnswerDelta
from streamgrok.engine.kv_leader import LeaderCache, LeaderModel, kv_parallel_cache, stop_followers
from streamgrok.engine.metrics import EngineStats
from streamgrok.engine.pending import AppendItem, PendingQueue, QuestionMarker
from streamgrok.engine.runner import ModelRunner, StepThreads
from streamgrok.engine.scheduler import Scheduler
from streamgrok.engine.session import Answer, Session
from streamgrok.engine.snapshot import EngineSnapshot
from streamgrok.engine.state import AnswerState, SessionState
from streamgrok.errors import RequestTooLarge, StreamgrokError
from streamgrok.loading.loader import LoadedModel
from streamgrok.model.detokenizer import IncrementalDetokenizer
from streamgrok.model.quantized import paged_cache_dtype
from streamgrok.model.sampling import SamplingParams, new_generator
from streamgrok.runtime import StepTimer, release_free_memory
from streamgrok.stream_tokens import TokenInfo
from streamgrok.vision.batcher import FrameBatcher
from streamgrok_kernels.background_compile import import_compiler

log = logging.getLogger(__name__)


class Engine:
    """Serves many sessions with one model. Use `async with Engine(...) as engine:`."""

    def __init__(
        self,
        loaded: LoadedModel,
        cache_config: CacheConfig | None = None,
        config: EngineConfig | None = None,
        kv_group: KVGroup | None = None,
    ) -> None:
        """With a `kv_group` of several ranks (this process rank 0), each session's KV is
        sharded over the ranks (KV parallelism); the other ranks run `kv_leader.follow`."""
        self.loaded = loaded
        self._timer = StepTimer(loaded.model.device)  # step seconds with the device's work
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.config
        self.config = config or EngineConfig()
        self.kv_group = kv_group if kv_group is not None and kv_group.world > 1 else None
        model = loaded.model
        if model.device.type == "cpu" and model.kernels.paged_reader.compiled:
            import_compiler()  # the paged reads compile in the background while serving
        # "auto" K/V: bfloat16 for a quantized model on the CPU, else the compute dtype
        cache_config = (cache_config or CacheConfig()).for_model(paged_cache_dtype(model))
        if cache_config.frame_aware is None:  # a vision model's frames are kept or evicted whole
            cache_config = replace(cache_config, frame_aware=loaded.vision is not None)
        # the model's own vision tower, shared by every session (frames batched across them)
        self.vision = (FrameBatcher(loaded.vision, loaded.tokenizer, loaded.model.embed)
                       if loaded.vision is not None else None)
        self.cache: SequenceCache
        if self.kv_group is None:
            self.cache = PagedKVCache(
                loaded.config, cache_config, loaded.model.dtype,
                loaded.model.device, kernels=loaded.model.kernels,
            )
        else:
            if self.config.nano_batches != 1:
                raise ValueError("KV parallelism runs one batch a step: use nano_batches=1")
            self.cache = LeaderCache(kv_parallel_cache(loaded, cache_config,
                                                       self.kv_group))
            model = LeaderModel(loaded.model, self.kv_group)
        self._ids = itertools.count(1)
        self.scheduler = Scheduler(self.config, self.cache, self._ids,
                                   self._end_of_turn_tokens(), self.protected_limit())
        threads = (StepThreads.for_cpu(self.config.small_step_threads,
                                       self.config.small_step_tokens)
                   if loaded.model.device.type == "cpu" else None)
        self.runner = ModelRunner(model, self.cache, self.config.nano_batches,
                                  self.config.length_ratio, threads)
        self._session_slots = threading.BoundedSemaphore(self.config.max_sessions)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._snapshot = self.scheduler.snapshot()
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._hold = threading.Event()  # paused(): asked to stay between steps
        self._holding = threading.Event()  # the engine thread is staying between steps
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._memory_freed = False  # a session closed since the heap was last trimmed
        self._parks_trimmed = 0  # sessions parked when the heap was last trimmed

    @property
    def stats(self) -> EngineStats:
        """The scheduler's counters (written by the engine thread; read them, or better the
        immutable `snapshot()`)."""
        return self.scheduler.stats

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
        if self.vision is not None:
            self.vision.start()

    async def stop(self) -> None:
        """Stop the worker after its current step (and the KV-parallel followers)."""
        self._stopping.set()
        self.wake()
        if self.vision is not None:
            await asyncio.to_thread(self.vision.stop)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        if self.kv_group is not None:
            stop_followers(self.kv_group)
            self.kv_group = None

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
        session, state = self._session(system_prompt)
        if state.system_tokens:
            state.pending.put(AppendItem(
                TokenInfo.text(len(state.system_tokens), protected=True),
                torch.tensor(state.system_tokens, dtype=torch.long)))
        self._command(NewSession(state))
        return session

    def restore_session(self, system_prompt: str | None,
                        snapshot: SequenceSnapshot) -> Session:
        """A session that carries on from `snapshot` (see `export_session`), parked: its
        first `unpark` brings its KV into pages. A snapshot that does not fit this model's
        cache ends the session with the reason (`Session` calls then raise)."""
        session, state = self._session(system_prompt)
        if snapshot.context_target is not None:
            state.context = (snapshot.context_target,
                             snapshot.context_target + (snapshot.context_slack or 0))
        self._command(RestoreSession(state, snapshot))
        return session

    def set_context(self, state: SessionState, target: int | None,
                    trigger: int | None) -> None:
        """Bound a session's context below the server's budget: each layer is cut back to
        `target` tokens once it holds more than `trigger` (None: the server's). ValueError
        when they do not fit this cache (see `ContextCache.context_bounds`), or where the cache
        keeps no client bounds (KV parallelism)."""
        if not isinstance(self.cache, ContextCache):
            raise ValueError("a session's own context bounds are not available with KV "
                             "parallelism: leave context.target_tokens unset")
        target, trigger = self.cache.context_bounds(target, trigger, len(state.system_tokens))
        state.context = (target, trigger)
        self._command(SetContext(state, target, trigger))

    async def export_session(self, state: SessionState) -> SequenceSnapshot:
        """A snapshot of a parked session's sequence (records and KV entries, not its host
        tier), to restore in another process with the same model and KV format."""
        done = self._require_loop().create_future()
        self._command(ExportSession(state, done))
        return await done

    def _session(self, system_prompt: str | None) -> tuple[Session, SessionState]:
        session_id = next(self._ids)
        system_tokens = []
        if system_prompt is not None:
            system_tokens = self.tokenizer.encode(
                self.tokenizer.render_chat([{"role": "system", "content": system_prompt}],
                                           add_generation_prompt=False))
        self._check_protected_fits("the system prompt", len(system_tokens))
        self._require_loop()
        if not self._session_slots.acquire(blocking=False):
            raise StreamgrokError(f"too many sessions (max {self.config.max_sessions})")
        space = asyncio.Event()
        state = SessionState(
            session_id, next(self._ids),
            PendingQueue(self.config.frame_queue, self.config.text_queue_tokens),
            system_tokens, notify_space=space.set, on_closed=self._session_slots.release,
        )
        return Session(self, state, space), state

    def submit_question(
        self,
        session: SessionState,
        question: str,
        sampling: SamplingParams | None,
        raw: bool,
        remember: bool,
        add_bos: bool | None = None,
        answer_prefix: str = "",
        own_context: bool = False,
    ) -> Answer:
        if own_context and remember:
            raise ValueError("an answer over a context of its own cannot join the stream")
        sampling = sampling or SamplingParams()
        turn = question if raw else self.render_turn(session, "user", question, True)
        turn += answer_prefix  # the answer's first words, given: the model goes on from them
        prompt = self.tokenizer.encode(turn, add_bos)
        self._check_protected_fits("the question", len(session.system_tokens) + len(prompt))
        self._require_loop()
        out: asyncio.Queue = asyncio.Queue(maxsize=sampling.max_tokens + 4)
        state = AnswerState(
            answer_id=next(self._ids),
            session_id=session.session_id,
            prompt=torch.tensor(prompt, dtype=torch.long),
            sampling=sampling,
            # on the model's device: multinomial draws there (a CPU generator fails on CUDA)
            generator=None if sampling.greedy else new_generator(sampling,
                                                                 self.loaded.model.device),
            detokenizer=IncrementalDetokenizer(self.tokenizer),
            stop_ids=self.tokenizer.stop_ids | sampling.stop_token_ids,
            deliver=out.put_nowait,
            append_to_context=remember,
        )
        state.metrics.prompt_tokens = len(prompt)
        state.metrics.asked_step = self._snapshot.steps
        if answer_prefix:
            out.put_nowait(AnswerDelta(answer_prefix))
        session.pending.put(QuestionMarker(state, own_context))
        self.wake()
        return Answer(state, out, self)

    async def close_session(self, state: SessionState) -> None:
        done = self._require_loop().create_future()
        self._command(CloseSession(state, done))
        await done

    async def session_info(self, state: SessionState) -> dict:
        """What the cache holds of one session: tokens per layer and the retained frames,
        notes and audio (read on the engine thread)."""
        done = self._require_loop().create_future()
        self._command(SessionInfo(state, done))
        return await done

    async def park_session(self, state: SessionState) -> int:
        """Move a session's KV into host memory as soon as it is idle (its running answers
        done, its queue drained), so it holds no pages; returns the bytes parked (0 when the
        park was called off by `unpark_session` or a close, or the cache cannot park)."""
        done = self._require_loop().create_future()
        self._command(ParkSession(state, done))
        return await done

    async def unpark_session(self, state: SessionState) -> None:
        """Bring a parked session's KV back into pages (or call off a pending park); raises
        CacheFullError, leaving it parked, when the pool lacks the pages."""
        done = self._require_loop().create_future()
        self._command(UnparkSession(state, done))
        await done

    def _command(self, command: object) -> None:
        self._commands.put(command)
        self.wake()

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

    def snapshot(self) -> EngineSnapshot:
        """Engine and cache numbers for metrics and the `stats` event: an immutable copy the
        engine thread publishes after every round (never read live engine state); with a
        vision tower also `vision`, the frame batcher's counters."""
        if self.vision is None:
            return self._snapshot
        return replace(self._snapshot, vision=self.vision.stats.as_dict())

    def protected_limit(self) -> int | None:
        """Most protected tokens (system prompt, a question, a remembered turn) one session
        may hold: `max_protected_fraction` of the smallest layer budget."""
        budget = self.cache.min_budget()
        return None if budget is None else int(budget * self.config.max_protected_fraction)

    def context_policy(self, session: SessionState) -> dict:
        """What a session's context keeps, for clients to reason about what the model still
        remembers: the pinned system prompt, the protected share (questions and remembered
        turns), the eviction policy and when it runs (a layer past `trigger_tokens` is cut
        back to `target_tokens`, the layer budget), and the host tier recall reads from.
        Positions are cache-relative, so a stream has no length limit."""
        config = self.cache.config
        budget = self.cache.min_budget()
        tier = getattr(self.cache, "tier", None)
        target, trigger = session.context or (budget, None if budget is None
                                              else budget + config.slack)
        return {
            "policy": config.policy,
            "pinned_tokens": len(session.system_tokens),
            "protected_limit_tokens": self.protected_limit(),
            "target_tokens": target,
            "trigger_tokens": trigger,
            "host_tier_bytes": None if tier is None else tier.capacity_pages * tier.page_bytes,
            "positions": "cache-relative",
        }

    def question_room(self, session: SessionState) -> int | None:
        """How many tokens the text of a question to `session` may have (None: no bound):
        what the protected share leaves after the system prompt and the turn's framing."""
        limit = self.protected_limit()
        if limit is None:
            return None
        framing = len(self.tokenizer.encode(self.render_turn(session, "user", "", True)))
        return limit - len(session.system_tokens) - framing

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
        if self.runner.threads is not None:
            self.runner.threads.adopt()
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
                    self.scheduler.stats.errors += 1
                    self.scheduler.fail_everything(f"engine error: {exc}")
                self._publish()
                if idle:  # nothing to run: sleep until work arrives
                    self._wakeup.wait(timeout=0.05)
                    self._wakeup.clear()
            self.scheduler.close_all()
            self._publish()
        if self.runner.threads is not None:
            self.runner.threads.restore()

    def _iterate(self, idle: bool) -> bool:
        """One round: commands, then schedule -> run -> update -> evict (the caller then
        publishes). Returns whether there was nothing to run."""
        self._apply_commands()
        plan = self.scheduler.schedule()
        if plan.empty:
            parks = self.scheduler.stats.parks
            if self._memory_freed or parks != self._parks_trimmed:
                # sessions left or parked, and nothing runs: give the memory back
                self._memory_freed, self._parks_trimmed = False, parks
                release_free_memory()
            return True
        if idle and self.config.merge_window_s > 0:
            plan.release()
            time.sleep(self.config.merge_window_s)  # let concurrent arrivals join this step
            return False
        self._timer.start()
        sampled, failed = self.runner.execute(plan)
        self.scheduler.update(plan, sampled, failed, self._timer.stop())
        self.scheduler.evict()
        return False

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            match command:
                case NewSession(state):
                    self.scheduler.register(state)
                case CloseSession(state, done):
                    self.scheduler.close(state)
                    self.scheduler.outputs.wake(lambda done=done: _resolve(done))
                    self._memory_freed = True
                case ParkSession(state, done):
                    self.scheduler.request_park(
                        state, lambda parked, done=done: _resolve(done, parked))
                case UnparkSession(state, done):
                    error = self.scheduler.unpark(state)
                    self.scheduler.outputs.wake(
                        lambda done=done, error=error: _resolve(done, error=error))
                case SetContext(state, target, trigger):
                    if state.seq_id in self.cache.sequences and \
                            isinstance(self.cache, ContextCache):
                        self.cache.set_context(state.seq_id, target, trigger)
                case RestoreSession(state, snapshot):
                    self.scheduler.restore(state, snapshot)
                case ExportSession(state, done):
                    snapshot, error = self.scheduler.export(state)
                    self.scheduler.outputs.wake(
                        lambda done=done, snapshot=snapshot, error=error:
                        _resolve(done, snapshot, error))
                case SessionInfo(state, done):
                    info = self._session_info(state)
                    self.scheduler.outputs.wake(lambda done=done, info=info: _resolve(done, info))

    def _session_info(self, state: SessionState) -> dict:
        cache = self.cache
        if state.seq_id not in cache.sequences:
            return {"layer_tokens": [], "retained": []}
        return {"layer_tokens": cache.layer_lengths(state.seq_id),
                "retained": cache.retained(state.seq_id)}

    def _publish(self) -> None:
        """One hand-off to the event loop: this round's answer events and wake-ups, replies to
        commands, and a fresh snapshot."""
        outputs = self.scheduler.take_outputs()
        self._snapshot = self.scheduler.snapshot()
        if outputs and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening
                self._loop.call_soon_threadsafe(outputs.deliver)

    def _wait_until_holding(self) -> None:
        while not self._holding.wait(timeout=0.05):
            if self._thread is None or not self._thread.is_alive():
                raise StreamgrokError("the engine is not running")

    def _stay_between_steps(self) -> None:
        self._holding.set()
        while self._hold.is_set() and not self._stopping.is_set():
            self._apply_commands()
            self._publish()
            self._wakeup.wait(timeout=0.05)
            self._wakeup.clear()
        self._holding.clear()


def _resolve(future: asyncio.Future, value: object = None,
             error: BaseException | None = None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
