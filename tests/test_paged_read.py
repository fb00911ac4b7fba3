"""The CPU attention path's paged K/V reads: compiled (torch.compile) equals eager, and a failed
compilation falls back to eager reads without changing a result."""

from __future__ import annotations

import logging

import pytest
import torch

from streamgrok_kernels import paged_decode_attention, paged_prefill_attention
from streamgrok_kernels.ops import KernelOps
from streamgrok_kernels.paged_kv import PagedKV, table_slots
from streamgrok_kernels.paged_read import COMPILED_MIN_TOKENS, PagedReader

PAGE = 16


def pool(dtype: torch.dtype, slots: int, gen: torch.Generator) -> PagedKV:
    kv = PagedKV.zeros(slots, 2, 32, dtype, PAGE)
    k = torch.randn(slots, 2, 32, generator=gen) * 3
    v = torch.randn(slots, 2, 32, generator=gen)
    if dtype == torch.int8:
        for data, scale, x in ((kv.k, kv.k_scale, k), (kv.v, kv.v_scale, v)):
            step = x.abs().amax(-1) / 127
            scale.copy_(step.half())
            data.copy_((x / scale.float()[..., None]).round().clamp(-127, 127).to(torch.int8))
    else:
        kv.k.copy_(k.to(dtype))
        kv.v.copy_(v.to(dtype))
    return kv


def tables(batch: int, pages: int, spare: int, gen: torch.Generator) -> torch.Tensor:
    order = torch.randperm(batch * pages + spare, generator=gen)[: batch * pages]
    return order.view(batch, pages).int()


def rotary(width: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inverse = 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim)
    angles = torch.outer(torch.arange(width).float(), inverse)
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("batch", [1, 3])
def test_compiled_reads_equal_eager_reads(dtype, batch):
    gen = torch.Generator().manual_seed(batch)
    pages = -(-COMPILED_MIN_TOKENS // PAGE) + 3  # long enough to take the compiled path
    kv = pool(dtype, (batch * pages + 5) * PAGE, gen)
    slots = table_slots(tables(batch, pages, 5, gen), pages * PAGE, PAGE)
    cos, sin = rotary(pages * PAGE + 7, 32)
    compiled = PagedReader(compiled=True)
    want = PagedReader(compiled=False).read(kv, slots, cos, sin, torch.float32)
    eager_while_compiling = compiled.read(kv, slots, cos, sin, torch.float32)
    assert compiled.wait_compiled(timeout=600)
    assert compiled.compiled and compiled.compiled_kinds() == 1, compiled.compile_error
    got = compiled.read(kv, slots, cos, sin, torch.float32)
    with torch.compiler.set_stance("fail_on_recompile"):  # the stand-ins' graph serves all
        shorter = slots[:, : COMPILED_MIN_TOKENS + 5]
        compiled.read(kv, shorter, cos[:-3], sin[:-3], torch.float32)
    assert compiled.compiled, compiled.compile_error
    for g, w in zip(eager_while_compiling, want):
        torch.testing.assert_close(g, w)
    for g, w in zip(got, want):
        assert g.shape == (batch, pages * PAGE, 2, 32)
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    # the eager read itself: the pool's values, K rotated to its column's position
    k, v = kv.read(slots, torch.float32)
    torch.testing.assert_close(want[1], v)
    c, s = cos[: pages * PAGE, None], sin[: pages * PAGE, None]
    rotated = torch.cat([k[..., :16] * c - k[..., 16:] * s, k[..., 16:] * c + k[..., :16] * s],
                        dim=-1)
    torch.testing.assert_close(want[0], rotated)


def test_reads_under_inference_mode_compile_for_it_in_the_background():
    """The cache's way: a pool made outside inference mode, read inside it with slots made
    there. The background compilation matches that (its mode, each input's kind), so the
    first compiled read does not compile again on the caller's thread."""
    gen = torch.Generator().manual_seed(5)
    pages = -(-COMPILED_MIN_TOKENS // PAGE) + 2
    kv = pool(torch.float32, (pages + 4) * PAGE, gen)
    compiled = PagedReader(compiled=True)
    with torch.inference_mode():
        slots = table_slots(tables(1, pages, 4, gen), pages * PAGE, PAGE)
        cos, sin = rotary(pages * PAGE + 5, 32)
        want = PagedReader(compiled=False).read(kv, slots, cos, sin, torch.float32)
        compiled.read(kv, slots, cos, sin, torch.float32)
        assert compiled.wait_compiled(timeout=600)
        with torch.compiler.set_stance("fail_on_recompile"):
            got = compiled.read(kv, slots, cos, sin, torch.float32)
    assert compiled.compiled, compiled.compile_error
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_a_failing_compilation_falls_back_to_eager_reads(caplog):
    gen = torch.Generator().manual_seed(7)
    kv = pool(torch.float32, 40 * PAGE, gen)
    slots = table_slots(tables(1, 20, 10, gen), 20 * PAGE, PAGE)
    cos, sin = rotary(20 * PAGE, 32)
    reader = PagedReader(compiled=True)

    def broken(*args):
        raise RuntimeError("no C++ compiler here")

    reader._function = broken
    with caplog.at_level(logging.WARNING):
        reader.read(kv, slots, cos, sin, torch.float32)
        assert reader.wait_compiled(timeout=60)
        got = reader.read(kv, slots, cos, sin, torch.float32)
    want = PagedReader(compiled=False).read(kv, slots, cos, sin, torch.float32)
    assert not reader.compiled and "no C++ compiler here" in reader.compile_error
    assert "running eagerly" in caplog.text
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_attention_through_compiled_reads_equals_the_eager_reference():
    gen = torch.Generator().manual_seed(3)
    lengths = [300, 290, 17]
    pages = -(-max(lengths) // PAGE)
    kv = pool(torch.float32, (3 * pages + 4) * PAGE, gen)
    block_tables = tables(3, pages, 4, gen)
    cos, sin = rotary(pages * PAGE, 32)
    ops = KernelOps("torch", compiled_reads=True)
    q = torch.randn(3, 4, 32, generator=gen)
    ops.decode_attention(q, kv, block_tables, torch.tensor(lengths), cos, sin, False)
    assert ops.paged_reader.wait_compiled(timeout=600)
    got = ops.decode_attention(q, kv, block_tables, torch.tensor(lengths), cos, sin, True)
    want = paged_decode_attention.reference(q, kv, block_tables, torch.tensor(lengths), cos,
                                            sin, True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    counts = [5, 3, 1]
    rows = torch.randn(sum(counts), 4, 32, generator=gen)
    cu_q = torch.tensor([0, 5, 8, 9])
    past = torch.tensor([n - c for n, c in zip(lengths, counts)])
    for window in (None, 2):
        got = ops.prefill_attention(rows, kv, block_tables, cu_q, past, cos, sin, 5, window)
        want = paged_prefill_attention.reference(rows, kv, block_tables, cu_q, past, cos, sin,
                                                 5, window)
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
        if window is not None:
            torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    assert ops.paged_reader.compiled_kinds() == 1, ops.paged_reader.compile_error


def test_the_environment_sets_whether_readers_compile_by_default(monkeypatch):
    monkeypatch.setenv("STREAMGROK_COMPILED_READS", "0")
    assert not PagedReader().compiled and not KernelOps().paged_reader.compiled
    monkeypatch.setenv("STREAMGROK_COMPILED_READS", "1")
    assert PagedReader().compiled and KernelOps().paged_reader.compiled
    assert not KernelOps(compiled_reads=False).paged_reader.compiled
