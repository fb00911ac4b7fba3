"""The host tier and recall: evicted pages kept off the working set and brought back."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import tiny_config

from streamgrok.cache.config import CacheConfig
from streamgrok.cache.paged_cache import PagedKVCache
from streamgrok.cache.tiers.host_tier import _summaries
from streamgrok.cache.tiers.page_scorer import layer_page_scores
from streamgrok.cache.tiers.recall import choose_pages, page_gains, score_pages
from streamgrok.cache.tokens import STREAM
from streamgrok.model.batch import BatchMetadata
from streamgrok_kernels.ops import KernelOps
from streamgrok_kernels.paged_read import COMPILED_MIN_TOKENS
from streamgrok_kernels.rotary import apply_rotary

CFG = tiny_config(max_positions=4096)


def tiered(budget: int = 32, host_gib: float = 0.01, backend: str = "torch",
           **extra) -> PagedKVCache:
    config = CacheConfig(policy="h2o", budget_tokens=budget, sink_tokens=2,
                         evict_slack_tokens=16, host_tier_gib=host_gib, **extra)
    return PagedKVCache(CFG, config, num_pages=256, kernels=KernelOps(backend))


def full_cache(backend: str = "torch") -> PagedKVCache:
    return PagedKVCache(CFG, CacheConfig(policy="full", budget_tokens=None), num_pages=256,
                        kernels=KernelOps(backend))


def append(cache: PagedKVCache, seq: int, n: int, seed: int) -> list[torch.Tensor]:
    """n tokens of random q/K/V into every layer (no model); returns each layer's output."""
    gen = torch.Generator().manual_seed(seed)
    batch = BatchMetadata.build([seq], [n])
    cache.attention.prepare(batch)
    outs = []
    for layer in range(CFG.num_layers):
        q = torch.randn(n, CFG.num_heads, CFG.head_dim, generator=gen)
        k = torch.randn(n, CFG.num_kv_heads, CFG.head_dim, generator=gen)
        v = torch.randn(n, CFG.num_kv_heads, CFG.head_dim, generator=gen)
        outs.append(cache.attention.attend(layer, q, k, v, batch))
    return outs


def stream(cache: PagedKVCache, chunks: int = 5, size: int = 24) -> None:
    cache.add_sequence(0)
    for i in range(chunks):
        append(cache, 0, size, seed=i)
        cache.evict([0])


def ask(cache: PagedKVCache, prompt: int = 6, room: int = 0):
    """Fork the stream and prefill a question that recalls as it goes (the engine's way)."""
    cache.fork(0, 1)
    cache.recall_next_pass(1, room=room)
    append(cache, 1, prompt, seed=100)
    return cache.take_recall(1)


def test_explicit_recall_of_everything_then_attends_exactly_as_the_full_cache():
    """Queries captured in one pass, recall after it: the next token sees the full cache."""
    tier, full = tiered(recall_tokens=10_000), full_cache()
    stream(tier)
    stream(full)
    assert tier.stats.evicted_tokens > 0
    for cache in (tier, full):
        cache.fork(0, 1)
        cache.capture_queries(1)
        append(cache, 1, 6, seed=100)
    result = tier.recall(1)
    assert result.tokens == tier.stats.evicted_tokens
    for rec in tier.sequences[1].layers:  # every token back, in stream order
        assert torch.equal(rec.column(STREAM), torch.arange(5 * 24 + 6, dtype=torch.float64))
    got = append(tier, 1, 1, seed=101)
    want = append(full, 1, 1, seed=101)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # the session's own working set is undisturbed, and the fork may keep what it recalled
    assert max(tier.layer_lengths(0)) <= 32 + 16
    tier.evict([1])
    assert tier.layer_lengths(1) == full.layer_lengths(1)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_in_pass_recall_of_everything_attends_exactly_as_the_full_cache(backend):
    """The engine's way: at each layer, before the question attends, its own queries recall;
    with everything recalled the question's attention is the full cache's, layer by layer."""
    tier, full = tiered(recall_tokens=10_000, backend=backend), full_cache(backend)
    stream(tier)
    stream(full)
    tier.fork(0, 1)
    full.fork(0, 1)
    tier.recall_next_pass(1)
    got, want = append(tier, 1, 6, seed=100), append(full, 1, 6, seed=100)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    result = tier.take_recall(1)
    assert result.tokens == tier.stats.evicted_tokens and result.hit_rate == 1.0
    assert tier.take_recall(1) is None
    for rec in tier.sequences[1].layers:
        assert rec.column(STREAM).tolist() == list(range(5 * 24 + 6))
    got, want = append(tier, 1, 1, seed=101), append(full, 1, 1, seed=101)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    tier.remove_sequence(1)
    tier.remove_sequence(0)
    assert tier.pool.used_pages == 0 and tier.tier.used_pages == 0


