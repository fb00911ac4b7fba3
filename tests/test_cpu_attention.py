"""The native CPU decode attention kernel against its PyTorch reference: the fixed-shape and
generic paths, bfloat16 and int8 K/V, every length from 1 to the capacity, inside a compiled graph,
and clear errors for what it does not take."""

from __future__ import annotations

import pytest
import torch

from streamgrok_kernels.cpu_attention import (
    cpu_decode_attention,
    decode_attention_reference,
    native_kernel_available,
)
from streamgrok_kernels.quant import dequantized, quantize_int8


@pytest.fixture(scope="module", autouse=True)
def built():
    assert native_kernel_available(torch.float32), "the native kernel did not build"


def inputs(batch, heads, kv_heads, dim, capacity, dtype, seed, lengths=None):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, dim, generator=gen)
    keys = (torch.randn(batch, kv_heads, capacity, dim, generator=gen) * 2).to(dtype)
    values = torch.randn(batch, kv_heads, capacity, dim, generator=gen).to(dtype)
    if lengths is None:
        lengths = torch.randint(1, capacity + 1, (batch,), generator=gen)
    return q, keys, values, lengths


@pytest.mark.parametrize(("batch", "heads", "kv_heads", "dim", "capacity"), [
    (3, 9, 3, 64, 40),  # SmolLM2's shape: a fixed-size path
    (2, 8, 1, 128, 33),  # a fixed-size path, one KV head
    (4, 4, 4, 64, 7),  # no grouping
    (2, 4, 2, 32, 17),  # head size 32: the generic path
    (1, 18, 2, 64, 21),  # groups of 9: the generic path
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_equals_the_reference(batch, heads, kv_heads, dim, capacity, dtype):
    q, keys, values, lengths = inputs(batch, heads, kv_heads, dim, capacity, dtype,
                                      seed=batch * heads + dim)
    got = cpu_decode_attention(q, keys, values, lengths, dim ** -0.5)
    want = decode_attention_reference(q, keys, values, lengths, dim ** -0.5)
    assert got.dtype == torch.float32 and got.shape == q.shape
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def quantized_inputs(batch, heads, kv_heads, dim, capacity, seed):
    """int8 K/V with a float16 scale per (sequence, head, position), as the cache stores."""
    q, keys, values, lengths = inputs(batch, heads, kv_heads, dim, capacity, torch.float32,
                                      seed)
    k8, k_scales = quantize_int8(keys)
    v8, v_scales = quantize_int8(values)
    return q, k8, v8, k_scales.half(), v_scales.half(), lengths


@pytest.mark.parametrize(("batch", "heads", "kv_heads", "dim", "capacity"), [
    (3, 9, 3, 64, 40), (2, 8, 1, 128, 33), (2, 4, 2, 32, 17), (1, 18, 2, 64, 21)])
def test_int8_keys_and_values_are_read_with_their_row_scales(batch, heads, kv_heads, dim,
                                                             capacity):
    q, keys, values, k_scales, v_scales, lengths = quantized_inputs(
        batch, heads, kv_heads, dim, capacity, seed=batch + heads + dim)
    got = cpu_decode_attention(q, keys, values, lengths, dim ** -0.5, k_scales, v_scales)
    want = decode_attention_reference(q, keys, values, lengths, dim ** -0.5, k_scales,
                                      v_scales)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    # the reference is the float kernel on the dequantized rows: the scales are per row
    as_floats = cpu_decode_attention(q, dequantized(keys, k_scales),
                                     dequantized(values, v_scales), lengths, dim ** -0.5)
    torch.testing.assert_close(got, as_floats, atol=2e-5, rtol=1e-4)


def test_every_length_reads_exactly_its_positions():
    capacity = 19
    q, keys, values, _ = inputs(capacity, 6, 2, 64, capacity, torch.float32, seed=5)
    lengths = torch.arange(1, capacity + 1)
    got = cpu_decode_attention(q, keys, values, lengths, 0.125)
    torch.testing.assert_close(got, decode_attention_reference(q, keys, values, lengths, 0.125),
                               atol=2e-5, rtol=1e-4)
    # length 1 is the first value itself; what lies past a length never matters
    torch.testing.assert_close(got[0], values[0, :, 0].repeat_interleave(3, dim=0))
    poisoned = keys.clone()
    poisoned[0, :, 1:] = float("nan")
    assert torch.equal(cpu_decode_attention(q, poisoned, values, lengths, 0.125)[0], got[0])


def test_large_scores_stay_finite():
    q, keys, values, lengths = inputs(2, 6, 2, 64, 30, torch.float32, seed=6)
    got = cpu_decode_attention(q * 300, keys, values, lengths, 0.125)
    want = decode_attention_reference(q * 300, keys, values, lengths, 0.125)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)


def test_the_op_runs_inside_a_compiled_graph():
    def step(q, keys, values, positions):
        keys = keys.clone()
        keys[:, :, 0] = keys[:, :, 0] * 2
        return cpu_decode_attention(q.tanh(), keys, values, positions + 1, 0.125) + 1

    q, keys, values, lengths = inputs(3, 6, 2, 64, 25, torch.float32, seed=7)
    compiled = torch.compile(step, dynamic=True)
    torch.testing.assert_close(compiled(q, keys, values, lengths - 1),
                               step(q, keys, values, lengths - 1))


def test_what_the_kernel_does_not_take_is_a_clear_error():
    q, keys, values, lengths = inputs(2, 6, 2, 64, 10, torch.float32, seed=8)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or int8"):
        cpu_decode_attention(q, keys.half(), values.half(), lengths, 0.125)
    k8, v8 = keys.to(torch.int8), values.to(torch.int8)
    with pytest.raises(RuntimeError, match="need key_scales and value_scales"):
        cpu_decode_attention(q, k8, v8, lengths, 0.125)
    with pytest.raises(RuntimeError, match="float ones none"):
        cpu_decode_attention(q, keys, values, lengths, 0.125, keys[..., 0].half(),
                             keys[..., 0].half())
    with pytest.raises(RuntimeError, match="scales must be float16"):
        cpu_decode_attention(q, k8, v8, lengths, 0.125, keys[..., 0], keys[..., 0])
    with pytest.raises(RuntimeError, match="q must be float32"):
        cpu_decode_attention(q.double(), keys, values, lengths, 0.125)
    with pytest.raises(RuntimeError, match="outside 1..10"):
        cpu_decode_attention(q, keys, values, torch.tensor([0, 3]), 0.125)
    with pytest.raises(RuntimeError, match="outside 1..10"):
        cpu_decode_attention(q, keys, values, torch.tensor([11, 3]), 0.125)
    assert not native_kernel_available(torch.float16)
