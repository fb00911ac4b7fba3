"""The planner and the scheduler alone, without a thread or a model: fake sessions and fake
sampled tokens on a real page pool."""

from __future__ import annotations

import itertools
import time

import torch
from helpers import tiny_config

from streamgrok.cache.config import CacheConfig
from streamgrok.cache.paged_cache import PagedKVCache
from streamgrok.engine.config import EngineConfig
from streamgrok.engine.events import AnswerDelta, AnswerDone
from streamgrok.engine.pending import AppendItem, PendingQueue, QuestionMarker
from streamgrok.engine.plan import Planner
from streamgrok.engine.scheduler import Scheduler
from streamgrok.engine.state import AnswerState, SessionState
from streamgrok.model.batch import BatchMetadata
from streamgrok.model.sampling import SamplingParams
from streamgrok.stream_tokens import Modality, TokenInfo

CFG = tiny_config()


def make(config: EngineConfig | None = None, frame_queue: int = 2):
    cache = PagedKVCache(CFG, CacheConfig(policy="h2o", budget_tokens=256), num_pages=256)
    return Planner(config or EngineConfig(media_batch_tokens=1), cache), cache, frame_queue


def session(cache, session_id: int, frame_queue: int) -> SessionState:
    state = SessionState(session_id, session_id, PendingQueue(frame_queue, 1024), [],
                         notify_space=lambda: None, registered=True)
    cache.add_sequence(state.seq_id)
    return state


def frame(k: int = 4, t: float = 0.0) -> AppendItem:
    info = TokenInfo.uniform(k, Modality.FRAME, t, int(t), False)
    return AppendItem(info, torch.zeros(k, dtype=torch.long), torch.randn(k, CFG.hidden_size),
                      droppable=True)


def test_a_frame_being_prefilled_is_never_dropped_by_a_concurrent_put():
    scheduler, cache, queue = make(frame_queue=1)
    state = session(cache, 1, queue)
    first = frame(t=0)
    state.pending.put(first)
    plan = scheduler.plan([state])
    assert [item for item, _ in plan.spans[0].items] == [first]
    dropped = state.pending.put(frame(t=1))  # over capacity while `first` is in the step
    assert first not in dropped and len(dropped) == 1  # the newer frame went instead
    assert state.pending.dropped_items == 1


def test_a_discarded_plan_gives_its_frames_back_to_the_drop_policy():
    scheduler, cache, queue = make(frame_queue=1)
    state = session(cache, 1, queue)
    first = frame(t=0)
    state.pending.put(first)
    scheduler.plan([state]).release()
    assert state.pending.put(frame(t=1)) == [first]  # drop-oldest applies again


def test_media_prefill_is_shared_round_robin_between_sessions():
    config = EngineConfig(step_tokens=8, min_prefill_share=4, media_batch_tokens=1)
    scheduler, cache, queue = make(config, frame_queue=8)
    states = [session(cache, i, queue) for i in (1, 2, 3)]
    for state in states:
        for t in range(3):
            state.pending.put(frame(4, t))
    firsts = []
    for _ in range(3):
        plan = scheduler.plan(states)
        assert sum(len(s) for s in plan.spans) <= 8
        firsts.append(plan.spans[0].seq_id)
        plan.release()
    assert sorted(firsts) == [1, 2, 3]  # each session leads one step in turn


def test_prefill_waits_for_free_pages_and_claims_nothing_it_cannot_run():
    scheduler, _, queue = make(frame_queue=8)
    small = PagedKVCache(CFG, CacheConfig(policy="h2o", budget_tokens=256), num_pages=1)
    scheduler.cache = small
    state = session(small, 1, queue)
    item = frame(64)
    state.pending.put(item)
    assert scheduler.plan([state]).empty  # 64 tokens need 4 pages per layer; 1 is free
    assert not item.in_flight


def test_a_question_marker_stops_media_at_the_point_it_was_asked():
    scheduler, cache, queue = make(frame_queue=8)
    state = session(cache, 1, queue)
    before, after = frame(4, 0), frame(4, 1)
    state.pending.put(before)
    state.pending.put(QuestionMarker(answer=None))
    state.pending.put(after)
    plan = scheduler.plan([state])
    assert [item for item, _ in plan.spans[0].items] == [before]


# -- the scheduler: transitions with fake sampled tokens -------------------------------------



EOS = 2


class FakeDetokenizer:
    def push(self, token: int) -> str:
        return f"<{token}>"

    def flush(self) -> str:
        return ""


def new_scheduler(**config) -> Scheduler:
    cache = PagedKVCache(CFG, CacheConfig(policy="h2o", budget_tokens=256), num_pages=512)
    return Scheduler(EngineConfig(media_batch_tokens=1, **config), cache, itertools.count(100),
                     end_of_turn=[EOS], protected_limit=128)


def registered(scheduler: Scheduler, session_id: int) -> SessionState:
    state = SessionState(session_id, session_id, PendingQueue(8, 4096), [], lambda: None)
    scheduler.register(state)
    return state


def question(state: SessionState, prompt_len: int = 5, max_tokens: int = 3) -> tuple:
    events = []
    answer = AnswerState(
        answer_id=state.session_id * 10, session_id=state.session_id,
        prompt=torch.arange(prompt_len) + 10, sampling=SamplingParams(max_tokens=max_tokens),
        generator=None, detokenizer=FakeDetokenizer(), stop_ids=frozenset({EOS}),
        deliver=events.append)
    state.pending.put(QuestionMarker(answer))
    return answer, events