def test_recalled_tokens_carry_their_own_keys_and_values():
    tier, full = tiered(recall_tokens=48, recall_min_hit_rate=0.0), full_cache()
    stream(tier)
    stream(full)
    result = ask(tier)
    ask(full)
    assert 0 < result.tokens <= 48 * CFG.num_layers
    for layer in range(CFG.num_layers):
        rec = tier.sequences[1].layers[layer]
        streams = rec.column(STREAM)
        assert torch.all(streams[1:] > streams[:-1])  # stream order, no duplicates
        k, v = tier.pool.read(rec.slots())
        k_full, v_full = full.pool.read(full.sequences[1].layers[layer].slots()[streams.long()])
        torch.testing.assert_close(k, k_full)
        torch.testing.assert_close(v, v_full)


def brute_force_choice(cache: PagedKVCache, queries, rec, tier_layer, budget: int):
    """The recall rule written out page by page, head by head, with explicit rotations."""
    q, positions = queries
    scale = 1 / math.sqrt(CFG.head_dim)
    cos, sin = cache.rotary.tables(8192)
    keys, _ = cache.pool.read(rec.slots())
    n = rec.length
    group = CFG.num_heads // CFG.num_kv_heads
    resident_stream = rec.column(STREAM).tolist()
    scores = []
    for p in range(tier_layer.num_pages):
        first = float(tier_layer.meta[p, 0, STREAM])
        at = sum(1 for s in resident_stream if s < first)
        best = -math.inf
        for r in range(q.shape[0]):
            pos = int(positions[r])
            qr = apply_rotary(q[r : r + 1], cos[pos : pos + 1], sin[pos : pos + 1])[0]
            for h in range(CFG.num_heads):
                kvh = h // group
                logits = []
                for j in range(min(n, pos + 1)):
                    kj = apply_rotary(keys[j : j + 1], cos[j : j + 1], sin[j : j + 1])[0, kvh]
                    logits.append(float(qr[h] @ kj) * scale)
                lse = torch.logsumexp(torch.tensor(logits), 0).item()
                center = apply_rotary(tier_layer.centers[p : p + 1], cos[at : at + 1],
                                      sin[at : at + 1])[0, kvh]
                bound = (float(qr[h] @ center)
                         + float(qr[h].norm()) * float(tier_layer.radii[p, kvh])) * scale
                best = max(best, bound - lse)
        scores.append(best)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    chosen, tokens = [], 0
    for i in order:
        tokens += int(tier_layer.counts[i])
        if tokens > budget:
            break
        chosen.append(i)
    return chosen


def test_recall_picks_the_pages_a_brute_force_scorer_picks():
    cache = tiered(recall_tokens=40, recall_min_hit_rate=0.0)
    stream(cache, chunks=5)
    cache.fork(0, 1)
    cache.capture_queries(1)
    append(cache, 1, 3, seed=100)
    capture = cache.captured_queries(1)
    expected = []
    for layer in range(CFG.num_layers):
        rec = cache.sequences[1].layers[layer]
        tier_layer = cache.tier.layer(0, layer)
        assert tier_layer.num_pages >= 3
        expected.append(brute_force_choice(cache, capture.layers[layer], rec, tier_layer, 40))
        choice = cache.recaller.choose(rec, rec.length, tier_layer, capture.layers[layer], 40,
                                       10_000, 0.0)
        assert choice.index.tolist() == expected[-1]
    result = cache.recall(1)
    assert result.layer_tokens == [
        sum(int(cache.tier.layer(0, layer).counts[i]) for i in chosen)
        for layer, chosen in enumerate(expected)]


