"""The async engine on a tiny random model: batching, fairness, cancel, memory pressure."""

from __future__ import annotations

import asyncio

import pytest
import torch

from streamgrok.cache.config import CacheConfig
from streamgrok.engine import Engine, EngineConfig
from streamgrok.errors import StreamgrokError
from streamgrok.model.sampling import SamplingParams
from streamgrok.stream_tokens import Modality

GREEDY = SamplingParams(max_tokens=12)
CACHE = CacheConfig(policy="h2o", budget_tokens=96, memory_gib=0.01)


async def answer_alone(loaded, notes, question, config=None):
    async with Engine(loaded, CACHE, config or EngineConfig(merge_window_s=0)) as engine:
        session = engine.new_session("sys")
        for note in notes:
            await session.append_message(note)
        return await session.ask(question, GREEDY).text()


async def test_concurrent_sessions_equal_sessions_alone(tiny_loaded):
    work = [([f"note {i} " * (i + 1)], f"question {i}?") for i in range(6)]
    alone = [await answer_alone(tiny_loaded, n, q) for n, q in work]
    async with Engine(tiny_loaded, CACHE, EngineConfig(merge_window_s=0.01)) as engine:
        sessions = [engine.new_session("sys") for _ in work]
        for session, (notes, _) in zip(sessions, work):
            for note in notes:
                await session.append_message(note)
        answers = [s.ask(q, GREEDY) for s, (_, q) in zip(sessions, work)]
        together = await asyncio.gather(*(a.text() for a in answers))
        assert max(r.sequences for r in engine.stats.recent) > 1  # really batched
    assert together == alone


@pytest.mark.parametrize("nano", [2, 4])
async def test_nano_batches_give_identical_outputs(tiny_loaded, nano):
    async def run(n):
        config = EngineConfig(merge_window_s=0.01, nano_batches=n)
        async with Engine(tiny_loaded, CACHE, config) as engine:
            sessions = [engine.new_session("sys") for _ in range(5)]
            for i, s in enumerate(sessions):
                await s.append_message("x " * (3 + 7 * i))
            return await asyncio.gather(*(s.ask(f"q{i}", GREEDY).text()
                                          for i, s in enumerate(sessions)))
    assert await run(nano) == await run(1)


async def test_frames_stream_in_while_answering(tiny_loaded):
    hidden = tiny_loaded.config.hidden_size
    async with Engine(tiny_loaded, CACHE, EngineConfig(merge_window_s=0)) as engine:
        session = engine.new_session("sys")
        answer = session.ask("describe", SamplingParams(max_tokens=30))
        deltas = []
        frame = 0
        async for delta in answer:
            deltas.append(delta)
            session.append_embeddings(torch.randn(4, hidden), timestamp=frame / 2, source=frame)
            frame += 1
        assert answer.metrics.finish_reason in ("stop", "length")
        await asyncio.sleep(0.2)
        seq = engine.cache.sequences[session._state.seq_id]
        modalities = seq.layers[0].column(2).long()
        assert (modalities == int(Modality.FRAME)).sum() > 0  # frames went in meanwhile
        await session.close()


async def test_cancel_and_close_free_every_page(tiny_loaded):
    async with Engine(tiny_loaded, CACHE, EngineConfig(merge_window_s=0)) as engine:
        total = engine.cache.pool.num_pages
        session = engine.new_session("sys")
        await session.append_message("hello " * 40)
        answer = session.ask("go on", SamplingParams(max_tokens=200, temperature=1.0, seed=1,
                                                     stop_token_ids=frozenset()))
        got = 0
        async for _ in answer:
            got += 1
            if got == 3:
                answer.cancel()
        assert answer.metrics.finish_reason == "cancelled"
        other = session.ask("and now?", SamplingParams(max_tokens=4))
        await session.close()
        async for _ in other:
            pass
        assert other.metrics.finish_reason == "cancelled"
        await asyncio.sleep(0.05)
        assert engine.cache.pool.free_pages == total and not engine.cache.sequences


async def test_flooding_session_cannot_delay_another_first_token(tiny_loaded):
    hidden = tiny_loaded.config.hidden_size
    config = EngineConfig(merge_window_s=0, step_tokens=64, frame_queue=16)
    async with Engine(tiny_loaded, CACHE, config) as engine:
        flood = engine.new_session("sys")
        calm = engine.new_session("sys")
        for i in range(300):
            flood.append_embeddings(torch.randn(8, hidden), timestamp=i, source=i)
        await asyncio.sleep(0.05)
        answer = calm.ask("quick?", SamplingParams(max_tokens=2))
        for i in range(300, 400):  # the flood goes on while the other session waits
            flood.append_embeddings(torch.randn(8, hidden), timestamp=i, source=i)
            await asyncio.sleep(0)
        await answer.text()
        waited = answer.metrics.first_token_step - answer.metrics.asked_step
        assert waited <= 4  # system prompt + question turn share the step budget fairly
        assert flood.dropped_frames > 0
        assert engine.snapshot().dropped_frames == flood.dropped_frames


