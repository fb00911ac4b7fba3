"""No ceiling on a stream's length: positions are cache-relative, so a session streams past
2^20 tokens in a fixed budget and still answers."""

from __future__ import annotations

import torch

from streamgrok.cache.config import CacheConfig
from streamgrok.cache.tokens import STREAM
from streamgrok.engine import Engine, EngineConfig
from streamgrok.model.sampling import SamplingParams
from streamgrok.stream_tokens import TokenInfo

TOTAL = 2**20 + 4096  # past 2^20 positions
CHUNK = 1024


async def test_a_session_streams_past_two_to_the_twenty_tokens_at_flat_memory(tiny_loaded):
    cache = CacheConfig(policy="h2o", budget_tokens=96, memory_gib=0.01)
    config = EngineConfig(merge_window_s=0, step_tokens=CHUNK, max_append_tokens=CHUNK)
    vocab = tiny_loaded.config.vocab_size
    async with Engine(tiny_loaded, cache, config) as engine:
        session = engine.new_session("sys")
        generator = torch.Generator().manual_seed(0)
        peak_pages = 0
        for _ in range(0, TOTAL, CHUNK):
            ids = torch.randint(3, vocab, (CHUNK,), generator=generator)
            await session.append_tokens(ids, TokenInfo.text(CHUNK))
            peak_pages = max(peak_pages, engine.snapshot().kv_pages_used)
        answer = await session.ask("go?", SamplingParams(max_tokens=8)).text()
        assert answer  # it answers at the end of the stream
        snapshot = engine.snapshot()
        assert snapshot.prefill_tokens >= TOTAL
        seq = engine.cache.sequences[session._state.seq_id]
        assert seq.stream_pos >= TOTAL  # every token went through the stream
        assert seq.layers[0].column(STREAM).max().item() >= TOTAL - 1
        budget_pages = (96 + engine.cache.config.slack + CHUNK) // 16 + 2
        # flat: what one budget and one chunk need, per layer, however long the stream
        assert peak_pages <= budget_pages * tiny_loaded.config.num_layers * 2
        await session.close()