def test_the_guard_recalls_more_only_below_its_threshold():
    counts = torch.tensor([16, 16, 16, 16])
    score = torch.tensor([3.0, 2.0, 1.0, 0.0])
    # relative masses: the first page carries little, the rest much
    mass = torch.tensor([[0.01, 0.5, 0.5, 0.5]])
    calm = choose_pages(score, *page_gains(mass), counts, budget_tokens=16, cap_tokens=1000,
                        min_hit_rate=0.3)
    assert calm.index.tolist() == [0] and not calm.guard
    strict = choose_pages(score, *page_gains(mass), counts, budget_tokens=16, cap_tokens=1000,
                          min_hit_rate=0.95)
    assert strict.index.tolist() == [0, 1, 2, 3] and strict.guard
    assert strict.hit_rate == pytest.approx(1.0)
    capped = choose_pages(score, *page_gains(mass), counts, budget_tokens=16, cap_tokens=40,
                          min_hit_rate=0.95)
    assert capped.index.tolist() == [0, 1] and capped.guard and capped.limited
    assert capped.hit_rate < 0.95


def test_guard_in_the_cache_brings_back_the_whole_history_when_asked_to():
    strict = tiered(recall_tokens=16, recall_min_hit_rate=1.0)
    stream(strict)
    result = ask(strict)
    assert result.guard
    assert result.tokens == strict.stats.evicted_tokens
    calm = tiered(recall_tokens=16, recall_min_hit_rate=0.0)
    stream(calm)
    result = ask(calm)
    assert not result.guard
    assert all(0 < n <= 16 for n in result.layer_tokens)


def test_recall_stays_within_the_trained_context():
    cache = tiered(recall_tokens=10_000, recall_min_hit_rate=1.0)
    stream(cache)
    room = CFG.max_positions - 100
    result = ask(cache, room=room)
    assert result.tokens > 0 and result.limited
    assert max(cache.layer_lengths(1)) <= CFG.max_positions - room


def test_tier_budget_holds_and_what_leaves_is_counted():
    cache = tiered(host_gib=40 * 2 * 16 * CFG.num_kv_heads * CFG.head_dim * 4 / 2**30)
    assert cache.tier.capacity_pages == 40
    stream(cache, chunks=30)
    tier = cache.tier
    assert tier.used_pages <= 40
    resident = sum(cache.layer_lengths(0))
    assert tier.stats.dropped_tokens > 0
    assert tier.stats.stored_tokens == cache.stats.evicted_tokens
    assert resident + tier.tokens + tier.stats.dropped_tokens == 30 * 24 * CFG.num_layers
    # what left was the oldest: the tier holds the most recent evicted tokens
    valid = [torch.arange(16)[None, :] < layer.counts[:, None] for layer in tier.sequences[0]]
    kept = torch.cat([layer.meta[mask][:, STREAM]
                      for layer, mask in zip(tier.sequences[0], valid)])
    assert kept.min() > 300


def test_int8_host_tier_recalls_close_values():
    cache = tiered(recall_tokens=10_000, host_tier_dtype="int8")
    full = full_cache()
    stream(cache)
    stream(full)
    assert cache.tier.page_bytes < tiered().tier.page_bytes / 3
    ask(cache)
    ask(full)
    got = append(cache, 1, 1, seed=101)
    want = append(full, 1, 1, seed=101)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0.05, rtol=0.05)


def test_closing_sessions_frees_every_tier():
    cache = tiered()
    stream(cache)
    ask(cache)
    assert cache.tier.used_pages > 0
    cache.remove_sequence(1)
    assert cache.tier.used_pages > 0  # the fork reads the session's tier; it owns none
    cache.remove_sequence(0)
    assert cache.tier.used_pages == 0 and not cache.tier.sequences
    assert cache.pool.used_pages == 0


