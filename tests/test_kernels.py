"""Triton kernels against their PyTorch references (interpreted on CPU: TRITON_INTERPRET=1 is
set by conftest when there is no CUDA device), and the cache + model on both kernel backends.

Tolerances: the kernels accumulate in float32 and read exactly the stored K/V the reference
reads, so with float32 queries outputs agree to 2e-5 whatever the KV dtype; with bfloat16
queries (the reference then computes in bfloat16) to 3e-2. kv_append is exact for float
pools and, on CUDA (approximate division), within one int8 step.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import random_model, tiny_config

pytest.importorskip("triton")

from streamgrok.cache.config import CacheConfig  # noqa: E402
from streamgrok.cache.paged_cache import PagedKVCache  # noqa: E402
from streamgrok.model.batch import BatchMetadata  # noqa: E402
from streamgrok.model.config import RopeScaling  # noqa: E402
from streamgrok.model.rotary import inverse_frequencies  # noqa: E402
from streamgrok_kernels import (  # noqa: E402
    kv_append,
    kv_compact,
    paged_decode_attention,
    paged_prefill_attention,
    rmsnorm,
    rotary,
)
from streamgrok_kernels.ops import KernelOps  # noqa: E402
from streamgrok_kernels.paged_kv import PagedKV  # noqa: E402
from streamgrok_kernels.rotary import apply_rotary  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = 16
KV_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def empty_pool(slots: int, kv_heads: int, dim: int, dtype: torch.dtype) -> PagedKV:
    return PagedKV.zeros(slots, kv_heads, dim, dtype, PAGE, DEVICE)


def random_pool(slots: int, kv_heads: int, dim: int, dtype: torch.dtype, gen) -> PagedKV:
    pool = empty_pool(slots, kv_heads, dim, dtype)
    k = torch.randn(slots, kv_heads, dim, generator=gen).to(DEVICE)
    v = torch.randn(slots, kv_heads, dim, generator=gen).to(DEVICE)
    kv_append.reference(pool, torch.arange(slots, device=DEVICE), k, v)
    return pool


def rotary_tables(positions: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = inverse_frequencies(dim, 10000.0, RopeScaling())
    angles = torch.outer(torch.arange(positions).float(), inv)
    return angles.cos().to(DEVICE), angles.sin().to(DEVICE)


def page_tables(totals: list[int], spare: int, gen) -> tuple[torch.Tensor, int]:
    """Random distinct pages for each sequence (the pool has `spare` unused pages)."""
    pages = max(-(-n // PAGE) for n in totals)
    count = len(totals) * pages + spare
    order = torch.randperm(count, generator=gen)[: len(totals) * pages]
    return order.view(len(totals), pages).int().to(DEVICE), count * PAGE


def random_case(seed: int) -> dict:
    rng = random.Random(seed)
    kv_heads = rng.choice([1, 2])
    return dict(
        batch=rng.randint(1, 5), kv_heads=kv_heads, group=rng.choice([1, 3, 8]),
        dim=rng.choice([64, 128]), kv_dtype=KV_DTYPES[seed % len(KV_DTYPES)],
        q_dtype=torch.bfloat16 if seed % 5 == 4 else torch.float32,
    )


def dense_mass(q, pool, tables, totals, cos, sin, windows):
    """Naive oracle: per sequence, gather its keys one by one, dense softmax per head over
    positions <= each query's, sum probabilities over heads and the last `window` queries.
    q[b] is [rows, H, D] at positions totals[b] - rows ... totals[b] - 1."""
    masses = []
    for b, total in enumerate(totals):
        slots = torch.tensor([int(tables[b, p // PAGE]) * PAGE + p % PAGE for p in range(total)])
        k, _ = pool.read(slots.to(DEVICE), torch.float32)
        k = apply_rotary(k, cos[:total], sin[:total])
        rows = q[b].shape[0]
        mass = torch.zeros(total, device=DEVICE)
        group = q[b].shape[1] // k.shape[1]
        for r in range(rows - windows[b], rows):
            position = total - rows + r
            for h in range(q[b].shape[1]):
                scores = k[: position + 1, h // group] @ q[b][r, h].float() / math.sqrt(k.shape[2])
                mass[: position + 1] += scores.softmax(0)
        masses.append(mass)
    return masses


@pytest.mark.parametrize("seed", range(8))
def test_paged_decode_attention_matches_reference(seed):
    case = random_case(seed)
    gen = torch.Generator().manual_seed(seed)
    heads = case["kv_heads"] * case["group"]
    lengths = [random.Random(seed + b).randint(1, 90) for b in range(case["batch"])]
    tables, slots = page_tables(lengths, 3, gen)
    pool = random_pool(slots, case["kv_heads"], case["dim"], case["kv_dtype"], gen)
    q = torch.randn(case["batch"], heads, case["dim"], generator=gen).to(DEVICE, case["q_dtype"])
    cos, sin = rotary_tables(tables.shape[1] * PAGE, case["dim"])
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    want, want_mass = paged_decode_attention.reference(q, pool, tables, lens, cos, sin, True)
    tol = TOLERANCE[case["q_dtype"]]
    for splits in (1, 3):
        got, mass = paged_decode_attention.paged_decode_attention(
            q, pool, tables, lens, cos, sin, want_mass=True, splits=splits, block_n=32)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(mass, want_mass, atol=tol, rtol=tol)
        plain, none = paged_decode_attention.paged_decode_attention(
            q, pool, tables, lens, cos, sin, splits=splits)
        assert none is None
        torch.testing.assert_close(plain, got, atol=1e-6, rtol=1e-6)


def test_decode_mass_equals_dense_softmax_probabilities():
    gen = torch.Generator().manual_seed(7)
    lengths, kv_heads, group, dim = [37, 16, 70], 2, 3, 64
    tables, slots = page_tables(lengths, 2, gen)
    pool = random_pool(slots, kv_heads, dim, torch.int8, gen)
    q = torch.randn(3, kv_heads * group, dim, generator=gen).to(DEVICE)
    cos, sin = rotary_tables(tables.shape[1] * PAGE, dim)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    _, mass = paged_decode_attention.paged_decode_attention(q, pool, tables, lens, cos, sin,
                                                            want_mass=True, splits=2)
    expected = dense_mass([q[b : b + 1] for b in range(3)], pool, tables, lengths, cos, sin,
                          [1, 1, 1])
    for b, n in enumerate(lengths):
        torch.testing.assert_close(mass[b, :n], expected[b], atol=1e-5, rtol=1e-5)
        assert float(mass[b, n:].abs().sum()) == 0.0
        assert abs(float(mass[b, :n].sum()) - kv_heads * group) < 1e-3


@pytest.mark.parametrize("seed", range(6))
def test_paged_prefill_attention_matches_reference(seed):
    case = random_case(seed + 100)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    heads = case["kv_heads"] * case["group"]
    counts = [rng.randint(1, 40) for _ in range(case["batch"])]
    pasts = [rng.choice([0, rng.randint(1, 60)]) for _ in counts]
    totals = [c + p for c, p in zip(counts, pasts)]
    tables, slots = page_tables(totals, 2, gen)
    pool = random_pool(slots, case["kv_heads"], case["dim"], case["kv_dtype"], gen)
    q = torch.randn(sum(counts), heads, case["dim"], generator=gen).to(DEVICE, case["q_dtype"])
    cos, sin = rotary_tables(tables.shape[1] * PAGE, case["dim"])
    cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32,
                      device=DEVICE)
    past = torch.tensor(pasts, dtype=torch.int32, device=DEVICE)
    tol = TOLERANCE[case["q_dtype"]]
    for window in (None, 8):
        want, want_mass = paged_prefill_attention.reference(q, pool, tables, cu, past, cos, sin,
                                                            max(counts), window)
        got, mass = paged_prefill_attention.paged_prefill_attention(
            q, pool, tables, cu, past, cos, sin, max(counts), window)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
        if window is None:
            assert mass is None and want_mass is None
        else:
            torch.testing.assert_close(mass, want_mass, atol=tol, rtol=tol)


@pytest.mark.parametrize("seed", range(4))
def test_short_chunks_attend_as_the_fused_sdpa_path(seed, monkeypatch):
    """The CPU path's products for short float32 chunks (questions) equal SDPA's batched
    path, padded chunks, GQA groups and chunks without a past included."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    kv_heads, group, dim = rng.choice([(1, 1, 16), (2, 3, 32), (3, 3, 64)])
    counts = [rng.randint(1, 40) for _ in range(rng.randint(1, 3))]
    pasts = [rng.choice([0, rng.randint(1, 300)]) for _ in counts]
    tables, slots = page_tables([c + p for c, p in zip(counts, pasts)], 2, gen)
    pool = random_pool(slots, kv_heads, dim, torch.float32, gen)
    q = torch.randn(sum(counts), kv_heads * group, dim, generator=gen)
    cos, sin = rotary_tables(tables.shape[1] * PAGE, dim)
    cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    past = torch.tensor(pasts, dtype=torch.int32)
    args = (q, pool, tables, cu, past, cos, sin, max(counts), None)
    short, _ = paged_prefill_attention.reference(*args)
    monkeypatch.setattr(paged_prefill_attention, "SHORT_CHUNK_ROWS", 0)
    fused, _ = paged_prefill_attention.reference(*args)
    torch.testing.assert_close(short, fused, atol=1e-5, rtol=1e-5)


