"""The native CPU kernels of w8a8's float sides (quantizing activation rows, scaling int32
products) against their PyTorch references, bit for bit; a w8a8 layer and model with them
and without; and a quantized model's prefill attending in bfloat16 on the contiguous cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import random_model, tiny_config, write_gguf

from streamgrok.loading.loader import load_model
from streamgrok.model.batch import BatchMetadata
from streamgrok.model.contiguous_cache import ContiguousKVCache
from streamgrok.model.generate import Generator
from streamgrok.model.quantized import (
    Int8Linear,
    prefill_attention_dtype,
    prefill_dtype,
    quantize_model,
    swiglu_w8a8,
    wait_native_int8,
)
from streamgrok_kernels.cpu_int8 import (
    Int8Rows,
    quantize_rows_reference,
    scale_products_reference,
    swiglu_levels_reference,
)
from streamgrok_kernels.rotary import apply_rotary


@pytest.fixture(scope="module")
def native() -> Int8Rows:
    rows = Int8Rows(enabled=True)
    assert rows.native.wait_ready(), f"the native kernels did not build: {rows.native.error}"
    return rows


def activation_rows(rows: int, width: int, seed: int) -> torch.Tensor:
    """Rows of very different ranges, a row of zeros, and values on rounding ties."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen) * torch.logspace(-3, 2, rows)[:, None]
    x[0] = 0.0
    if rows > 2:  # levels exactly halfway: 127 * k / 254 for a row whose peak is 127
        x[1] = torch.arange(width) % 255 - 127.0
        x[1, : width // 2] = (torch.arange(width // 2) % 254 - 127) + 0.5
        x[1, -1] = 127.0
    return x


@pytest.mark.parametrize(("rows", "width"), [(1, 576), (3, 64), (37, 1536), (512, 96)])
def test_quantized_rows_equal_the_reference(native, rows, width):
    x = activation_rows(rows, width, seed=rows)
    levels, scales = native.quantize(x)
    expected_levels, expected_scales = quantize_rows_reference(x)
    assert levels.dtype == torch.int8 and scales.shape == (rows, 1)
    assert torch.equal(scales, expected_scales)
    assert torch.equal(levels, expected_levels)


def test_rounding_ties_go_to_even(native):
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 126.5, -126.5]])
    levels, _ = native.quantize(x)
    assert levels.tolist() == [[127, 0, 2, 2, 0, -2, 126, -126]]


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("rows", "width"), [(1, 960), (5, 17), (300, 576)])
def test_scaled_products_equal_the_reference(native, rows, width, with_bias):
    gen = torch.Generator().manual_seed(width)
    products = torch.randint(-(1 << 20), 1 << 20, (rows, width), generator=gen,
                             dtype=torch.int32)
    row_scales = torch.rand(rows, 1, generator=gen) * 0.01
    col_scales = torch.rand(width, generator=gen) * 0.02
    bias = torch.randn(width, generator=gen) if with_bias else None
    out = native.scale(products, row_scales, col_scales, bias)
    assert torch.equal(out, scale_products_reference(products, row_scales, col_scales, bias))


@pytest.mark.parametrize(("rows", "width"), [(1, 1536), (9, 64), (300, 256)])
def test_swiglu_levels_match_the_reference_within_one_level(native, rows, width):
    gen = torch.Generator().manual_seed(rows)
    products = torch.randint(-(1 << 16), 1 << 16, (rows, 2 * width), generator=gen,
                             dtype=torch.int32)
    row_scales = torch.rand(rows, 1, generator=gen) * 1e-3
    col_scales = torch.rand(2 * width, generator=gen) * 1e-2
    levels, scales = native.swiglu(products, row_scales, col_scales)
    expected_levels, expected_scales = swiglu_levels_reference(products, row_scales, col_scales)
    assert levels.shape == (rows, width) and levels.dtype == torch.int8
    torch.testing.assert_close(scales, expected_scales, rtol=1e-5, atol=0)
    differ = (levels.int() - expected_levels.int()).abs()
    assert differ.max() <= 1 and differ.float().mean() < 0.01


def test_non_contiguous_rows_are_read_as_their_values(native):
    x = activation_rows(40, 128, seed=3).t()  # a transposed view: 128 rows of 40
    levels, scales = native.quantize(x)
    expected = quantize_rows_reference(x.contiguous())
    assert torch.equal(levels, expected[0]) and torch.equal(scales, expected[1])


def test_bad_operands_get_clear_errors(native):
    with pytest.raises(RuntimeError, match="row_scales must hold 4"):
        torch.ops.streamgrok_cpu.scale_products(
            torch.zeros(4, 8, dtype=torch.int32), torch.ones(3, 1), torch.ones(8), None)
    with pytest.raises(RuntimeError, match="2-d float32"):
        torch.ops.streamgrok_cpu.quantize_rows(torch.zeros(2, 3, 4))


def test_switched_off_or_off_the_cpu_the_references_serve():
    off = Int8Rows(enabled=False)
    x = activation_rows(6, 32, seed=1)
    assert not off.native.ready()
    assert all(torch.equal(a, b) for a, b in zip(off.quantize(x), quantize_rows_reference(x)))
    assert Int8Rows().native.enabled is False  # the test suite sets the switch to 0