def test_recall_without_a_tier_or_captured_queries_does_nothing():
    cache = full_cache()
    stream(cache)
    cache.fork(0, 1)
    assert cache.recall(1).tokens == 0
    tier = tiered()
    stream(tier)
    tier.fork(0, 1)
    lengths = tier.layer_lengths(1)
    assert tier.recall(1).tokens == 0
    assert tier.layer_lengths(1) == lengths


class RecordingScorer:
    """Recall's scorer as if it compiled (the suite runs it eagerly), recording each call's
    number of query rows."""

    compiled = True

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, q, *args):
        self.calls.append(q.shape[0])
        return layer_page_scores(q, *args)


def test_streaming_rehearses_a_questions_scoring_and_long_read_once(monkeypatch):
    """So that their compilations run mid-stream, not with the first question that recalls;
    the stream and the question's recall are as they would be without it."""
    cache, reference = tiered(), tiered()
    scorer = cache.recaller.scorer = RecordingScorer()
    reads: list[tuple[int, ...]] = []
    read = cache.kernels.paged_reader.read
    monkeypatch.setattr(cache.kernels.paged_reader, "read",
                        lambda kv, slots, *rest: reads.append(tuple(slots.shape))
                        or read(kv, slots, *rest))
    stream(cache)
    stream(reference)
    assert len(scorer.calls) == 1 and scorer.calls[0] > 1  # a question's kind: several rows
    assert (1, COMPILED_MIN_TOKENS) in reads
    assert cache.layer_lengths(0) == reference.layer_lengths(0)
    assert cache.tier.used_pages == reference.tier.used_pages
    want, got = append(reference, 0, 5, seed=50), append(cache, 0, 5, seed=50)
    for a, b in zip(want, got):
        torch.testing.assert_close(a, b)
    recalled, expected = ask(cache), ask(reference)
    assert recalled.layer_tokens == expected.layer_tokens
    assert len(scorer.calls) == 1 + CFG.num_layers  # the question's own, no second rehearsal


def test_the_rehearsal_comes_with_the_streams_second_chunk_before_any_eviction():
    cache = tiered()
    scorer = cache.recaller.scorer = RecordingScorer()
    cache.add_sequence(0)
    append(cache, 0, 24, seed=0)
    assert not scorer.calls  # nothing resident to score against yet
    append(cache, 0, 24, seed=1)
    assert len(scorer.calls) == 1 and cache.tier.used_pages == 0


def test_no_rehearsal_without_a_compiling_scorer_or_a_tier():
    cache = tiered()  # the suite's scorer runs eagerly (STREAMGROK_COMPILED_READS=0)
    stream(cache)
    assert not cache.recaller.rehearsal_due
    full = full_cache()
    full.recaller.scorer = RecordingScorer()
    stream(full)
    assert not full.recaller.scorer.calls and not full.recaller.rehearsal_due


def test_config_rejects_a_tier_without_eviction():
    with pytest.raises(ValueError, match="evicts none"):
        CacheConfig(policy="full", budget_tokens=None, host_tier_gib=1.0)
    with pytest.raises(ValueError, match="host_tier_dtype"):
        CacheConfig(host_tier_gib=1.0, host_tier_dtype="int4")


async def test_engine_answers_recall_from_the_host_tier_and_report_it(tiny_loaded):
    from streamgrok.engine import Engine, EngineConfig
    from streamgrok.model.sampling import SamplingParams

    cache = CacheConfig(policy="h2o", budget_tokens=128, evict_slack_tokens=16, memory_gib=0.02,
                        host_tier_gib=0.01, recall_tokens=32, recall_min_hit_rate=0.0)
    async with Engine(tiny_loaded, cache, EngineConfig(merge_window_s=0)) as engine:
        session = engine.new_session("sys")
        await session.append_message("note " * 120)
        answer = session.ask("what was noted?", SamplingParams(max_tokens=6))
        assert await answer.text()
        metrics = answer.metrics.as_dict()
        assert 0 < metrics["recalled_tokens"] <= 32 * tiny_loaded.config.num_layers
        assert 0.0 < metrics["kv_hit_rate"] <= 1.0
        assert metrics["recall_guard"] is False
        tier = engine.snapshot().host_tier
        assert tier["recalls"] == 1 and tier["tokens"] > 0
        assert tier["recalled_tokens"] == metrics["recalled_tokens"]
        assert tier["kv_hit_rate_mean"] == pytest.approx(metrics["kv_hit_rate"], abs=1e-4)
        second = session.ask("and now?", SamplingParams(max_tokens=4))
        await second.text()  # the remembered first turn and the second both work
        assert engine.snapshot().host_tier["recalls"] == 2
        await session.close()
        assert engine.cache.tier.used_pages == 0 and engine.cache.pool.used_pages == 0