def test_prefill_window_mass_equals_dense_softmax_probabilities():
    gen = torch.Generator().manual_seed(3)
    counts, pasts, kv_heads, group, dim, window = [20, 3, 40], [17, 0, 33], 1, 8, 128, 8
    totals = [c + p for c, p in zip(counts, pasts)]
    tables, slots = page_tables(totals, 1, gen)
    pool = random_pool(slots, kv_heads, dim, torch.bfloat16, gen)
    q = torch.randn(sum(counts), kv_heads * group, dim, generator=gen).to(DEVICE)
    cos, sin = rotary_tables(tables.shape[1] * PAGE, dim)
    cu = [0, *torch.tensor(counts).cumsum(0).tolist()]
    _, mass = paged_prefill_attention.paged_prefill_attention(
        q, pool, tables, torch.tensor(cu, dtype=torch.int32, device=DEVICE),
        torch.tensor(pasts, dtype=torch.int32, device=DEVICE), cos, sin, max(counts), window)
    windows = [min(window, n) for n in counts]
    expected = dense_mass([q[cu[b] : cu[b + 1]] for b in range(3)], pool, tables, totals, cos,
                          sin, windows)
    for b, total in enumerate(totals):
        torch.testing.assert_close(mass[b, :total], expected[b], atol=1e-5, rtol=1e-5)
        assert abs(float(mass[b].sum()) - windows[b] * kv_heads * group) < 1e-3


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_kv_append_matches_reference(dtype):
    gen = torch.Generator().manual_seed(1)
    slots = torch.tensor([5, -1, 17, 3, 40, -1, 63], device=DEVICE)
    source = torch.float32 if dtype == torch.int8 else dtype
    k = (torch.randn(7, 3, 64, generator=gen) * 3).to(DEVICE, source)
    v = torch.randn(7, 3, 64, generator=gen).to(DEVICE, source)
    k[3] = 0  # an all-zero head keeps a finite scale
    want, got = empty_pool(64, 3, 64, dtype), empty_pool(64, 3, 64, dtype)
    kv_append.reference(want, slots, k, v)
    kv_append.kv_append(got, slots, k, v)
    exact = dtype != torch.int8 or DEVICE == "cpu"
    for expected, actual in zip(want.tensors(), got.tensors()):
        if exact:
            assert torch.equal(expected, actual)
        else:
            assert (expected.float() - actual.float()).abs().max() <= 1
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[[5, 17, 3, 40, 63]] = False
    assert not got.k[untouched.to(DEVICE)].float().any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_kv_compact_in_place_matches_reference(dtype):
    gen = torch.Generator().manual_seed(2)
    pool = random_pool(96, 2, 64, dtype, gen)
    keep = torch.sort(torch.randperm(96, generator=gen)[:41]).values.to(DEVICE)
    dst = torch.arange(41, device=DEVICE)
    want = pool.clone()
    original = [t.clone() for t in pool.tensors()]
    kv_compact.reference(want, keep, dst)
    kv_compact.kv_compact(pool, keep, dst, block=8)  # small blocks: moves overlap across blocks
    for expected, actual, before in zip(want.tensors(), pool.tensors(), original):
        assert torch.equal(expected, actual)
        assert torch.equal(actual[:41], before[keep])


