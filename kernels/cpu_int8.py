"""The float sides of w8a8's integer matmul on the CPU: rows of activations quantized to int8,
and the int32 products scaled back to floats.

`Int8Linear` with int8 activations (streamgrok/model/quantized.py) multiplies x W^T as
levels(x) @ W_int8^T by oneDNN's int8 GEMM, with each row of x quantized on its own scale
(s = max |x| / 127) and the products scaled by the row's and the weight row's scales. In
PyTorch's elementwise ops that is eight passes over the rows (abs, amax, clamp, divide,
round, clamp, cast; then two multiplies over the products), about a third of an eager w8a8
prefill here. The native kernels (`kernels/cpu/int8_rows.cpp`, built with the other native
CPU kernels, `kernels.cpu_native`) do each side in one pass per row, with results equal to
the references below bit for bit. A compiled decode step keeps the references: inductor
fuses them into its own loops. Between a fused gate/up projection and the down projection,
`Int8Rows.swiglu` goes from the one's int32 products to the other's int8 input in one pass
(the float activations of the feed-forward layer never leave a row's scratch).
"""

from __future__ import annotations

import torch

from streamgrok_kernels.cpu_native import NativeBuild

LEVELS = 127.0  # int8 levels each side of zero (symmetric: -128 is never used)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, in] float32 as int8 levels [rows, in] and a float32 scale per row
    [rows, 1]: levels = round(x / s) (ties to even) clamped to +-127, s = max |x| / 127
    (at least 1e-8 / 127)."""
    scales = x.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-8) / LEVELS
    levels = (x / scales).round_().clamp_(-LEVELS, LEVELS).to(torch.int8)
    return levels, scales


def scale_products_reference(products: torch.Tensor, row_scales: torch.Tensor,
                             col_scales: torch.Tensor, bias: torch.Tensor | None
                             ) -> torch.Tensor:
    """int32 products [rows, out] times each row's scale [rows, 1] times each output
    column's [out] (float32), plus `bias` [out] if given."""
    out = (products * row_scales).mul_(col_scales)
    return out if bias is None else out + bias.to(out.dtype)


def swiglu_levels_reference(products: torch.Tensor, row_scales: torch.Tensor,
                            col_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up quantized by rows, where gate and up are the two halves of the scaled
    products [rows, 2 * width] of a fused gate/up projection: levels [rows, width] and
    scales [rows, 1]."""
    gate, up = scale_products_reference(products, row_scales, col_scales, None).chunk(2, -1)
    return quantize_rows_reference(torch.nn.functional.silu(gate) * up)


class Int8Rows:
    """Quantizes rows and scales products, natively where the kernels are built (see
    `kernels.cpu_native.NativeBuild`: until then, and where they cannot be, the references
    serve; no call waits for the compiler), for float32 CPU tensors outside a compiled
    graph. One per model, shared by its w8a8 layers."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.native = NativeBuild("int8 rows", enabled)

    def serves(self, x: torch.Tensor) -> bool:
        """Whether calls on `x` run natively (starting the build if need be)."""
        return (x.device.type == "cpu" and not torch.compiler.is_compiling()
                and self.native.ready())

    def _serves_products(self, products: torch.Tensor, col_scales: torch.Tensor) -> bool:
        return (products.dim() == 2 and products.dtype == torch.int32
                and col_scales.dtype == torch.float32 and self.serves(products))

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`quantize_rows_reference(x.float())`."""
        x = x.float()
        if x.dim() == 2 and self.serves(x):
            return torch.ops.streamgrok_cpu.quantize_rows(x)
        return quantize_rows_reference(x)

    def scale(self, products: torch.Tensor, row_scales: torch.Tensor,
              col_scales: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`scale_products_reference(products, row_scales, col_scales, bias)`."""
        if self._serves_products(products, col_scales):
            return torch.ops.streamgrok_cpu.scale_products(products, row_scales, col_scales,
                                                           bias)
        return scale_products_reference(products, row_scales, col_scales, bias)

    def swiglu(self, products: torch.Tensor, row_scales: torch.Tensor,
               col_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`swiglu_levels_reference(products, row_scales, col_scales)`, natively in one pass
        (levels may differ by one next to a rounding boundary: another exponential)."""
        if self._serves_products(products, col_scales):
            return torch.ops.streamgrok_cpu.swiglu_quantize_rows(products, row_scales,
                                                                 col_scales)
        return swiglu_levels_reference(products, row_scales, col_scales)