async def test_server_reports_recall_in_answers_stats_and_metrics(tiny_loaded):
    import asyncio
    import json
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    from websockets.asyncio.client import connect

    from streamgrok.server.app import ServerConfig, StreamgrokServer

    config = ServerConfig("pipelines/live_qa.py", port=0,
                          pipeline_options={"transcribe": "false"}, stats_interval_s=0.2,
                          load_tick_s=None)
    server = StreamgrokServer(tiny_loaded, config, CacheConfig(
        budget_tokens=512, memory_gib=0.05, host_tier_gib=0.01))
    await server.start()
    try:
        async with connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            await ws.send(json.dumps({"type": "session.start", "id": "s1"}))
            await ws.send(json.dumps({"type": "query", "id": "q", "text": "what is there?"}))
            done = stats = started = None
            while done is None or stats is None:
                message = json.loads(await asyncio.wait_for(ws.recv(), 30))
                if message["type"] == "session.started":
                    started = message
                elif message["type"] == "response.done":
                    done = message
                elif message["type"] == "stats" and done is not None:
                    stats = message
        assert started["answers"] == "stream"  # a host tier recalls the stream for answers
        assert done["kv_hit_rate"] == 1.0 and done["recalled_tokens"] == 0  # nothing evicted
        assert stats["host_tier"]["recalls"] == 1
        assert stats["host_tier"]["bytes_capacity"] > 0

        def fetch() -> str:
            url = f"http://127.0.0.1:{server.port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as response:
                return response.read().decode()

        text = await asyncio.to_thread(fetch)
        names = {f.name for f in text_string_to_metric_families(text)}
        assert {"streamgrok_kv_host_bytes", "streamgrok_kv_recalls", "streamgrok_kv_hit_rate",
                "streamgrok_kv_host_dropped_tokens", "streamgrok_kv_guard_recalls"} <= names
        assert "streamgrok_kv_recalls_total 1.0" in text
    finally:
        await server.stop()


def test_disk_tier_holds_what_leaves_host_memory_and_recall_reads_it_back(tmp_path):
    page = 2 * 16 * CFG.num_kv_heads * CFG.head_dim * 4 / 2**30
    tier = tiered(host_gib=4 * page, recall_tokens=10_000, disk_tier_gib=200 * page,
                  disk_tier_dir=str(tmp_path))
    full = full_cache()
    stream(tier)
    stream(full)
    assert list(tmp_path.iterdir()) == []  # mapped, then unlinked at once
    stats = tier.tier.stats
    assert tier.tier.host.used_pages <= 4 and tier.tier.disk.used_pages > 0
    assert stats.spilled_tokens > 0 and stats.dropped_tokens == 0
    result = ask(tier)
    ask(full)
    assert result.tokens == tier.stats.evicted_tokens  # host and disk pages both came back
    got, want = append(tier, 1, 1, seed=101), append(full, 1, 1, seed=101)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    tier.remove_sequence(1)
    tier.remove_sequence(0)
    assert tier.tier.host.used_pages == 0 and tier.tier.disk.used_pages == 0


