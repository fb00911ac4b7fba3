"""Process entry points for the KV-parallel engine test (spawned, so importable by name)."""

from __future__ import annotations

import asyncio
import os

from streamgrok.cache.config import CacheConfig
from streamgrok.cache.kv_group import KVGroup
from streamgrok.engine import Engine, EngineConfig
from streamgrok.engine.kv_leader import follow
from streamgrok.loading.loader import load_model
from streamgrok.model.sampling import SamplingParams

CACHE = CacheConfig(policy="h2o", budget_tokens=96, memory_gib=0.01)
WORK = [([f"note {i} " * (8 * i + 10), "and more text " * 6], f"question {i}?")
        for i in range(3)]


async def answers(loaded, group: KVGroup | None) -> list[str]:
    """Three sessions with notes past the budget, asked concurrently, greedy."""
    config = EngineConfig(merge_window_s=0.01)
    async with Engine(loaded, CACHE, config, kv_group=group) as engine:
        sessions = [engine.new_session("sys") for _ in WORK]
        for session, (notes, _) in zip(sessions, WORK):
            for note in notes:
                await session.append_message(note)
        asked = [s.ask(q, SamplingParams(max_tokens=10)) for s, (_, q) in zip(sessions, WORK)]
        return list(await asyncio.gather(*(a.text() for a in asked)))


def engine_rank(rank: int, world: int, port: int, model_path: str, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    try:
        group = KVGroup.from_env(timeout_s=60, backend="gloo")
        loaded = load_model(model_path)
        if rank == 0:
            results.put((rank, asyncio.run(answers(loaded, group))))
        else:
            follow(loaded, CACHE, group)
            results.put((rank, "followed until stopped"))
        group.close()
    except Exception as exc:
        results.put((rank, f"{type(exc).__name__}: {exc}"))
