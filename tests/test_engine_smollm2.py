"""The engine on the real SmolLM2: concurrent sessions answer exactly as they do alone."""

from __future__ import annotations

import asyncio

import pytest

from streamgrok.cache.config import CacheConfig
from streamgrok.engine import Engine, EngineConfig
from streamgrok.model.sampling import SamplingParams

pytestmark = pytest.mark.integration

SYSTEM = "You are a helpful assistant watching a live video stream."
CASES = [
    ("[00:05] A red car parks in front of the bakery.", "What colour is the car?"),
    ("[00:07] Two people walk a dog across the street.", "How many people are there?"),
    ("[00:10] It starts to rain; umbrellas open.", "What is the weather like?"),
    ("[00:12] A cyclist in a yellow jacket rides past.", "What is the cyclist wearing?"),
    ("[00:15] The bakery owner puts bread in the window.", "What is in the window?"),
    ("[00:18] A bus stops and three children get off.", "Who got off the bus?"),
    ("[00:20] A cat sleeps on a blue bench.", "Where is the cat?"),
    ("[00:25] Street lights turn on as it gets dark.", "What happened to the lights?"),
]
GREEDY = SamplingParams(max_tokens=16)


async def run(engine: Engine, note: str, question: str) -> str:
    session = engine.new_session(SYSTEM)
    await session.append_message(note)
    text = await session.ask(question, GREEDY).text()
    await session.close()
    return text


async def test_eight_concurrent_sessions_equal_alone(smollm2):
    cache = CacheConfig(policy="h2o", budget_tokens=1024, memory_gib=0.5)
    async with Engine(smollm2, cache, EngineConfig(merge_window_s=0.01)) as engine:
        alone = [await run(engine, note, q) for note, q in CASES]
        resident = engine.new_session(SYSTEM)  # prefills and publishes the system prompt
        await resident.ask("Ready?", SamplingParams(max_tokens=2)).text()
        together = await asyncio.gather(*(run(engine, note, q) for note, q in CASES))
        assert max(r.sequences for r in engine.stats.recent) >= 8
        assert engine.cache.stats.prefix_hit_tokens >= 8 * 16  # the system prompt was shared
        await resident.close()
    assert together == alone
    assert "red" in alone[0].lower()  # the answer used the appended observation