def test_disk_tier_budget_holds_and_drops_the_oldest_for_good(tmp_path):
    page = 2 * 16 * CFG.num_kv_heads * CFG.head_dim * 4 / 2**30
    cache = tiered(host_gib=4 * page, disk_tier_gib=12 * page, disk_tier_dir=str(tmp_path))
    stream(cache, chunks=30)
    tier = cache.tier
    assert tier.host.used_pages <= 4 and tier.disk.used_pages <= 12
    assert tier.stats.dropped_tokens > 0
    resident = sum(cache.layer_lengths(0))
    assert resident + tier.tokens + tier.stats.dropped_tokens == 30 * 24 * CFG.num_layers
    with pytest.raises(ValueError, match="host_tier_gib too"):
        CacheConfig(disk_tier_gib=1.0)


def test_bench_measures_an_exact_hit_rate_of_one_when_everything_comes_back(tiny_loaded):
    """The benchmark's own instruments on a tiny model: the full cache's attention, the
    evicting answer's resident tokens, KL and top-1 (nothing here is timed)."""
    from benchmarks.caches import bench_cache
    from benchmarks.recall import (
        exact_hit_rate,
        forced_answer,
        full_answer,
        kl_top1,
        question_times,
    )
    from streamgrok.cache.streaming import feed

    model, tok = tiny_loaded.model, tiny_loaded.tokenizer
    ids = tok.encode("the quick brown fox jumps over the lazy dog. " * 8)[:320]
    question = tok.encode(" what jumps?")
    full = bench_cache(tiny_loaded, "full", None, memory_gib=0.05)
    full.add_sequence(0)
    feed(model, full, 0, ids, chunk=64)
    answer, logits, probs = full_answer(model, full, 1, question, 6)
    assert len(answer) == 6 and logits.shape[0] == 6
    assert kl_top1(logits, logits) == (0.0, 1.0)
    first_answer = len(ids) + len(question)
    results = {}
    for mode, threshold in (("off", 0.95), ("guard", 1.0)):
        cache = bench_cache(tiny_loaded, "h2o", 64, host_tier_gib=0.01, memory_gib=0.05,
                             evict_slack_tokens=16, recall_min_hit_rate=threshold)
        cache.add_sequence(0)
        feed(model, cache, 0, ids, chunk=64)
        got = forced_answer(model, cache, 3, question, answer, mode)
        results[mode] = exact_hit_rate(probs, got.resident, first_answer), got
    assert results["off"][0] < 0.99
    assert results["guard"][0] == pytest.approx(1.0)
    assert results["guard"][1].estimated_hit == pytest.approx(1.0)
    assert results["guard"][1].recalled > 0
    # the timing: each kind of pass in turns on fresh forks, none left behind
    times = question_times(model, {"full": (full, "off"), "guard": (cache, "guard")}, question,
                           len(answer) + 1, rounds=2)
    assert times["full"][0] > 0 and times["full"][1] == 0.0
    assert times["guard"][0] >= times["guard"][1] > 0
    assert set(full.sequences) == {0} and set(cache.sequences) == {0}


def test_bench_long_stream_prints_each_row_as_it_is_measured(tiny_loaded, capsys):
    """The long stream's rows appear as they are taken (a stopped run still shows them),
    and its working set stays inside the budget while the host tier fills and drops."""
    from benchmarks.recall import RecallBenchOptions, long_stream

    options = RecallBenchOptions(flat_tokens=1600, flat_questions=4, budget=128, chunk=64)
    result = long_stream(tiny_loaded, options)
    printed = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in printed
            if len(line.split()) == 7 and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [400, 800, 1200, 1600]
    assert [r[0] for r in result["rows"]] == [400, 800, 1200, 1600]
    assert abs(result["drift"]["pages"]) <= 0.05
    assert "flat = within 5%" in printed[-1]


def test_the_guard_takes_pages_beyond_the_budget_by_what_they_add_to_the_hit_rate():
    counts = torch.tensor([16, 16, 16, 16])
    score = torch.tensor([3.0, 2.0, 1.0, 0.0])  # the budget's page: the best bound
    mass = torch.tensor([[0.01, 0.1, 0.8, 0.3]])  # then the guard goes by mass: 2, 3, 1
    budget_only = choose_pages(score, *page_gains(mass), counts, budget_tokens=16, cap_tokens=1000,
                               min_hit_rate=0.0)
    assert budget_only.index.tolist() == [0]
    some = choose_pages(score, *page_gains(mass), counts, budget_tokens=16, cap_tokens=1000,
                        min_hit_rate=0.9)
    assert some.index.tolist() == [0, 2, 3] and some.guard
    assert some.hit_rate == pytest.approx((1 + 0.01 + 0.8 + 0.3) / (1 + 1.21))