def test_compaction_then_decode_equals_decode_over_gathered_tokens():
    gen = torch.Generator().manual_seed(4)
    kv_heads, group, dim, length = 2, 3, 64, 75
    tables, slots = page_tables([length], 0, gen)
    pool = random_pool(slots, kv_heads, dim, torch.int8, gen)
    keep = torch.sort(torch.randperm(length, generator=gen)[:30]).values
    table_slots = (tables[0].long()[:, None] * PAGE + torch.arange(PAGE, device=DEVICE)).flatten()
    kept_slots = table_slots[keep.to(DEVICE)]
    gathered = empty_pool(2 * PAGE, kv_heads, dim, torch.int8)
    kv_compact.reference(gathered, torch.arange(30, device=DEVICE), torch.arange(30, device=DEVICE))
    for target, source in zip(gathered.tensors(), pool.tensors()):
        target[:30] = source[kept_slots]
    kv_compact.kv_compact(pool, kept_slots, table_slots[:30])
    q = torch.randn(1, kv_heads * group, dim, generator=gen).to(DEVICE)
    cos, sin = rotary_tables(tables.shape[1] * PAGE, dim)
    lens = torch.tensor([30], dtype=torch.int32, device=DEVICE)
    got, mass = paged_decode_attention.paged_decode_attention(q, pool, tables[:, :2], lens, cos,
                                                              sin, want_mass=True)
    fresh = torch.tensor([[0, 1]], dtype=torch.int32, device=DEVICE)
    want, want_mass = paged_decode_attention.reference(q, gathered, fresh, lens, cos, sin, True)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(mass, want_mass, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_rotary_match_reference(dtype):
    gen = torch.Generator().manual_seed(5)
    x, r = (torch.randn(7, 96, generator=gen).to(DEVICE, dtype) for _ in range(2))
    w = torch.randn(96, generator=gen).to(DEVICE, dtype)
    tol = TOLERANCE[dtype] * 3
    for residual in (None, r):
        want, want_sum = rmsnorm.reference(x, w, 1e-5, residual)
        got, got_sum = rmsnorm.rms_norm(x, w, 1e-5, residual)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        torch.testing.assert_close(got_sum, want_sum, atol=tol, rtol=tol)
    q = torch.randn(5, 9, 64, generator=gen).to(DEVICE, dtype)
    positions = torch.tensor([0, 3, 7, 100, 2], device=DEVICE)
    cos, sin = rotary_tables(128, 64)
    torch.testing.assert_close(rotary.rotate(q, positions, cos, sin),
                               rotary.reference(q, positions, cos, sin), atol=tol, rtol=tol)


@pytest.mark.parametrize("kv_dtype,policy", [("float32", "h2o"), ("int8", "snapkv"),
                                             ("float16", "redundancy")])
def test_model_on_the_paged_cache_gives_the_same_logits_on_both_backends(kv_dtype, policy):
    """Three sequences prefilled together, then decoded together past their budget (so
    eviction compacts pages), once through the Triton kernels and once through the
    references: the same logits at every step and the same tokens kept. With 8- or 16-bit K/V,
    the last-bit differences of the two paths' K can round a stored value one step apart, so
    logits (|logit| < 5 here) agree to 2e-3 there and to 1e-4 in float32. (float16, not
    bfloat16, because Triton's CPU interpreter truncates float32 -> bfloat16 where CUDA rounds
    to nearest even; bfloat16 storage from bfloat16 K/V is exact in test_kv_append.)"""
    tol = 1e-4 if kv_dtype == "float32" else 2e-3
    config = tiny_config(hidden_size=192, num_heads=6, num_kv_heads=2, head_dim=32)
    model = random_model(config).to(DEVICE)
    cache_config = CacheConfig(policy=policy, budget_tokens=48, evict_slack_tokens=16,
                               kv_dtype=kv_dtype, sink_tokens=4, snapkv_window=8)
    runs = []
    for backend in ("triton", "torch"):
        ops = KernelOps(backend)
        model.kernels = ops
        cache = PagedKVCache(config, cache_config, device=DEVICE, num_pages=64, kernels=ops)
        gen = torch.Generator().manual_seed(0)
        counts = [40, 9, 57]
        for seq in range(3):
            cache.add_sequence(seq)
        steps = []
        with torch.inference_mode():
            ids = torch.randint(0, config.vocab_size, (sum(counts),), generator=gen).to(DEVICE)
            batch = BatchMetadata.build([0, 1, 2], counts, DEVICE)
            steps.append(model(ids, batch, cache.attention))
            cache.evict()
            for _ in range(20):
                ids = steps[-1].argmax(-1)
                batch = BatchMetadata.build([0, 1, 2], [1, 1, 1], DEVICE)
                steps.append(model(ids, batch, cache.attention))
                cache.evict()
        kept = [cache.sequences[s].layers[1].column(0).tolist() for s in range(3)]
        runs.append((steps, kept, cache.stats.evicted_tokens))
    (triton_steps, triton_kept, triton_evicted), (torch_steps, torch_kept, torch_evicted) = runs
    assert torch_evicted > 0 and triton_evicted == torch_evicted
    assert triton_kept == torch_kept
    for got, want in zip(triton_steps, torch_steps):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_forced_triton_on_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        KernelOps("triton").uses_triton(torch.zeros(1))
    assert not KernelOps("auto").uses_triton(torch.zeros(1))
    with pytest.raises(ValueError, match="kernel backend"):
        KernelOps("cuda")


def test_gpu_check_script_runs_and_passes_on_small_shapes():
    """`python -m streamgrok_kernels.check` (here interpreted on small shapes unless CUDA is
    present)."""
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, "-m", "streamgrok_kernels.check", "--small"], cwd=root,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "0 failed checks" in result.stdout
    assert "kernel ms" in result.stdout and "mass +%" in result.stdout
    assert result.stdout.count(" ok") >= 19


