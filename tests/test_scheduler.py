"""The planner and the scheduler alone, without a thread or a model: fake sessions and fake
sampled tokens on a real page pool."""

from __future__ import annotations

import torch
from helpers import tiny_config

from streamgrok.cache.config import CacheConfig
from streamgrok.cache.paged_cache import PagedKVCache
from streamgrok.engine.config import EngineConfig
from streamgrok.engine.pending import AppendItem, PendingQueue, QuestionMarker
from streamgrok.engine.plan import Planner
from streamgrok.engine.state import SessionState
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
