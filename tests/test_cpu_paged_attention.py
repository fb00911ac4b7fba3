"""The native CPU paged attention kernel against the PyTorch references: decode rows and
prefill chunks through shuffled page tables, float32/bfloat16/int8 pages, keys rotated to
their cache positions, the exact attention mass, clear errors; then through `KernelOps` and a
whole engine, whose greedy answers and evictions match the reference path's."""

from __future__ import annotations

import pytest
import torch
from helpers import random_model, tiny_config

from streamgrok.model.config import RopeScaling
from streamgrok.model.rotary import inverse_frequencies
from streamgrok_kernels import paged_decode_attention, paged_prefill_attention
from streamgrok_kernels.cpu_attention import cpu_paged_attention, native_kernel_available
from streamgrok_kernels.ops import KernelOps
from streamgrok_kernels.paged_kv import PagedKV

PAGE = 16
POOL_PAGES = 48


@pytest.fixture(scope="module", autouse=True)
def built():
    assert native_kernel_available(torch.float32), "the native kernel did not build"


def pool(kv_heads: int, dim: int, dtype: torch.dtype, seed: int,
         pages: int = POOL_PAGES) -> PagedKV:
    gen = torch.Generator().manual_seed(seed)
    kv = PagedKV.zeros(pages * PAGE, kv_heads, dim, dtype, PAGE)
    if dtype == torch.int8:
        for data, scale in ((kv.k, kv.k_scale), (kv.v, kv.v_scale)):
            data.copy_(torch.randint(-127, 128, data.shape, generator=gen))
            scale.copy_(torch.rand(scale.shape, generator=gen) * 0.03 + 0.001)
    else:
        kv.k.copy_((torch.randn(kv.k.shape, generator=gen) * 2).to(dtype))
        kv.v.copy_(torch.randn(kv.v.shape, generator=gen).to(dtype))
    return kv


