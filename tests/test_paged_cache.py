"""The paged streaming KV cache: allocator invariants, equivalences, eviction rules."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import random_model, tiny_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamgrok.cache.config import CacheConfig, pyramid_budgets
from streamgrok.cache.paged_cache import PagedKVCache
from streamgrok.cache.tokens import PROTECTED, SOURCE, STREAM
from streamgrok.errors import CacheFullError
from streamgrok.model.batch import BatchMetadata
from streamgrok.model.contiguous_cache import ContiguousKVCache
from streamgrok.stream_tokens import Modality, TokenInfo
from streamgrok_kernels.paged_prefill_attention import dense_chunk_attention

CFG = tiny_config()


def append_random(cache: PagedKVCache, seq: int, n: int, info: TokenInfo | None = None,
                  seed: int = 0) -> torch.Tensor:
    """Append n tokens of random K/V to every layer (no model); returns layer-0 output."""
    gen = torch.Generator().manual_seed(seed)
    batch = BatchMetadata.build([seq], [n])
    batch.token_info = info
    cache.attention.prepare(batch)
    out = None
    for layer in range(CFG.num_layers):
        q = torch.randn(n, CFG.num_heads, CFG.head_dim, generator=gen)
        k = torch.randn(n, CFG.num_kv_heads, CFG.head_dim, generator=gen)
        v = torch.randn(n, CFG.num_kv_heads, CFG.head_dim, generator=gen)
        result = cache.attention.attend(layer, q, k, v, batch)
        out = result if out is None else out
    return out


def check_pool(cache: PagedKVCache) -> None:
    """Every allocated page is referenced exactly refcount times; free ones never."""
    owners = [0] * cache.pool.num_pages
    for seq in cache.sequences.values():
        for layer in seq.layers:
            assert len(layer.pages) == math.ceil(layer.length / cache.config.page_size)
            for page in layer.pages:
                owners[page] += 1
    assert owners == cache.pool.refcount
    assert cache.pool.free_pages == sum(1 for c in owners if c == 0)


ops = st.lists(
    st.tuples(st.sampled_from(["append", "evict", "remove", "add"]),
              st.integers(0, 3), st.integers(1, 40)),
    min_size=1, max_size=25,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, policy=st.sampled_from(["sink_window", "h2o", "redundancy", "pyramid"]),
       frame_aware=st.booleans())
def test_allocator_invariants(ops, policy, frame_aware):
    config = CacheConfig(policy=policy, budget_tokens=24, sink_tokens=2, frame_aware=frame_aware)
    cache = PagedKVCache(CFG, config, num_pages=64)
    live: set[int] = set()
    for step, (op, seq, n) in enumerate(ops):
        if op == "add" and seq not in live:
            cache.add_sequence(seq)
            live.add(seq)
        elif op == "append" and seq in live:
            info = TokenInfo.uniform(n, Modality.FRAME, step, step // 2, False)
            try:
                append_random(cache, seq, n, info, seed=step)
            except CacheFullError:
                pass  # all-or-nothing: nothing may have changed
        elif op == "evict":
            cache.evict(force=True)
            for s in live:
                for length, budget in zip(cache.layer_lengths(s), cache.budgets):
                    assert length <= budget
        elif op == "remove" and seq in live:
            cache.remove_sequence(seq)
            live.discard(seq)
        check_pool(cache)
    for seq in list(live):
        cache.remove_sequence(seq)
    assert cache.pool.free_pages == cache.pool.num_pages
    assert all(c == 0 for c in cache.pool.refcount)


def test_out_of_pages_changes_nothing():
    cache = PagedKVCache(CFG, CacheConfig(policy="full", budget_tokens=None), num_pages=4)
    cache.add_sequence(0)
    append_random(cache, 0, 16)  # 2 layers x 1 page
    with pytest.raises(CacheFullError, match="out of pages"):
        append_random(cache, 0, 40)  # would need 2 x 2 more pages
    assert cache.layer_lengths(0) == [16, 16] and cache.pool.free_pages == 2
    check_pool(cache)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
def test_full_policy_matches_contiguous_cache(kv_dtype):
    model = random_model(CFG)
    torch.manual_seed(3)
    prompts = [torch.randint(0, CFG.vocab_size, (n,)).tolist() for n in (21, 7, 33)]
    paged = PagedKVCache(CFG, CacheConfig(policy="full", budget_tokens=None, kv_dtype=kv_dtype),
                         num_pages=64)
    contiguous = ContiguousKVCache(CFG, 3, 64)
    for seq in range(3):
        paged.add_sequence(seq)
    feeds = prompts
    for _ in range(5):
        batch = BatchMetadata.build(range(3), [len(f) for f in feeds])
        ids = torch.tensor(sum(feeds, []))
        got = model(ids, batch, paged.attention)
        want = model(ids, BatchMetadata.build(range(3), [len(f) for f in feeds]), contiguous)
        if kv_dtype == "float32":
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:
            assert torch.nn.functional.cosine_similarity(got, want, -1).min() > 0.995
        feeds = [[t] for t in want.argmax(-1).tolist()]


def test_mixed_chunk_and_decode_batch_matches_separate_steps():
    model = random_model(CFG)
    config = CacheConfig(policy="full", budget_tokens=None)
    together, apart = (PagedKVCache(CFG, config, num_pages=64) for _ in range(2))
    for cache in (together, apart):
        cache.add_sequence(0)
        cache.add_sequence(1)
        model(torch.arange(10), BatchMetadata.build([0], [10]), cache.attention)
    batch = BatchMetadata.build([0, 1], [1, 12])
    got = model(torch.arange(40, 53), batch, together.attention)
    first = model(torch.tensor([40]), BatchMetadata.build([0], [1]), apart.attention)
    second = model(torch.arange(41, 53), BatchMetadata.build([1], [12]), apart.attention)
    torch.testing.assert_close(got, torch.cat([first, second]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("policy", ["sink_window", "h2o", "snapkv", "redundancy"])
def test_attention_after_compaction_equals_recomputation(policy):
    config = CacheConfig(policy=policy, budget_tokens=40, sink_tokens=3, window_tokens=8)
    cache = PagedKVCache(CFG, config, num_pages=64)
    cache.add_sequence(0)
    gen = torch.Generator().manual_seed(5)
    layer0_k, layer0_v = [], []
    for chunk in (30, 25, 17):
        batch = BatchMetadata.build([0], [chunk])
        cache.attention.prepare(batch)
        for layer in range(CFG.num_layers):
            q = torch.randn(chunk, CFG.num_heads, CFG.head_dim, generator=gen)
            k = torch.randn(chunk, CFG.num_kv_heads, CFG.head_dim, generator=gen)
            v = torch.randn(chunk, CFG.num_kv_heads, CFG.head_dim, generator=gen)
            if layer == 0:
                layer0_k.append(k)
                layer0_v.append(v)
            cache.attention.attend(layer, q, k, v, batch)
    assert cache.evict() > 0
    rec = cache.sequences[0].layers[0]
    assert rec.length == 40
    kept = rec.column(STREAM).long()
    k_all, v_all = torch.cat(layer0_k), torch.cat(layer0_v)
    # a new decode query against the compacted cache ...
    q = torch.randn(1, CFG.num_heads, CFG.head_dim, generator=gen)
    k_new = torch.randn(1, CFG.num_kv_heads, CFG.head_dim, generator=gen)
    v_new = torch.randn(1, CFG.num_kv_heads, CFG.head_dim, generator=gen)
    batch = BatchMetadata.build([0], [1])
    cache.attention.prepare(batch)
    got = cache.attention.attend(0, q, k_new, v_new, batch)
    # ... equals attention recomputed from scratch on the kept tokens at positions 0..40
    keys = torch.cat([k_all[kept], k_new])
    values = torch.cat([v_all[kept], v_new])
    positions = torch.arange(41)
    want, _ = dense_chunk_attention(
        cache.rotary.rotate(q, positions[-1:]), cache.rotary.rotate(keys, positions), values,
        past=40, mass_rows=None,
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("policy", ["sink_window", "h2o", "snapkv", "redundancy", "pyramid"])
def test_protected_tokens_and_sinks_survive(policy):
    config = CacheConfig(policy=policy, budget_tokens=48, sink_tokens=4)
    cache = PagedKVCache(CFG, config, num_pages=128)
    cache.add_sequence(0)
    append_random(cache, 0, 10, TokenInfo.text(10, protected=True))  # system prompt
    for i in range(8):
        append_random(cache, 0, 20, TokenInfo.uniform(20, Modality.FRAME, i, i, False), seed=i)
        if i == 3:
            append_random(cache, 0, 5, TokenInfo.text(5, protected=True), seed=99)  # question
        cache.evict(force=True)
    for rec, budget in zip(cache.sequences[0].layers, cache.budgets):
        streams = rec.column(STREAM).long().tolist()
        assert all(s in streams for s in range(10))  # sinks and the system prompt
        assert all(s in streams for s in range(90, 95))  # the protected question
        assert rec.column(PROTECTED).sum() == 15
        assert rec.length <= budget


def test_frame_aware_eviction_keeps_or_drops_whole_frames():
    config = CacheConfig(policy="h2o", budget_tokens=64, sink_tokens=0, frame_aware=True)
    cache = PagedKVCache(CFG, config, num_pages=128)
    cache.add_sequence(0)
    for frame in range(12):
        append_random(cache, 0, 12, TokenInfo.uniform(12, Modality.FRAME, frame, frame, False),
                      seed=frame)
        cache.evict()
    cache.evict(force=True)
    for rec in cache.sequences[0].layers:
        sources = rec.column(SOURCE).long()
        counts = torch.bincount(sources, minlength=12)
        assert set(counts.tolist()) <= {0, 12}
        assert rec.length <= 64 and counts.gt(0).sum() >= 4


@pytest.mark.parametrize("policy", ["h2o", "redundancy"])
def test_frames_a_newer_frame_repeats_are_evicted_first_with_clip_embeddings(policy):
    """Twelve frames: 0-5 one static scene (the same CLIP embedding), 6-11 all different.
    With their embeddings indexed, eviction drops the static scene's older frames before
    any distinct frame; the static scene keeps its newest frame. Budget: 8 frames."""
    config = CacheConfig(policy=policy, budget_tokens=96, sink_tokens=0, frame_aware=True)
    distinct = torch.nn.functional.normalize(torch.randn(7, 16, generator=torch.Generator()
                                                         .manual_seed(1)), dim=-1)
    cache = PagedKVCache(CFG, config, num_pages=128)
    cache.add_sequence(0)
    for frame in range(12):
        append_random(cache, 0, 12, TokenInfo.uniform(12, Modality.FRAME, frame, frame, False),
                      seed=frame)
        cache.index_frame(0, frame, distinct[0] if frame < 6 else distinct[frame - 5])
    cache.evict(force=True)
    for rec in cache.sequences[0].layers:
        kept = set(rec.column(SOURCE).long().tolist())
        assert kept >= {5, 6, 7, 8, 9, 10, 11} and len(kept & {0, 1, 2, 3, 4}) == 1
    # without the index the same stream keeps old static frames over distinct ones
    plain = PagedKVCache(CFG, config, num_pages=128)
    plain.add_sequence(0)
    for frame in range(12):
        append_random(plain, 0, 12, TokenInfo.uniform(12, Modality.FRAME, frame, frame, False),
                      seed=frame)
    plain.evict(force=True)
    assert any(not set(r.column(SOURCE).long().tolist()) >= {5, 6, 7, 8, 9, 10, 11}
               for r in plain.sequences[0].layers)
    assert set(cache.sequences[0].frame_embeddings) == set().union(
        *(set(r.column(SOURCE).long().tolist()) for r in cache.sequences[0].layers))


def test_int8_pages_use_about_a_quarter_of_float32_memory():
    f32 = CacheConfig(kv_dtype="float32").page_bytes(CFG)
    i8 = CacheConfig(kv_dtype="int8").page_bytes(CFG)
    bf16 = CacheConfig(kv_dtype="bfloat16").page_bytes(CFG)
    assert bf16 == f32 // 2 and i8 < 0.6 * bf16


def test_prefix_sharing_reuses_pages_and_copies_on_write():
    model = random_model(CFG)
    config = CacheConfig(policy="sink_window", budget_tokens=48, sink_tokens=2)
    shared = PagedKVCache(CFG, config, num_pages=128)
    alone = PagedKVCache(CFG, config, num_pages=128)
    prompt = torch.randint(0, CFG.vocab_size, (40,)).tolist()  # 2 full pages + 8
    shared.add_sequence(0)
    model(torch.tensor(prompt), BatchMetadata.build([0], [40]), shared.attention)
    assert shared.publish_prefix(0, prompt) == 2
    used_before = shared.pool.used_pages
    reused = shared.add_sequence(1, prefix_tokens=prompt)
    assert reused == 32
    assert shared.pool.used_pages == used_before  # no new pages for the shared prefix
    got = model(torch.tensor(prompt[32:]), BatchMetadata.build([1], [8]), shared.attention)
    alone.add_sequence(0)
    want = model(torch.tensor(prompt), BatchMetadata.build([0], [40]), alone.attention)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the owner streams on and evicts; the sharer's prefix must not change under it
    for _ in range(3):
        model(torch.randint(0, CFG.vocab_size, (20,)), BatchMetadata.build([0], [20]),
              shared.attention)
        shared.evict(force=True)
    nxt = torch.tensor([7])
    got = model(nxt, BatchMetadata.build([1], [1]), shared.attention)
    want = model(nxt, BatchMetadata.build([0], [1]), alone.attention)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    shared.remove_sequence(0)
    shared.remove_sequence(1)
    assert shared.pool.free_pages == shared.pool.num_pages


def test_pyramid_budgets_follow_the_schedule():
    budgets = pyramid_budgets(1000, 30, 8, 0.2, floor=20)
    assert sum(budgets) == 30 * 1000
    assert budgets[:8] == [budgets[0]] * 8
    assert all(a >= b for a, b in zip(budgets, budgets[1:]))
    assert budgets[-1] / budgets[0] == pytest.approx(0.2, abs=0.01)
    cfg = tiny_config(num_layers=4)
    cache = PagedKVCache(cfg, CacheConfig(policy="pyramid", budget_tokens=40,
                                          pyramid_full_layers=1), num_pages=256)
    assert cache.budgets[0] > cache.budgets[-1]


def test_fork_sees_the_snapshot_and_both_sides_stream_on():
    model = random_model(CFG)
    config = CacheConfig(policy="h2o", budget_tokens=48, sink_tokens=2)
    cache = PagedKVCache(CFG, config, num_pages=128)
    reference = PagedKVCache(CFG, config, num_pages=128)
    prompt = torch.randint(0, CFG.vocab_size, (37,))  # partial last page
    for c in (cache, reference):
        c.add_sequence(0)
        model(prompt, BatchMetadata.build([0], [37]), c.attention)
    cache.fork(0, 1)
    # the original streams on and evicts while the fork answers
    for _ in range(3):
        model(torch.randint(0, CFG.vocab_size, (20,)),
            BatchMetadata.build([0], [20]), cache.attention)
        cache.evict(force=True)
    question = torch.tensor([5, 9, 11])
    got = model(question, BatchMetadata.build([1], [3]), cache.attention)
    want = model(question, BatchMetadata.build([0], [3]), reference.attention)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    check_pool(cache)
    cache.remove_sequence(1)
    cache.remove_sequence(0)
    assert cache.pool.free_pages == cache.pool.num_pages


def test_limit_protected_releases_oldest_but_not_the_system_prompt():
    cache = PagedKVCache(CFG, CacheConfig(policy="h2o", budget_tokens=64), num_pages=64)
    cache.add_sequence(0, pinned=8)
    append_random(cache, 0, 8, TokenInfo.text(8, protected=True))
    for i in range(4):
        append_random(cache, 0, 10, TokenInfo.text(10, protected=True), seed=i)
    assert cache.limit_protected(0, max_protected=25) == 2 * 15
    rec = cache.sequences[0].layers[0]
    prot = rec.column(PROTECTED) > 0
    assert prot[:8].all() and not prot[8:23].any() and prot[23:].all()


@pytest.mark.parametrize("policy", ["h2o", "sink_window", "redundancy"])
def test_protected_text_beyond_the_budget_never_makes_eviction_fail(policy):
    """More protected tokens than the budget: the oldest after the pinned prefix lose their
    protection and eviction meets the budget; the pinned prefix and the newest stay."""
    cache = PagedKVCache(CFG, CacheConfig(policy=policy, budget_tokens=32,
                                          evict_slack_tokens=0), num_pages=64)
    cache.add_sequence(0, pinned=6)
    append_random(cache, 0, 6, TokenInfo.text(6, protected=True))
    for i in range(3):
        append_random(cache, 0, 12, TokenInfo.text(12, protected=True), seed=i)
    assert cache.evict() > 0
    assert cache.stats.demoted_tokens == CFG.num_layers * (6 + 36 - 32)
    for rec in cache.sequences[0].layers:
        assert rec.length == 32
        stream = rec.column(STREAM)
        assert stream[:6].tolist() == list(range(6))  # the pinned prefix
        assert stream[-26:].tolist() == list(range(16, 42))  # the newest protected text
    check_pool(cache)


def test_a_pinned_prefix_larger_than_the_budget_is_refused():
    cache = PagedKVCache(CFG, CacheConfig(policy="h2o", budget_tokens=32), num_pages=64)
    with pytest.raises(CacheFullError, match="pinned prefix of 40 tokens"):
        cache.add_sequence(0, pinned=40)


def test_prefix_entry_dies_with_its_pages():
    config = CacheConfig(policy="full", budget_tokens=None)
    cache = PagedKVCache(CFG, config, num_pages=32)
    prompt = list(range(40))
    cache.add_sequence(0)
    append_random(cache, 0, 40)
    assert cache.publish_prefix(0, prompt) == 2
    cache.remove_sequence(0)
    assert cache.add_sequence(1, prefix_tokens=prompt) == 0  # freed pages are not reused
    check_pool(cache)


@pytest.mark.parametrize("policy", ["redundancy", "h2o"])
def test_several_chunks_in_one_step_match_separate_steps(policy):
    model = random_model(CFG)
    config = CacheConfig(policy=policy, budget_tokens=256)
    together, apart = (PagedKVCache(CFG, config, num_pages=128) for _ in range(2))
    for cache in (together, apart):
        for seq, n in enumerate((5, 30, 12)):
            cache.add_sequence(seq)
            model(torch.arange(n), BatchMetadata.build([seq], [n]), cache.attention)
    lens = [7, 2, 19]
    ids = torch.randint(0, CFG.vocab_size, (sum(lens),))
    batch = BatchMetadata.build([0, 1, 2], lens)
    batch.logit_rows = None
    got = model(ids, batch, together.attention)
    want, start = [], 0
    for seq, n in enumerate(lens):
        single = BatchMetadata.build([seq], [n])
        single.logit_rows = None
        want.append(model(ids[start : start + n], single, apart.attention))
        start += n
    torch.testing.assert_close(got, torch.cat(want), atol=1e-5, rtol=1e-5)


def cache_state(cache: PagedKVCache) -> dict:
    """Everything a failed step must leave unchanged."""
    state = {"refcount": list(cache.pool.refcount), "free": cache.pool.free_pages}
    for seq_id, seq in cache.sequences.items():
        state[seq_id] = (seq.stream_pos, seq.next_group, seq.last_frame_source, [
            (list(rec.pages), rec.length, rec.meta[: rec.length].clone(),
             rec.score[: rec.length].clone()) for rec in seq.layers])
    return state


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], tuple):
            assert a[key][:3] == b[key][:3]
            for (pages, length, meta, score), (pages2, length2, meta2, score2) in zip(
                    a[key][3], b[key][3]):
                assert pages == pages2 and length == length2
                assert torch.equal(meta, meta2) and torch.equal(score, score2)
        else:
            assert a[key] == b[key]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_forward_that_fails_mid_step_is_rolled_back_exactly(backend):
    """Pages reserved before the forward pass; layer 1 raises after layer 0 wrote its K/V:
    rollback restores page tables, refcounts, lengths, stream counters and scores; the same
    step then succeeds and commits."""
    from streamgrok_kernels.ops import KernelOps

    model = random_model(CFG)
    model.kernels = KernelOps(backend)
    cache = PagedKVCache(CFG, CacheConfig(policy="h2o", budget_tokens=256), num_pages=64,
                         kernels=model.kernels)
    for seq, n in ((0, 21), (1, 16)):
        cache.add_sequence(seq)
        model(torch.arange(n) % 50, BatchMetadata.build([seq], [n]), cache.attention)
    before = cache_state(cache)
    ids = torch.tensor([3, 4, 5, 6, 7, 8, 9])
    batch = BatchMetadata.build([0, 1], [1, 6])
    original = model.layers[1].forward

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure in layer 1")

    model.layers[1].forward = broken
    cache.reserve({0: 1, 1: 6})
    assert cache.pool.free_pages < before["free"]  # pages exist before the forward pass
    with pytest.raises(RuntimeError, match="injected"):
        model(ids, batch, cache.attention)
    cache.rollback()
    assert_same_state(before, cache_state(cache))
    check_pool(cache)

    model.layers[1].forward = original
    cache.reserve({0: 1, 1: 6})
    model(ids, BatchMetadata.build([0, 1], [1, 6]), cache.attention)
    cache.commit()
    assert cache.layer_lengths(0) == [22] * CFG.num_layers
    assert cache.layer_lengths(1) == [22] * CFG.num_layers
    assert float(cache.sequences[0].layers[0].score.sum()) > 0  # committed attention mass
    check_pool(cache)


def test_kv_dtype_follows_the_model_and_the_pool_size_has_defaults():
    from streamgrok.cache.config import CPU_DEFAULT_GIB
    from streamgrok.runtime import resolve_dtype

    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    cache = PagedKVCache(CFG, CacheConfig(), torch.bfloat16)  # kv_dtype "auto"
    assert cache.config.kv_dtype == "bfloat16"
    assert cache.pool.paged_kv().k.dtype == torch.bfloat16
    assert cache.memory_budget_bytes() == CPU_DEFAULT_GIB * 2**30  # no size given, on CPU
    assert CacheConfig(kv_dtype="int8").for_model(torch.bfloat16).kv_dtype == "int8"
    with pytest.raises(ValueError, match="resolved against the model"):
        _ = CacheConfig().torch_kv_dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_pages_are_handed_out_zeroed_even_after_reuse(dtype):
    from streamgrok.cache.pool import PagePool

    pool = PagePool(4, 16, 2, 8, dtype, torch.float32)
    pages = pool.allocate(3)
    kv = pool.paged_kv()
    for page in pages:
        for tensor in kv.tensors():
            assert not tensor[page * 16:(page + 1) * 16].any()
            tensor[page * 16:(page + 1) * 16] = 7  # written by a sequence
    pool.release(pages[1:])
    again = pool.allocate(2)
    assert sorted(again) == sorted(pages[1:])  # the released pages, reused
    for page in again:
        for tensor in kv.tensors():
            assert not tensor[page * 16:(page + 1) * 16].any()
    for tensor in kv.tensors():  # the page still held keeps what was written
        assert (tensor[pages[0] * 16:(pages[0] + 1) * 16] == 7).all()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([int(Modality.TEXT), int(Modality.FRAME)]),
                          st.integers(-1, 3), st.booleans()), min_size=1, max_size=12))
def test_stream_rows_of_one_token_at_a_time_equal_a_chunk(tokens):
    """A decode step's one-token records (its own fast path) equal the records of the same
    tokens appended as one chunk: stream index, frame group, modality, time, source."""
    from streamgrok.cache.records import SequenceState, next_stream_rows

    info = TokenInfo(torch.tensor([m for m, _, _ in tokens]),
                     torch.arange(len(tokens), dtype=torch.float64) / 2,
                     torch.tensor([s for _, s, _ in tokens]),
                     torch.tensor([p for _, _, p in tokens]))
    whole, single = SequenceState(0, []), SequenceState(0, [])
    chunk = next_stream_rows(whole, info)
    rows = torch.cat([next_stream_rows(single, info.slice(i, i + 1))
                      for i in range(len(tokens))])
    assert torch.equal(rows, chunk)
    assert (single.stream_pos, single.next_group, single.last_frame_source) == \
        (whole.stream_pos, whole.next_group, whole.last_frame_source)