def run_step(scheduler: Scheduler, tokens: dict[int, int] | None = None):
    """Schedule, 'run' (every sampling span samples tokens[seq] or 7), update, deliver."""
    plan = scheduler.schedule()
    counts = plan.token_counts()
    scheduler.cache.reserve(counts)
    for span in plan.spans:  # records only: the forward pass is not what is tested here
        batch = BatchMetadata.build([span.seq_id], [len(span)])
        batch.token_info = span.info
        scheduler.cache.attention.prepare(batch)
    scheduler.cache.commit()
    sampled = {i: (tokens or {}).get(span.seq_id, 7)
               for i, span in enumerate(plan.spans) if span.samples}
    scheduler.update(plan, sampled, {}, 0.001)
    scheduler.take_outputs().deliver()
    return plan


def test_decode_runs_first_then_prompts_then_media():
    scheduler = new_scheduler(step_tokens=64, decode_step_prefill=64)
    asking, streaming = registered(scheduler, 1), registered(scheduler, 2)
    answer, _ = question(asking, prompt_len=5)
    streaming.pending.put(frame(8, 0))
    first = run_step(scheduler)  # the prompt (it samples) and the media
    assert [s.kind for s in first.spans] == ["prompt", "media"]
    streaming.pending.put(frame(8, 1))
    second = run_step(scheduler)
    assert [s.kind for s in second.spans] == ["decode", "media"]
    assert second.spans[0].answer is answer


def test_a_long_prompt_is_prefilled_in_shares_and_samples_once_at_its_end():
    scheduler = new_scheduler(step_tokens=16)
    state = registered(scheduler, 1)
    answer, events = question(state, prompt_len=40)
    spans = [run_step(scheduler).spans[0] for _ in range(3)]
    assert [len(s) for s in spans] == [16, 16, 8]
    assert [s.samples for s in spans] == [False, False, True]
    assert answer.prompt_done == 40 and events == [AnswerDelta("<7>")]


def test_stop_token_ends_the_answer_frees_its_fork_and_remembers_the_turn():
    scheduler = new_scheduler()
    state = registered(scheduler, 1)
    answer, events = question(state, prompt_len=5, max_tokens=10)
    run_step(scheduler)  # prompt -> token 7
    fork = answer.seq_id
    run_step(scheduler, {fork: EOS})  # decode -> stop
    assert isinstance(events[-1], AnswerDone) and answer.metrics.finish_reason == "stop"
    assert fork not in scheduler.cache.sequences and not state.answers
    remembered = state.pending.head()
    assert remembered.token_ids.tolist() == [10, 11, 12, 13, 14, 7, EOS]
    assert bool(remembered.info.protected.all())


def test_cancelling_mid_prefill_ends_the_answer_and_frees_its_pages():
    scheduler = new_scheduler(step_tokens=8)
    state = registered(scheduler, 1)
    free = scheduler.cache.pool.free_pages
    answer, events = question(state, prompt_len=40)
    run_step(scheduler)
    assert 0 < answer.prompt_done < 40
    answer.cancel_requested.set()
    assert run_step(scheduler).empty
    assert events[-1] == AnswerDone(answer.metrics) and answer.metrics.finish_reason == "cancelled"
    assert scheduler.cache.pool.free_pages == free
    assert answer.seq_id not in scheduler.cache.sequences


# -- answers first under a live backlog -------------------------------------------------------


def test_a_question_behind_a_deep_live_backlog_is_answered_within_a_bounded_number_of_steps():
    """64 live frames of 32 tokens wait in front of the question: the stale ones are dropped
    (counted), the question's session is fed first, and the first token comes within a few
    steps whatever the backlog."""
    scheduler = new_scheduler(step_tokens=64, media_freshness_s=1.0, frame_queue=64)
    busy = [registered(scheduler, i) for i in (1, 2, 3)]
    asking = registered(scheduler, 4)
    old = time.monotonic() - 10.0  # queued 10 s ago: past the freshness bound
    for state in [*busy, asking]:
        state.pending.frame_capacity = 100
        for t in range(64):
            item = frame(32, t)
            item.queued_at = old
            state.pending.put(item)
    fresh = frame(32, 64)
    asking.pending.put(fresh)
    answer, events = question(asking, prompt_len=5)
    for _ in range(5):
        run_step(scheduler)
        if events:
            break
    assert events and isinstance(events[0], AnswerDelta), "no first token within 5 steps"
    assert asking.pending.dropped["stale"] == 64  # the backlog went, counted by reason
    assert fresh.done == len(fresh)  # the fresh frame was prefilled before the question
    assert scheduler.snapshot().dropped["stale"] == 4 * 64


def test_a_newer_state_note_replaces_a_waiting_one_and_text_is_never_dropped():
    queue = PendingQueue(8, 4096)
    text = AppendItem(TokenInfo.text(3), torch.zeros(3, dtype=torch.long))
    first = AppendItem(TokenInfo.text(3), torch.zeros(3, dtype=torch.long), state_key="observer")
    queue.put(text)
    queue.put(first)
    second = AppendItem(TokenInfo.text(3), torch.zeros(3, dtype=torch.long),
                        state_key="observer")
    assert queue.put(second) == [first]
    first_claimed = queue.claim(100)
    assert [item for item, _, _ in first_claimed] == [text, second]
    third = AppendItem(TokenInfo.text(3), torch.zeros(3, dtype=torch.long), state_key="observer")
    assert queue.put(third) == []  # `second` is being prefilled: it finishes
    assert queue.drop_stale(0.0, time.monotonic() + 100) == 0  # not live frames
    assert dict(queue.dropped) == {"superseded": 1}
