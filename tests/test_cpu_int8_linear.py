"""The native weight-only int8 matmul of a few rows (`kernels/cpu/int8_linear.cpp`: the q4
format's output head, q8 layers) against the float product with the weight it reads, within
the precision of its activation levels; its portable loop; an int8 layer with it."""

from __future__ import annotations

import pytest
import torch
from helpers import random_model, skip_unless_int4_vectorized, tiny_config
from test_cpu_int4 import activation_rows

from streamgrok.model.quantized import (
    EXACT_TOP,
    NATIVE_INT8_MAX_ROWS,
    Int8Linear,
    QuantizedRows,
    quantize_model,
)
from streamgrok_kernels.cpu_int4 import GROUP, Int4Matmul
from streamgrok_kernels.cpu_native import NATIVE_ATTENTION_ENV


def int8_layer(out_features: int, in_features: int, seed: int,
               matmul: Int4Matmul | None = None) -> Int8Linear:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05
    return Int8Linear.from_rows(QuantizedRows.of(weight, "q8"), None, native_matmul=matmul)


def weight_of(layer: Int8Linear) -> torch.Tensor:
    """The weight [out, in] the native kernel multiplies by, in float64."""
    return layer.qweight.double() * layer.row_scales.double()[:, None]


def level_error_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Each activation within 1/508 of its group's level step (peak / 127), times the
    weights' magnitudes, plus float32 rounding."""
    peaks = x.view(x.shape[0], -1, GROUP).abs().amax(-1, keepdim=True)
    step_error = (peaks / 127 / 508).expand(-1, -1, GROUP).reshape(x.shape).double()
    return step_error @ weight.abs().t() * 1.01 + (x.double().abs() @ weight.abs().t()) * 1e-5 \
        + 1e-6


@pytest.mark.parametrize(("rows", "out_features", "in_features"),
                         [(1, 64, 32), (1, 1000, 576), (3, 7, 96), (15, 130, 1536)])
def test_products_equal_the_float_product_within_the_activation_levels(
        native_int4, rows, out_features, in_features):
    layer = int8_layer(out_features, in_features, seed=rows)
    x = activation_rows(rows, in_features, seed=out_features)
    weight = weight_of(layer)
    exact = x.double() @ weight.t()
    bound = level_error_bound(x, weight)
    for portable in (False, True):
        got = torch.ops.streamgrok_cpu.int8_linear(x, layer.qweight, layer.row_scales,
                                                   portable)
        assert got.shape == (rows, out_features) and got.dtype == torch.float32
        assert ((got.double() - exact).abs() <= bound).all(), f"portable={portable}"
        assert torch.equal(got[0], torch.zeros(out_features))  # zero rows give zeros


def test_bad_operands_get_clear_errors(native_int4):
    layer = int8_layer(64, 64, seed=7)
    with pytest.raises(RuntimeError, match="x must be a 2-d float32"):
        torch.ops.streamgrok_cpu.int8_linear(torch.randn(2, 64).double(), layer.qweight,
                                             layer.row_scales)
    with pytest.raises(RuntimeError, match="weight must be int8"):
        torch.ops.streamgrok_cpu.int8_linear(torch.randn(2, 128), layer.qweight,
                                             layer.row_scales)
    with pytest.raises(RuntimeError, match="scales must be float32"):
        torch.ops.streamgrok_cpu.int8_linear(torch.randn(2, 64), layer.qweight,
                                             layer.row_scales[:5])


def test_an_int8_layer_multiplies_a_few_rows_natively(native_int4):
    skip_unless_int4_vectorized(native_int4.in_use, native_int4.native.error)
    fast, plain = int8_layer(192, 96, seed=8, matmul=native_int4), int8_layer(192, 96, seed=8)
    x = activation_rows(4, 96, seed=9)
    assert fast.native_matmul.serves(x) and not plain.native_matmul.serves(x)
    exact = x.double() @ weight_of(fast).t()
    assert ((fast(x).double() - exact).abs() <= level_error_bound(x, weight_of(fast))).all()
    # PyTorch's weight-only kernel rounds activations to bfloat16: the native products are
    # closer to the exact ones
    assert (fast(x).double() - exact).abs().max() < (plain(x).double() - exact).abs().max()
    many = activation_rows(NATIVE_INT8_MAX_ROWS, 96, seed=10)  # past the few rows: PyTorch's
    torch.testing.assert_close(fast(many), plain(many))