async def test_full_policy_out_of_pages_waits_and_others_continue(tiny_loaded):
    cache = CacheConfig(policy="full", budget_tokens=None).for_model(tiny_loaded.model.dtype)
    pages_bytes = cache.page_bytes(tiny_loaded.config)
    cache = CacheConfig(policy="full", budget_tokens=None,
                        memory_gib=40 * pages_bytes / 2**30)  # 40 pages = 20 per layer
    async with Engine(tiny_loaded, cache, EngineConfig(merge_window_s=0)) as engine:
        calm = engine.new_session()
        await calm.append_message("hi")
        await asyncio.sleep(0.05)
        hog = engine.new_session()
        await hog.append_text("a " * 600)  # more than the pool can ever hold
        await asyncio.sleep(0.2)
        assert hog.pending_tokens() > 0  # waiting, not crashed, not corrupted
        answer = calm.ask("still there?", SamplingParams(max_tokens=3))
        await answer.text()
        assert answer.metrics.finish_reason in ("stop", "length") and answer.metrics.tokens > 0
        assert hog.pending_tokens() > 0 and engine.stats.errors == 0


async def test_closed_session_refuses_work(tiny_loaded):
    async with Engine(tiny_loaded, CACHE) as engine:
        session = engine.new_session()
        await session.close()
        with pytest.raises(StreamgrokError, match="closed"):
            session.ask("hello?")


async def test_one_shot_generate(tiny_loaded):
    async with Engine(tiny_loaded, CACHE) as engine:
        text = "".join([d async for d in engine.generate("hi", SamplingParams(max_tokens=5))])
        assert isinstance(text, str)
        await asyncio.sleep(0.05)
        assert not engine.cache.sequences


async def test_work_queued_while_paused_starts_in_one_step(tiny_loaded):
    async with Engine(tiny_loaded, CACHE, EngineConfig(merge_window_s=0)) as engine:
        async with engine.paused():
            sessions = [engine.new_session("sys") for _ in range(3)]
            for session in sessions:
                await session.append_message("note " * 4)
            answers = [s.ask("q?", GREEDY) for s in sessions]
            await asyncio.sleep(0.1)
            assert engine.stats.steps == 0  # nothing ran while paused
        texts = await asyncio.gather(*(a.text() for a in answers))
        assert engine.stats.recent[0].sequences == 3  # all three sessions in the first step
    assert len(set(texts)) == 1  # same context, same question: same greedy answer


async def test_an_answer_over_its_own_context_sees_the_system_prompt_alone(tiny_loaded):
    fresh = await answer_alone(tiny_loaded, [], "what now?")
    config = EngineConfig(merge_window_s=0, step_tokens=16)
    async with Engine(tiny_loaded, CACHE, config) as engine:
        session = engine.new_session("sys")
        async with engine.paused():
            await session.append_message("note " * 150)
            behind = session.ask("what now?", GREEDY)  # reached after the notes
            own = session.ask("what now?", GREEDY, remember=False, own_context=True)
        texts = await asyncio.gather(behind.text(), own.text())
        with pytest.raises(ValueError, match="own"):
            session.ask("what now?", GREEDY, own_context=True)  # remember=True
        async with engine.paused():
            seq = engine.cache.sequences[session._state.seq_id]
            streamed = seq.stream_pos
    assert texts[1] == fresh  # nothing of the stream reached it
    # it waited for none of the steps that prefilled the notes queued before it
    assert own.metrics.first_token_step < streamed // config.step_tokens
    assert own.metrics.first_token_step < behind.metrics.first_token_step


async def test_a_question_larger_than_the_budget_allows_is_rejected_up_front(tiny_loaded):
    from streamgrok.errors import RequestTooLarge

    async with Engine(tiny_loaded, CACHE, EngineConfig(merge_window_s=0)) as engine:
        session = engine.new_session("sys")
        with pytest.raises(RequestTooLarge, match="question needs .* protected tokens"):
            session.ask("why " * 200, GREEDY)
        with pytest.raises(RequestTooLarge, match="system prompt"):
            engine.new_session("rules " * 200)
        assert await session.ask("still there?", GREEDY).text() is not None