def _page_mass(keys: torch.Tensor, q: torch.Tensor) -> tuple[float, float]:
    """(estimated, exact) attention mass of one page of keys [n, 1, D] for a query [1, 1, D]
    at the same position (no rotation), relative to a resident log-sum-exp of 0."""
    counts = torch.tensor([keys.shape[0]])
    centers, radii, plane_vars = _summaries(keys, counts, keys.shape[0])
    scale = 1 / math.sqrt(keys.shape[-1])
    _, mass = score_pages(q, torch.zeros(1, 1, 1), centers, radii, plane_vars, counts, scale)
    exact = torch.exp((keys[:, 0] @ q[0, 0]) * scale).sum()
    return float(mass.sum()), float(exact)


def test_a_pages_estimated_mass_follows_its_keys_spread():
    gen = torch.Generator().manual_seed(0)
    dim = 64
    q = torch.randn(1, 1, dim, generator=gen)
    center = torch.randn(dim, generator=gen)
    for spread in (0.01, 0.1, 0.3):
        keys = (center + spread * torch.randn(16, dim, generator=gen))[:, None]
        estimated, exact = _page_mass(keys, q)
        assert estimated == pytest.approx(exact, rel=0.1), spread
    # a wide spread: 16 keys cannot fill exp(variance / 2); the estimate stays far under it
    # and under the ball's bound, and on the safe side of what the keys give (a page's mass
    # overestimated makes the guard recall more, never less)
    keys = (center + 10.0 * torch.randn(16, dim, generator=gen))[:, None]
    estimated, exact = _page_mass(keys, q)
    deviation = keys[:, 0] - keys[:, 0].mean(0)
    scale = 1 / math.sqrt(dim)
    logits = (keys[:, 0] @ q[0, 0]) * scale
    center_logit = float(keys[:, 0].mean(0) @ q[0, 0]) * scale
    lognormal = 16 * math.exp(center_logit + float(logits.var(correction=0)) / 2)
    ball = 16 * math.exp(center_logit + float(q.norm() * deviation.norm(dim=-1).max()) * scale)
    assert estimated < lognormal / 1e6 and estimated <= ball
    assert estimated > exact


def test_page_summaries_keep_the_key_variance_of_each_rotary_plane():
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(20, 2, 8, generator=gen)
    counts = torch.tensor([16, 4])
    centers, radii, plane_vars = _summaries(keys, counts, 16)
    for page, (lo, hi) in enumerate(((0, 16), (16, 20))):
        part = keys[lo:hi]
        torch.testing.assert_close(centers[page], part.mean(0))
        deviation = (part - part.mean(0)) ** 2
        torch.testing.assert_close(plane_vars[page],
                                   (deviation[..., :4] + deviation[..., 4:]).mean(0) / 2)
        torch.testing.assert_close(radii[page], (part - part.mean(0)).norm(dim=-1).amax(0))
    # one rotation of the planes (a page coming back at another position) keeps them
    angles = torch.rand(1, 4, generator=gen) * 6.28
    turned = apply_rotary(keys, angles.cos().expand(20, -1), angles.sin().expand(20, -1))
    _, _, turned_vars = _summaries(turned, counts, 16)
    torch.testing.assert_close(turned_vars, plane_vars)


def test_a_dropped_cache_is_freed_at_once_not_by_the_collector():
    """Nothing the cache owns refers back to it: a benchmark that builds many caches in a loop
    grew by its page pool each time until the garbage collector happened to run."""
    import gc
    import weakref

    cache = tiered()
    stream(cache)
    ask(cache)
    ref = weakref.ref(cache)
    gc.disable()
    try:
        del cache
        assert ref() is None
    finally:
        gc.enable()