@pytest.mark.parametrize("weights", ["q8", "q4"])
def test_only_the_output_head_takes_the_native_int8_kernel(monkeypatch, weights):
    """The native int8 kernel beats PyTorch's on the head's many rows, not on a projection's
    few: q8 projections keep PyTorch's kernel; q4 and q8 heads are int8 and take it."""
    monkeypatch.setenv(NATIVE_ATTENTION_ENV, "1")
    model = quantize_model(random_model(tiny_config(vocab_size=320)), weights)
    assert isinstance(model.output, Int8Linear) and model.output.native_matmul.native.enabled
    projections = [m for m in model.modules()
                   if isinstance(m, Int8Linear) and m is not model.output]
    assert (weights == "q8") == bool(projections)
    assert not any(m.native_matmul.native.enabled for m in projections)


def coarse_error_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Each activation within half its group's level step (peak / 127), times the weights'
    magnitudes, plus float32 rounding: the head kernel's products outside the largest."""
    peaks = x.view(x.shape[0], -1, GROUP).abs().amax(-1, keepdim=True)
    step_error = (peaks / 127 / 2).expand(-1, -1, GROUP).reshape(x.shape).double()
    return step_error @ weight.abs().t() * 1.01 + (x.double().abs() @ weight.abs().t()) * 1e-5 \
        + 1e-6


@pytest.mark.parametrize(("rows", "out_features", "in_features", "exact"),
                         [(2, 1000, 576, 32), (3, 130, 96, 8), (2, 20, 64, 32)])
def test_the_head_kernel_is_float32_in_each_rows_largest_logits(
        native_int4, rows, out_features, in_features, exact):
    layer = int8_layer(out_features, in_features, seed=rows + 20)
    x = activation_rows(rows, in_features, seed=out_features + 1)
    weight = weight_of(layer)
    truth = x.double() @ weight.t()
    kept = min(exact, out_features)
    for portable in (False, True):
        got = torch.ops.streamgrok_cpu.int8_head(x, layer.qweight, layer.row_scales, exact,
                                                 portable)
        assert got.shape == (rows, out_features) and got.dtype == torch.float32
        assert ((got.double() - truth).abs() <= coarse_error_bound(x, weight)).all()
        # the columns recomputed are the coarse products' largest: their top half stays on top
        top = got.topk(kept if kept == out_features else kept // 2, dim=-1).indices
        torch.testing.assert_close(got.gather(-1, top).double(), truth.gather(-1, top),
                                   rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(-1), truth.argmax(-1)), f"portable={portable}"
        assert torch.equal(got[0], torch.zeros(out_features))  # zero rows give zeros
    with pytest.raises(RuntimeError, match="exact must be >= 0"):
        torch.ops.streamgrok_cpu.int8_head(x, layer.qweight, layer.row_scales, -1)


def test_an_int8_head_multiplies_natively_by_the_head_kernel(native_int4):
    skip_unless_int4_vectorized(native_int4.in_use, native_int4.native.error)
    gen = torch.Generator().manual_seed(12)
    rows = QuantizedRows.of(torch.randn(4096, 96, generator=gen) * 0.05, "q8")
    head = Int8Linear.from_rows(rows, None, native_matmul=native_int4, head=True)
    x = activation_rows(3, 96, seed=13) * 20  # logits of several units, as a model's
    weight = weight_of(head)
    truth = x.double() @ weight.t()
    got = head(x)
    assert torch.equal(got, torch.ops.streamgrok_cpu.int8_head(x, head.qweight,
                                                               head.row_scales, EXACT_TOP))
    top = got.topk(EXACT_TOP // 2, dim=-1).indices
    torch.testing.assert_close(got.gather(-1, top).double(), truth.gather(-1, top),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), truth.argmax(-1))