@pytest.mark.parametrize("arch", [90, 80])
def test_every_kernel_specialization_compiles_for_the_gpu_without_spills(arch):
    """Ahead-of-time compile with Triton's ptxas (no GPU needed): catches GPU-only compile
    errors, register spills and shared memory over the architecture's limit."""
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "streamgrok_kernels.aot", "--arch", str(arch)],
                            cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    assert result.stdout.rstrip().endswith("0 failed")
    assert result.stdout.count(" ok") >= 40


async def test_engine_answers_are_the_same_on_both_kernel_backends(tmp_path):
    """Sessions streaming notes past their budget while asking (answers run on copy-on-write
    forks, eviction compacts shared pages): the same greedy answers through the Triton
    kernels as through the references. All work is queued while the engine is paused, so
    both runs schedule the same steps however the machine's threads interleave."""
    from helpers import queue_streaming_questions, write_gguf

    from streamgrok.engine import Engine, EngineConfig
    from streamgrok.loading.loader import load_model

    config = tiny_config(hidden_size=192, num_heads=6, num_kv_heads=2, head_dim=32,
                         max_positions=4096)
    loaded = load_model(write_gguf(tmp_path / "tiny.gguf", random_model(config)))
    cache = CacheConfig(policy="h2o", budget_tokens=96, evict_slack_tokens=16,
                        memory_gib=0.01, kv_dtype="int8")
    answers, evicted = {}, {}
    for backend in ("triton", "torch"):
        loaded.model.kernels = KernelOps(backend)
        async with Engine(loaded, cache, EngineConfig(merge_window_s=0)) as engine:
            asks = await queue_streaming_questions(engine)
            answers[backend] = [await a.text() for a in asks]
            evicted[backend] = engine.cache.stats.evicted_tokens
            assert evicted[backend] > 0
    assert all(answers["torch"])  # real tokens, not empty answers
    assert answers["triton"] == answers["torch"]
    assert evicted["triton"] == evicted["torch"]
