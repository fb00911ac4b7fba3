"""KV parallelism: one sequence's KV sharded over 2 and 3 CPU ranks (gloo on loopback) gives
the logits of one process, through eviction; a rank that fails is an error, not a hang."""

from __future__ import annotations

import asyncio
import functools
import math
import signal
import sys

import pytest
import torch
from helpers import (
    ask_chat,
    free_port,
    random_model,
    start_serve,
    tiny_config,
    torchrun_launcher,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.kv_ranks import StreamScenario, run_ranks, run_single
from streamgrok.cache.config import CacheConfig
from streamgrok.cache.kv_group import KVGroup, KVParallelError
from streamgrok.cache.kv_parallel import KVParallelCache
from streamgrok.cache.shard_attention import merge_partials, shard_attention, shard_mass

CONFIG = tiny_config(max_positions=4096)
BUILD = functools.partial(random_model, CONFIG, 0)


def scenario(policy: str, budget: int | None, steps: list[list[int]], decode: int = 5,
             seed: int = 1) -> StreamScenario:
    generator = torch.Generator().manual_seed(seed)
    chunks = [[torch.randint(0, CONFIG.vocab_size, (n,), generator=generator) for n in step]
              for step in steps]
    cache = CacheConfig(policy=policy, budget_tokens=budget, evict_slack_tokens=16)
    return StreamScenario(chunks, decode, cache, num_pages=512)


# two sequences with chunks of uneven lengths (pages split mid-chunk between ranks)
STEPS = [[37, 20], [64, 33], [50, 64], [64, 17], [45, 64], [64, 64]]


def assert_same(results, base) -> None:
    for rank, result in enumerate(results):
        assert result.evicted_tokens == base.evicted_tokens, rank
        assert result.lengths == base.lengths, rank
        torch.testing.assert_close(result.logits, base.logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("world, policy", [(2, "h2o"), (3, "redundancy"), (2, "full")])
def test_sharded_stream_gives_the_logits_of_one_process(world, policy):
    plan = scenario(policy, None if policy == "full" else 96, STEPS)
    base = run_single(BUILD(), plan)
    if policy != "full":
        assert base.evicted_tokens > 300  # eviction really ran, many times
    results = run_ranks(world, BUILD, plan, timeout_s=60)
    assert len(results) == world
    assert_same(results, base)
    assert all(r.exchanged_bytes > 0 for r in results)


@pytest.mark.parametrize("embeddings", [False, True])
def test_frame_aware_snapkv_over_three_ranks_matches_one_process(embeddings):
    plan = scenario("snapkv", 80, [[48], [64], [40], [64], [64], [40], [64], [48]], decode=4,
                    seed=7)
    plan.cache_config = CacheConfig(policy="snapkv", budget_tokens=80, evict_slack_tokens=16,
                                    frame_aware=True, sink_tokens=2)
    plan.frames = True
    plan.frame_embeddings = embeddings  # repeated frames go first, the same on every rank
    base = run_single(BUILD(), plan)
    assert base.evicted_tokens > 0
    assert_same(run_ranks(3, BUILD, plan, timeout_s=60), base)


@pytest.mark.parametrize("failure", ["exit", "stall"])
def test_a_failing_rank_is_reported_not_a_hang(failure):
    plan = scenario("full", None, [[20]], decode=2)
    with pytest.raises(KVParallelError, match="rank 0"):
        run_ranks(2, BUILD, plan, timeout_s=5, fail_rank=1, failure=failure)


def test_out_of_pages_on_a_rank_fails_the_step_on_every_rank_without_a_hang():
    plan = scenario("full", None, [[40], [200]], decode=1)
    plan.num_pages = 12  # 2 layers: the first chunk fits on both ranks, the second does not
    with pytest.raises(KVParallelError, match=r"CacheFullError: KV cache out of pages on "
                                              r"rank\(s\) \[0, 1\] of 2"):
        run_ranks(2, BUILD, plan, timeout_s=30)


def test_one_rank_kv_parallel_cache_is_the_paged_cache():
    plan = scenario("h2o", 96, STEPS[:4], decode=3)
    base = run_single(BUILD(), plan)
    from benchmarks.kv_ranks import run_stream

    model = BUILD()
    cache = KVParallelCache(CONFIG, KVGroup(), plan.cache_config, num_pages=512,
                            kernels=model.kernels)
    result = run_stream(model, cache, plan)
    torch.testing.assert_close(result.logits, base.logits, rtol=1e-4, atol=1e-4)
    assert result.lengths == base.lengths


@settings(max_examples=30, deadline=None)
@given(keys=st.integers(1, 40), queries=st.integers(1, 6), shards=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_merged_shard_partials_equal_attention_over_all_keys(keys, queries, shards, seed):
    generator = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim = 4, 2, 8
    q = torch.randn(queries, heads, dim, generator=generator)
    k = torch.randn(keys, kv_heads, dim, generator=generator)
    v = torch.randn(keys, kv_heads, dim, generator=generator)
    key_pos = torch.arange(keys)
    query_pos = torch.arange(keys - queries, keys).clamp_min(0)
    owner = torch.randint(0, shards, (keys,), generator=generator)
    owner[-1] = 0  # the newest key (every query sees it) lives somewhere
    parts = []
    for shard in range(shards):
        mine = owner == shard
        parts.append(shard_attention(q, k[mine], v[mine], query_pos, key_pos[mine], True))
    out, lse = merge_partials(torch.stack([p.out for p in parts]),
                              torch.stack([p.lse for p in parts]))
    whole = shard_attention(q, k, v, query_pos, key_pos, True)
    torch.testing.assert_close(out, whole.out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, whole.lse, rtol=1e-5, atol=1e-5)
    mass = torch.zeros(keys)
    for shard, part in enumerate(parts):
        mass[owner == shard] = shard_mass(part.scores, lse, queries)
    torch.testing.assert_close(mass, shard_mass(whole.scores, whole.lse, queries))
    assert math.isclose(float(mass.sum()), queries * heads, rel_tol=1e-4)


def test_engine_on_two_ranks_answers_like_one_process(tiny_loaded):
    import multiprocessing as mp

    import kvp_workers

    alone = asyncio.run(kvp_workers.answers(tiny_loaded, None))
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    procs = [context.Process(target=kvp_workers.engine_rank, daemon=True,
                             args=(rank, 2, port, str(tiny_loaded.source), results))
             for rank in range(2)]
    for proc in procs:
        proc.start()
    got = dict(results.get(timeout=180) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
    assert got[1] == "followed until stopped"
    assert got[0] == alone
    assert all(answer for answer in alone)


def test_serve_kv_parallel_without_torchrun_says_how_to_start_it(capsys, monkeypatch):
    from streamgrok.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["serve", "--kv-parallel", "2", "--port", "0"]) != 0
    assert "torchrun --nproc-per-node 2 -m streamgrok serve --kv-parallel 2" in \
        capsys.readouterr().err


def test_serve_kv_parallel_under_torchrun_answers_like_one_process(tiny_loaded):
    model = str(tiny_loaded.source)
    sharded, port = start_serve(torchrun_launcher(2), model, "--kv-parallel", "2")
    single, single_port = start_serve([sys.executable], model)
    try:
        assert ask_chat(port) == ask_chat(single_port)
    finally:
        sharded.send_signal(signal.SIGTERM)
        single.send_signal(signal.SIGTERM)
        output = sharded.communicate(timeout=60)[0]
        single.wait(timeout=60)
    assert "rank 1 exits" in output  # rank 0 drained, then stopped its follower
