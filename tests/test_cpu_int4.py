"""The native int4 matmul of a few rows (`kernels/cpu/int4_linear.cpp`) against the float
product with the weight it reads, within the precision of its activation levels; its
portable loop against its vectorized one; an int4 layer with it and without."""

from __future__ import annotations

import pytest
import torch
from helpers import random_model, skip_unless_int4_vectorized, tiny_config

from streamgrok.model.quantized import (
    DEQUANTIZED_MIN_ROWS,
    NATIVE_INT4_DEQUANTIZED_MIN_ROWS,
    Int4Linear,
    prefill_dtype,
    quantize_model,
    wait_native_int4,
)
from streamgrok_kernels.cpu_int4 import (
    GROUP,
    Int4Matmul,
    int4_linear_reference,
    unpacked_transposed,
)
from streamgrok_kernels.cpu_native import NATIVE_ATTENTION_ENV


def int4_layer(out_features: int, in_features: int, seed: int,
               matmul: Int4Matmul | None = None) -> Int4Linear:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05
    weight[:, :GROUP] += 0.1  # a group whose zero is far from 0
    layer = Int4Linear(weight, None, int4_matmul=matmul)
    assert layer.unpacks
    return layer


def activation_rows(rows: int, width: int, seed: int) -> torch.Tensor:
    """Rows of very different ranges, a row of zeros and a group of zeros."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen) * torch.logspace(-3, 2, rows)[:, None]
    x[0] = 0.0
    x[-1, GROUP:2 * GROUP] = 0.0
    return x


def level_error_bound(x: torch.Tensor, layer: Int4Linear) -> torch.Tensor:
    """The most the kernel may differ from the exact product: each activation within
    1/508 of its group's level step (peak / 127), times the weights' magnitudes, plus
    float32 rounding."""
    peaks = x.view(x.shape[0], -1, GROUP).abs().amax(-1, keepdim=True)
    step_error = (peaks / 127 / 508).expand(-1, -1, GROUP).reshape(x.shape)
    weights = unpacked_transposed(layer.packed, layer.scales_and_zeros).double()
    exact_scale = (x.double().abs() @ weights.abs())
    return step_error.double() @ weights.abs() * 1.01 + exact_scale * 1e-5 + 1e-6


@pytest.mark.parametrize(("rows", "out_features", "in_features"),
                         [(1, 64, 32), (1, 192, 576), (2, 128, 96), (3, 64, 1536),
                          (17, 320, 64)])
def test_products_equal_the_float_product_within_the_activation_levels(
        native_int4, rows, out_features, in_features):
    layer = int4_layer(out_features, in_features, seed=rows)
    x = activation_rows(rows, in_features, seed=out_features)
    exact = x.double() @ unpacked_transposed(layer.packed, layer.scales_and_zeros).double()
    bound = level_error_bound(x, layer)
    for portable in (False, True):
        got = torch.ops.streamgrok_cpu.int4_linear(x, layer.packed, layer.scales_and_zeros,
                                                   portable)
        assert got.shape == (rows, out_features) and got.dtype == torch.float32
        assert ((got.double() - exact).abs() <= bound).all(), f"portable={portable}"
        assert torch.equal(got[0], torch.zeros(out_features))  # zero rows give zeros


def test_the_portable_loop_gives_the_vectorized_products(native_int4):
    layer = int4_layer(256, 192, seed=4)
    x = activation_rows(5, 192, seed=5)
    vectorized = torch.ops.streamgrok_cpu.int4_linear(x, layer.packed, layer.scales_and_zeros)
    portable = torch.ops.streamgrok_cpu.int4_linear(x, layer.packed, layer.scales_and_zeros,
                                                    True)
    torch.testing.assert_close(vectorized, portable, atol=1e-5, rtol=1e-5)


def test_non_contiguous_rows_are_read_as_their_values(native_int4):
    layer = int4_layer(64, 64, seed=6)
    x = torch.randn(64, 3).t()  # [3, 64], strided
    torch.testing.assert_close(
        torch.ops.streamgrok_cpu.int4_linear(x, layer.packed, layer.scales_and_zeros),
        torch.ops.streamgrok_cpu.int4_linear(x.contiguous(), layer.packed,
                                             layer.scales_and_zeros))


def test_bad_operands_get_clear_errors(native_int4):
    layer = int4_layer(64, 64, seed=7)
    with pytest.raises(RuntimeError, match="x must be a 2-d float32"):
        torch.ops.streamgrok_cpu.int4_linear(torch.randn(2, 64).double(), layer.packed,
                                             layer.scales_and_zeros)
    with pytest.raises(RuntimeError, match="packed must be uint8"):
        torch.ops.streamgrok_cpu.int4_linear(torch.randn(2, 128), layer.packed,
                                             layer.scales_and_zeros)
    with pytest.raises(RuntimeError, match="divisible"):
        torch.ops.streamgrok_cpu.int4_linear(torch.randn(2, 40), layer.packed,
                                             layer.scales_and_zeros)


def test_an_int4_layer_multiplies_natively_once_built(native_int4):
    fast, reference = int4_layer(192, 96, seed=8, matmul=native_int4), int4_layer(192, 96, seed=8)
    x = activation_rows(4, 96, seed=9)
    skip_unless_int4_vectorized(native_int4.in_use, native_int4.native.error)
    assert not reference.int4_matmul.serves(x)  # off unless a model's loader turns it on
    got, want = fast(x), reference(x)
    exact = int4_linear_reference(x, fast.packed, fast.scales_and_zeros)
    bound = level_error_bound(x, fast)
    assert ((got.double() - exact.double()).abs() <= bound).all()
    # and PyTorch's kernel gives the same products, up to that bound and its own rounding
    # (on some CPUs it rounds activations to bfloat16; on others it is exact)
    assert ((got.double() - want.double()).abs()
            <= bound + (want.double() - exact.double()).abs()).all()


def test_a_q4_model_shares_one_native_switch(monkeypatch):
    monkeypatch.setenv(NATIVE_ATTENTION_ENV, "1")
    model = quantize_model(random_model(tiny_config()), "q4")
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert len({id(layer.int4_matmul) for layer in layers}) == 1
    assert wait_native_int4(model) == layers[0].int4_matmul.in_use
    monkeypatch.setenv(NATIVE_ATTENTION_ENV, "0")
    assert not wait_native_int4(quantize_model(random_model(tiny_config()), "q4"))


def test_native_layers_dequantize_from_a_shorter_chunk(native_int4):
    """With the native kernels a chunk shorter than NATIVE_INT4_DEQUANTIZED_MIN_ROWS
    multiplies by the int4 kernel, and one that long by the weight the native unpacking
    builds (bfloat16 where the CPU has it), which equals PyTorch's unpacking."""
    skip_unless_int4_vectorized(native_int4.in_use, native_int4.native.error)
    assert NATIVE_INT4_DEQUANTIZED_MIN_ROWS < DEQUANTIZED_MIN_ROWS
    layer = int4_layer(128, 64, seed=10, matmul=native_int4)
    x = activation_rows(NATIVE_INT4_DEQUANTIZED_MIN_ROWS - 1, 64, seed=11)
    exact = int4_linear_reference(x, layer.packed, layer.scales_and_zeros).double()
    assert ((layer(x).double() - exact).abs() <= level_error_bound(x, layer)).all()
    longer = activation_rows(NATIVE_INT4_DEQUANTIZED_MIN_ROWS, 64, seed=12)
    weight = unpacked_transposed(layer.packed, layer.scales_and_zeros).to(prefill_dtype())
    dequantized = torch.matmul(longer.to(prefill_dtype()), weight)
    torch.testing.assert_close(layer(longer), dequantized.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 32), (192, 576), (576, 1536)])
def test_native_unpacking_equals_pytorchs(native_int4, dtype, out_features, in_features):
    """The native unpacking of the layout to W^T gives PyTorch's float32 unpacking, rounded
    once to `dtype` (within one float32 rounding of it, which may move a bfloat16 tie)."""
    layer = int4_layer(out_features, in_features, seed=13)
    reference = unpacked_transposed(layer.packed, layer.scales_and_zeros)
    unpacked = native_int4.unpacked_transposed(layer.packed, layer.scales_and_zeros, dtype)
    assert unpacked.dtype == dtype and unpacked.shape == (in_features, out_features)
    pairs = layer.scales_and_zeros.double()  # [in / 32, out, (scale, zero)]
    terms = (16 * pairs[..., 0].abs() + pairs[..., 1].abs()).repeat_interleave(GROUP, dim=0)
    rounding = 2.0 ** -8 if dtype == torch.bfloat16 else 0.0  # half a bfloat16 step
    bound = reference.double().abs() * rounding + terms * 2.0 ** -21
    assert ((unpacked.double() - reference.double()).abs() <= bound).all()
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.streamgrok_cpu.int4_unpack_transposed(layer.packed, layer.scales_and_zeros,
                                                        torch.float16)