def rotary_tables(dim: int, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    frequencies = inverse_frequencies(dim, 10000.0, RopeScaling()).float()
    angles = torch.arange(positions)[:, None] * frequencies[None, :]
    return angles.cos(), angles.sin()


def page_tables(rows: int, pages: int, seed: int, pool_pages: int = POOL_PAGES
                ) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(pool_pages, generator=gen)[:pages]
                        for _ in range(rows)]).int()


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [
    (9, 3, 64),  # SmolLM2's shape: a fixed head size
    (8, 1, 128),  # the other fixed head size, one KV head
    (4, 4, 64),  # no grouping
    (6, 2, 32),  # head size 32: the generic path
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_decode_rows_equal_the_reference(heads, kv_heads, dim, dtype):
    kv = pool(kv_heads, dim, dtype, seed=dim + heads)
    lengths = torch.tensor([1, 16, 17, 200, 93], dtype=torch.int32)
    tables = page_tables(len(lengths), 14, seed=heads)
    cos, sin = rotary_tables(dim, 14 * PAGE)
    q = torch.randn(len(lengths), heads, dim, generator=torch.Generator().manual_seed(1))
    masses = decode_rows_match_the_reference(q, kv, tables, lengths, cos, sin)
    assert float(masses[0, 1:].abs().sum()) == 0  # nothing past a row's keys


def decode_rows_match_the_reference(q, kv, tables, lengths, cos, sin) -> torch.Tensor:
    """Asserts the native kernel's decode rows, with and without the attention mass, equal
    the reference's, and each row's mass sums to its query heads; returns the mass."""
    ops = KernelOps("torch", compiled_reads=False, native_attention=True)
    assert ops.native.wait_ready()
    for want_mass in (False, True):
        ref, ref_mass = paged_decode_attention.reference(q, kv, tables, lengths, cos, sin,
                                                         want_mass)
        out, mass = ops.decode_attention(q, kv, tables, lengths, cos, sin, want_mass)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
        assert (mass is None) == (not want_mass)
    torch.testing.assert_close(mass, ref_mass, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(mass.sum(1), torch.full((len(lengths),), float(q.shape[1])))
    return mass


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "lengths"), [
    (9, 3, 64, [700]),  # one sequence: its 3 KV heads' keys split in two
    (8, 1, 128, [1300, 530, 1]),  # two long rows split in parts of whole blocks, one not
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("threads", [1, 2])
def test_few_long_decode_rows_split_their_keys_and_equal_the_reference(
        heads, kv_heads, dim, lengths, dtype, threads):
    """A step of fewer (sequence, KV head) pairs than keep the threads busy splits each
    pair's keys into parts, combined exactly: the output and attention mass of the
    reference."""
    pages = 2 * 84
    kv = pool(kv_heads, dim, dtype, seed=dim, pages=pages)
    lengths = torch.tensor(lengths, dtype=torch.int32)
    tables = page_tables(len(lengths), 84, seed=heads, pool_pages=pages)
    cos, sin = rotary_tables(dim, 84 * PAGE)
    q = torch.randn(len(lengths), heads, dim, generator=torch.Generator().manual_seed(6))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        decode_rows_match_the_reference(q, kv, tables, lengths, cos, sin)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("mass_window", [None, 1, 5, 1000])
def test_prefill_chunks_equal_the_reference(dtype, mass_window):
    """Chunks of 1, 7, 40 (more than one task's 16 query tokens) and 16 queries after 0..130
    cached keys: causal within each chunk, the mass from each chunk's last queries."""
    heads, kv_heads, dim = 9, 3, 64
    kv = pool(kv_heads, dim, dtype, seed=5)
    counts, past = [1, 7, 40, 16], torch.tensor([0, 130, 33, 16])
    tables = page_tables(len(counts), 12, seed=3)
    cu_q = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    cos, sin = rotary_tables(dim, 12 * PAGE)
    q = torch.randn(sum(counts), heads, dim, generator=torch.Generator().manual_seed(2))
    ref, ref_mass = paged_prefill_attention.reference(q, kv, tables, cu_q, past, cos, sin,
                                                      max(counts), mass_window)
    out, mass = cpu_paged_attention(q, kv, tables, cu_q, past, cos, sin, mass_window)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    if mass_window is None:
        assert mass is None
    else:
        torch.testing.assert_close(mass, ref_mass, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_chunks_of_few_query_rows_equal_the_reference(heads, kv_heads, dtype):
    """Chunks whose query tokens times the query group are a few rows (scored untransposed,
    like decode rows) and chunks of more rows, causal within each, keys on both sides of
    page and block boundaries."""
    dim = 64
    kv = pool(kv_heads, dim, dtype, seed=heads)
    counts, past = [1, 2, 5, 8, 9], torch.tensor([0, 17, 130, 3, 40])
    tables = page_tables(len(counts), 12, seed=4)
    cu_q = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    cos, sin = rotary_tables(dim, 12 * PAGE)
    q = torch.randn(sum(counts), heads, dim, generator=torch.Generator().manual_seed(3))
    ref, ref_mass = paged_prefill_attention.reference(q, kv, tables, cu_q, past, cos, sin,
                                                      max(counts), 3)
    out, mass = cpu_paged_attention(q, kv, tables, cu_q, past, cos, sin, 3)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(mass, ref_mass, atol=2e-5, rtol=1e-4)


def test_a_sliced_page_table_and_bfloat16_queries():
    """The cache passes a view of wider tables; a bfloat16 model's queries come back
    bfloat16."""
    kv = pool(3, 64, torch.float32, seed=7)
    wide = page_tables(3, 10, seed=9)
    tables = wide[:, :6]
    lengths = torch.tensor([90, 5, 96], dtype=torch.int32)
    cos, sin = rotary_tables(64, 10 * PAGE)
    q = torch.randn(3, 9, 64).bfloat16()
    ref, _ = paged_decode_attention.reference(q.float(), kv, tables.contiguous(), lengths,
                                              cos, sin)
    out, _ = cpu_paged_attention(q, kv, tables, torch.arange(4), lengths.long() - 1, cos,
                                 sin, None)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_what_the_kernel_does_not_take_is_a_clear_error():
    kv = pool(2, 32, torch.float32, seed=0)
    cos, sin = rotary_tables(32, 4 * PAGE)
    q = torch.randn(1, 4, 32)
    rows, past = torch.arange(2), torch.tensor([20])
    bad_page = torch.tensor([[0, POOL_PAGES]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_paged_attention(q, kv, bad_page, rows, past, cos, sin, None)
    with pytest.raises(RuntimeError, match="page table holds"):
        cpu_paged_attention(q, kv, torch.tensor([[0]], dtype=torch.int32), rows, past, cos,
                            sin, None)
    with pytest.raises(RuntimeError, match="rotary tables are shorter"):
        cpu_paged_attention(q, kv, torch.tensor([[0, 1]], dtype=torch.int32), rows, past,
                            cos[:8], sin[:8], None)
    int8 = pool(2, 32, torch.int8, seed=0)
    with pytest.raises(RuntimeError, match="need k_scale and v_scale"):
        cpu_paged_attention(q, PagedKV(int8.k, int8.v, PAGE),
                            torch.tensor([[0, 1]], dtype=torch.int32), rows, past, cos, sin,
                            None)


def test_kernel_ops_keep_the_reference_until_the_kernel_is_loaded_and_when_told():
    kv = pool(3, 64, torch.float16, seed=1)  # float16 pages: not the kernel's
    assert not KernelOps("torch", native_attention=True).native.serves(torch.zeros(1), kv)
    off = KernelOps("torch", native_attention=False)
    assert not off.native.wait_ready()
    assert not off.native.serves(torch.zeros(1), pool(3, 64, torch.float32, seed=1))


async def test_engine_answers_are_the_same_with_the_native_kernel(tmp_path):
    """Sessions streaming past their budget with forks and h2o eviction (which reads the
    decode rows' attention mass): the same greedy answers and evictions as the reference."""
    from helpers import queue_streaming_questions, write_gguf

    from streamgrok.cache.config import CacheConfig
    from streamgrok.engine import Engine, EngineConfig
    from streamgrok.loading.loader import load_model

    config = tiny_config(hidden_size=192, num_heads=6, num_kv_heads=2, head_dim=32,
                         max_positions=4096)
    loaded = load_model(write_gguf(tmp_path / "tiny.gguf", random_model(config)))
    answers, evicted = {}, {}
    for native in (True, False):
        loaded.model.kernels = KernelOps("torch", compiled_reads=False,
                                         native_attention=native)
        assert loaded.model.kernels.native.wait_ready() == native
        for kv_dtype in ("float32", "int8"):
            cache = CacheConfig(policy="h2o", budget_tokens=96, evict_slack_tokens=16,
                                memory_gib=0.01, kv_dtype=kv_dtype)
            async with Engine(loaded, cache, EngineConfig(merge_window_s=0)) as engine:
                asks = await queue_streaming_questions(engine)
                answers[native, kv_dtype] = [await a.text() for a in asks]
                evicted[native, kv_dtype] = engine.cache.stats.evicted_tokens
    for kv_dtype in ("float32", "int8"):
        assert all(answers[False, kv_dtype])
        assert evicted[False, kv_dtype] > 0
        assert answers[True, kv_dtype] == answers[False, kv_dtype]
        assert evicted[True, kv_dtype] == evicted[False, kv_dtype]


def test_the_paged_decode_bench_times_both_paths_and_plots(tiny_loaded, tmp_path, monkeypatch,
                                                           capsys):
    from benchmarks import paged_decode

    monkeypatch.setattr(paged_decode, "SHAPES", ((1, 40), (3, 70)))
    monkeypatch.setattr(paged_decode, "STEPS", 2)
    results = paged_decode.paged_decode(tiny_loaded, tmp_path, chunk=32)
    assert set(results) == {"1x40", "3x70"}
    assert all(r["native_ms"] > 0 and r["torch_ms"] > 0 for r in results.values())
    assert (tmp_path / "paged_decode.png").stat().st_size > 0
    assert "native ms" in capsys.readouterr().out


def test_the_cache_prefills_short_chunks_by_the_native_kernel():
    """Several sequences' short chunks in one step (prompts, streamed notes) take the native
    kernel, with the reference's output; long chunks keep the PyTorch path."""
    from streamgrok_kernels import ops as ops_module

    kv = pool(3, 64, torch.float32, seed=11)
    counts, past = [5, 30, 12], torch.tensor([0, 40, 7])
    tables = page_tables(len(counts), 8, seed=5)
    cu_q = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    cos, sin = rotary_tables(64, 8 * PAGE)
    q = torch.randn(sum(counts), 9, 64, generator=torch.Generator().manual_seed(4))
    native = KernelOps("torch", compiled_reads=False, native_attention=True)
    assert native.native.wait_ready()
    calls = []
    original = ops_module.cpu_paged_attention
    ops_module.cpu_paged_attention = lambda *a: calls.append(1) or original(*a)
    try:
        out, _ = native.prefill_attention(q, kv, tables, cu_q, past, cos, sin, max(counts),
                                          None)
        assert calls == [1]
        long = ops_module.NATIVE_PREFILL_MAX_QUERIES + 1
        q_long = torch.randn(long, 9, 64)
        native.prefill_attention(q_long, kv, tables[:1], torch.tensor([0, long]),
                                 torch.tensor([0]), cos, sin, long, None)
        assert calls == [1]
    finally:
        ops_module.cpu_paged_attention = original
    ref, _ = paged_prefill_attention.reference(q, kv, tables, cu_q, past, cos, sin,
                                               max(counts), None)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_the_kv_dtypes_bench_compares_with_float32_and_plots(tiny_loaded, tmp_path, capsys):
    from benchmarks.kv_dtypes import kv_dtypes

    results = kv_dtypes(tiny_loaded, tmp_path, tokens=48, prefix=16)
    assert set(results) == {"float32", "bfloat16", "int8"}
    assert results["float32"]["top1"] == 1.0 and results["float32"]["kl"] == 0.0
    for dtype in ("bfloat16", "int8"):
        assert 0.0 <= results[dtype]["top1"] <= 1.0 and results[dtype]["kl"] >= 0.0
        assert results[dtype]["step_ms"] > 0
    assert (results["int8"]["bytes_per_token_layer"]
            < results["bfloat16"]["bytes_per_token_layer"]
            < results["float32"]["bytes_per_token_layer"])
    assert (tmp_path / "kv_dtypes.png").stat().st_size > 0
    assert "KL nats" in capsys.readouterr().out