@pytest.mark.parametrize("rows", [1, 7, 200])
def test_a_w8a8_layer_gives_the_same_output_with_the_native_rows(native, rows):
    torch.manual_seed(rows)
    weight, bias = torch.randn(96, 160) * 0.05, torch.randn(96)
    reference = Int8Linear(weight, bias, int8_activations=True)
    fast = Int8Linear(weight, bias, int8_activations=True, int8_rows=native)
    x = torch.randn(rows, 160) * torch.linspace(0.1, 3, rows)[:, None]
    assert torch.equal(fast(x), reference(x))


def test_the_fused_feed_forward_is_the_w8a8_layers_one_after_the_other(native):
    torch.manual_seed(3)
    gate_up = Int8Linear(torch.randn(192, 64) * 0.1, None, True, native)
    down = Int8Linear(torch.randn(64, 96) * 0.1, None, True, native)
    x = torch.randn(2, 7, 64)
    fused = swiglu_w8a8(gate_up, down, x)
    gate, up = gate_up(x).chunk(2, dim=-1)
    separate = down(F.silu(gate) * up)
    assert fused.shape == (2, 7, 64)
    torch.testing.assert_close(fused, separate, rtol=0.02, atol=0.02)  # a level here and there
    off = Int8Linear(torch.randn(192, 64), None, True)  # PyTorch's ops: not fused
    assert swiglu_w8a8(off, down, x) is None
    assert swiglu_w8a8(gate_up, Int8Linear(torch.randn(64, 96), None), x) is None


def test_a_w8a8_model_gives_the_same_logits_with_the_native_kernels(tmp_path, monkeypatch):
    config = tiny_config(max_positions=256, hidden_size=128, intermediate_size=256,
                         head_dim=32)
    path = write_gguf(tmp_path / "tiny.gguf", random_model(config, seed=8))
    monkeypatch.setenv("STREAMGROK_NATIVE_ATTENTION", "1")
    native = load_model(path, weights="w8a8")
    monkeypatch.setenv("STREAMGROK_NATIVE_ATTENTION", "0")
    reference = load_model(path, weights="w8a8")
    assert wait_native_int8(native.model) and not wait_native_int8(reference.model)
    ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    logits = []
    for loaded in (native, reference):
        cache = ContiguousKVCache(config, 1, 64, torch.float32, "cpu")
        with torch.inference_mode():
            prefill = loaded.model(ids, BatchMetadata([0], [40], logit_rows=torch.arange(40)),
                                   cache)
            step = loaded.model(ids[:1], BatchMetadata.build([0], [1]), cache)
        logits.append(torch.cat([prefill, step]))
    # the same but for the fused feed-forward's exponential (a level here and there)
    torch.testing.assert_close(logits[0], logits[1], rtol=0.02, atol=0.02)
    assert (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean() >= 0.95


def test_quantized_models_prefill_attention_in_the_prefill_dtype():
    model = random_model(tiny_config(), seed=1)
    assert prefill_attention_dtype(model) is None  # float models keep their cache's dtype
    assert prefill_attention_dtype(quantize_model(model, "q8")) == prefill_dtype()


def test_prefill_attends_in_the_caches_prefill_dtype():
    config = tiny_config(max_positions=128)
    model = random_model(config, seed=3)
    ids = torch.randint(0, config.vocab_size, (50,), generator=torch.Generator().manual_seed(4))
    rows = BatchMetadata([0], [50], logit_rows=torch.arange(50))
    outputs = {}
    for dtype in (None, torch.bfloat16):
        cache = ContiguousKVCache(config, 1, 64, torch.float32, "cpu", prefill_dtype=dtype)
        with torch.inference_mode():
            outputs[dtype] = model(ids, rows, cache)
    assert not torch.equal(outputs[None], outputs[torch.bfloat16])  # it did attend in bf16
    torch.testing.assert_close(outputs[torch.bfloat16], outputs[None], rtol=0.05, atol=0.05)
    # the K/V stored stay float32 (decode reads them at full precision)
    assert cache.k[0].dtype == torch.float32


def test_the_generator_of_a_quantized_model_caches_and_prefills_in_its_prefill_dtype(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", random_model(tiny_config(), seed=5))
    quantized = Generator(load_model(path, weights="q8"), capacity=32).cache
    assert quantized.prefill_dtype == prefill_dtype() == quantized.k[0].dtype  # K/V too
    exact = Generator(load_model(path), capacity=32).cache
    assert exact.prefill_dtype == torch.float32 == exact.k[0].dtype


def test_bfloat16_prefill_attention_matches_sdpa_in_bfloat16():
    """The cache's causal prefill is SDPA on the rounded operands (same formula, other dtype)."""
    config = tiny_config(max_positions=64)
    cache = ContiguousKVCache(config, 1, 32, torch.float32, "cpu", prefill_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(6)
    heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
    q = torch.randn(20, heads, dim, generator=gen)
    k = torch.randn(20, kv_heads, dim, generator=gen)
    v = torch.randn(20, kv_heads, dim, generator=gen)
    batch = BatchMetadata.build([0], [20])
    cache.prepare(batch)
    out = cache.attend(0, q, k, v, batch)
    step = batch.backend_state
    rq = apply_rotary(q, step.cos, step.sin).transpose(0, 1).bfloat16()
    rk = apply_rotary(k, step.cos, step.sin).transpose(0, 1).bfloat16()
    expected = F.scaled_dot_product_attention(rq, rk, v.transpose(0, 1).bfloat16(),
                                              is_causal=True, enable_gqa=True)
    assert torch.equal(out, expected.transpose(0, 1).float())