async def test_remembered_turns_never_make_eviction_impossible(tiny_loaded):
    """Many remembered question/answer turns (protected) in a small budget: the session keeps
    answering; old turns lose protection instead of failing the cache."""
    async with Engine(tiny_loaded, CACHE, EngineConfig(merge_window_s=0)) as engine:
        session = engine.new_session("sys")
        for i in range(8):
            await session.append_message(f"note {i} " * 6)
            answer = session.ask(f"question {i}?", GREEDY)
            await answer.text()
            assert answer.metrics.finish_reason in ("stop", "length")
        assert engine.stats.errors == 0
        assert engine.cache.stats.evicted_tokens > 0


async def test_an_eviction_failure_fails_only_its_own_session(tiny_loaded):
    from streamgrok.errors import CacheFullError

    async with Engine(tiny_loaded, CACHE, EngineConfig(merge_window_s=0)) as engine:
        victim, bystander = engine.new_session("sys"), engine.new_session("sys")
        original = engine.cache._evict_sequence

        def failing(seq, force):
            if seq.seq_id == victim._state.seq_id:
                raise CacheFullError("injected")
            return original(seq, force)

        engine.cache._evict_sequence = failing
        doomed = victim.ask("doomed?", GREEDY)
        with pytest.raises(StreamgrokError, match="injected"):
            await doomed.text()
        with pytest.raises(StreamgrokError, match="ended: .*injected"):
            await victim.append_message("more")
        assert await bystander.ask("fine?", GREEDY).text() is not None
        assert victim._state.seq_id not in engine.cache.sequences


async def test_sessions_created_and_closed_while_the_engine_steps(tiny_loaded):
    """Sessions come and go from the event loop while the engine thread steps: every answer
    ends exactly once (answered or cancelled), nothing fails, and every page comes back."""
    async with Engine(tiny_loaded, CACHE, EngineConfig(merge_window_s=0)) as engine:
        ended = []

        async def one(i: int) -> None:
            session = engine.new_session("sys")
            await session.append_message(f"note {i}")
            answer = session.ask(f"q{i}?", SamplingParams(max_tokens=4))
            if i % 3 == 0:
                await asyncio.sleep(0)
                await session.close()  # mid-flight: its answer ends as cancelled
            text = await answer.text()
            ended.append((i, answer.metrics.finish_reason, text))
            await session.close()

        for wave in range(4):
            await asyncio.gather(*(one(wave * 10 + i) for i in range(10)))
        assert sorted(i for i, _, _ in ended) == list(range(40))
        assert {reason for _, reason, _ in ended} <= {"stop", "length", "cancelled"}
        assert engine.stats.errors == 0 and engine.stats.answers_failed == 0
        await asyncio.sleep(0.1)
        assert engine.snapshot().sessions == 0
        assert engine.cache.pool.used_pages == 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
async def test_a_failing_forward_fails_only_the_answer_that_caused_it(tiny_loaded, backend):
    """A layer raises mid-forward whenever the victim's question is in the batch: that
    answer fails with the error, the bystander's answer batched with it is unaffected, the
    engine goes on, and every page comes back (on both kernel backends)."""
    from streamgrok_kernels.ops import KernelOps

    short = SamplingParams(max_tokens=2)
    model = tiny_loaded.model
    kernels, model.kernels = model.kernels, KernelOps(backend)
    marker = torch.tensor(tiny_loaded.tokenizer.encode("xyzzy"))
    layer = model.layers[1]
    original_forward, original_layer = model.forward, layer.forward
    poisoned = []

    def watching(ids, batch, backend):
        found = ids.numel() >= len(marker) and bool(
            (ids.cpu().unfold(0, len(marker), 1) == marker).all(dim=1).any())
        poisoned.append(found)
        return original_forward(ids, batch, backend)

    def sometimes_broken(*args, **kwargs):
        if poisoned[-1]:
            raise RuntimeError("injected failure")
        return original_layer(*args, **kwargs)

    async with Engine(tiny_loaded, CACHE, EngineConfig(merge_window_s=0)) as engine:
        victim, bystander = engine.new_session("sys"), engine.new_session("sys")
        model.forward, layer.forward = watching, sometimes_broken
        try:
            async with engine.paused():
                bad = victim.ask("xyzzy?", short)
                good = bystander.ask("fine?", short)
            good_text = await good.text()
            with pytest.raises(StreamgrokError, match="injected failure"):
                await bad.text()
        finally:
            model.forward, layer.forward = original_forward, original_layer
            model.kernels = kernels
        assert good.metrics.finish_reason in ("stop", "length") and good_text is not None
        assert engine.stats.errors >= 1
        assert await victim.ask("and now?", short).text() is not None  # next steps succeed
        await victim.close()
        await bystander.close()
        await asyncio.sleep(0.1)
        assert engine.cache.pool.used_pages == 0
