// The float sides of an int8 x int8 matmul with per-row activation scales (w8a8): each row of
// activations quantized to int8 with its own scale, and the int32 products turned back into
// floats, each in one pass over its rows. PyTorch's elementwise ops took eight passes for the
// same work (about a third of a w8a8 prefill). See kernels/cpu_int8.py for the contract and
// the PyTorch reference.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "native_ops.h"

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kRowsPerTask = 4;

// Adding and subtracting 1.5 * 2^23 rounds a float below 2^22 in magnitude to the nearest
// integer, ties to even, as torch.round does, in vector registers (nearbyint is a libm call).
constexpr float kRoundingShift = 12582912.f;

// The row functions are STREAMGROK_EXACT (native_ops.h): the division stays a division (not
// a multiply by 1/s), the rounding shift is not folded away and nothing is contracted into an
// FMA, so the results are the reference's bit for bit.

// levels = round(x / s) clamped to [-127, 127], s = max(max|x|, 1e-8) / 127.
STREAMGROK_EXACT void quantize_row(const float* x, int64_t width, int8_t* levels,
                                   float* scale) {
  float peak = 0.f;
#pragma omp simd reduction(max : peak)
  for (int64_t i = 0; i < width; ++i) {
    const float magnitude = __builtin_fabsf(x[i]);
    peak = magnitude > peak ? magnitude : peak;
  }
  const float s = (peak > 1e-8f ? peak : 1e-8f) / 127.f;
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) {
    float level = (x[i] / s + kRoundingShift) - kRoundingShift;
    level = level > 127.f ? 127.f : (level < -127.f ? -127.f : level);
    levels[i] = static_cast<int8_t>(level);
  }
  *scale = s;
}

std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "quantize_rows: x must be a 2-d float32 CPU tensor, got ", x.scalar_type(), " ",
              x.sizes());
  const at::Tensor rows = x.contiguous();
  const int64_t count = rows.size(0), width = rows.size(1);
  at::Tensor levels = at::empty({count, width}, rows.options().dtype(at::kChar));
  at::Tensor scales = at::empty({count, 1}, rows.options());
  const float* in = rows.data_ptr<float>();
  int8_t* out = levels.data_ptr<int8_t>();
  float* s = scales.data_ptr<float>();
  at::parallel_for(0, count, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(in + r * width, width, out + r * width, s + r);
  });
  return {levels, scales};
}

// out = products * row scale * column scales (+ bias), float32, in the reference's order.
STREAMGROK_EXACT void scale_row(const int32_t* products, float scale, const float* cols,
                                const float* bias, int64_t width, float* out) {
  if (bias != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < width; ++i)
      out[i] = static_cast<float>(products[i]) * scale * cols[i] + bias[i];
  } else {
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) out[i] = static_cast<float>(products[i]) * scale * cols[i];
  }
}

at::Tensor scale_products(const at::Tensor& products, const at::Tensor& row_scales,
                          const at::Tensor& col_scales, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(products.dim() == 2 && products.scalar_type() == at::kInt &&
                  products.device().is_cpu(),
              "scale_products: products must be a 2-d int32 CPU tensor, got ",
              products.scalar_type(), " ", products.sizes());
  const int64_t count = products.size(0), width = products.size(1);
  TORCH_CHECK(row_scales.numel() == count && row_scales.scalar_type() == at::kFloat,
              "scale_products: row_scales must hold ", count, " float32 values, got ",
              row_scales.scalar_type(), " ", row_scales.sizes());
  TORCH_CHECK(col_scales.numel() == width && col_scales.scalar_type() == at::kFloat,
              "scale_products: col_scales must hold ", width, " float32 values, got ",
              col_scales.scalar_type(), " ", col_scales.sizes());
  at::Tensor added;
  if (bias.has_value()) {
    added = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(added.numel() == width, "scale_products: bias must hold ", width,
                " values, got ", added.sizes());
  }
  const at::Tensor p = products.contiguous();
  const at::Tensor rs = row_scales.contiguous(), cs = col_scales.contiguous();
  at::Tensor out = at::empty({count, width}, p.options().dtype(at::kFloat));
  const int32_t* in = p.data_ptr<int32_t>();
  const float* r = rs.data_ptr<float>();
  const float* c = cs.data_ptr<float>();
  const float* b = added.defined() ? added.data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  at::parallel_for(0, count, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) scale_row(in + row * width, r[row], c, b, width, o + row * width);
  });
  return out;
}

// levels and scale of silu(gate) * up, where gate and up are the two halves of one row of
// scaled products (a fused gate/up projection): the float row lives only in `scratch`. The
// exponential is the vectorized library one, so levels can differ from the reference's by
// one where the product falls next to a rounding boundary.
void swiglu_row(const int32_t* products, float scale, const float* cols, int64_t width,
                float* scratch, int8_t* levels, float* level_scale) {
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) {
    const float gate = static_cast<float>(products[i]) * scale * cols[i];
    const float up = static_cast<float>(products[width + i]) * scale * cols[width + i];
    scratch[i] = gate / (1.f + std::exp(-gate)) * up;
  }
  quantize_row(scratch, width, levels, level_scale);
}

std::tuple<at::Tensor, at::Tensor> swiglu_quantize_rows(const at::Tensor& products,
                                                        const at::Tensor& row_scales,
                                                        const at::Tensor& col_scales) {
  TORCH_CHECK(products.dim() == 2 && products.scalar_type() == at::kInt &&
                  products.device().is_cpu() && products.size(1) % 2 == 0,
              "swiglu_quantize_rows: products must be a 2-d int32 CPU tensor of even width "
              "(gate then up), got ", products.scalar_type(), " ", products.sizes());
  const int64_t count = products.size(0), width = products.size(1) / 2;
  TORCH_CHECK(row_scales.numel() == count && row_scales.scalar_type() == at::kFloat,
              "swiglu_quantize_rows: row_scales must hold ", count, " float32 values");
  TORCH_CHECK(col_scales.numel() == 2 * width && col_scales.scalar_type() == at::kFloat,
              "swiglu_quantize_rows: col_scales must hold ", 2 * width, " float32 values");
  const at::Tensor p = products.contiguous();
  const at::Tensor rs = row_scales.contiguous(), cs = col_scales.contiguous();
  at::Tensor levels = at::empty({count, width}, p.options().dtype(at::kChar));
  at::Tensor scales = at::empty({count, 1}, p.options().dtype(at::kFloat));
  const int32_t* in = p.data_ptr<int32_t>();
  const float* r = rs.data_ptr<float>();
  const float* c = cs.data_ptr<float>();
  int8_t* out = levels.data_ptr<int8_t>();
  float* s = scales.data_ptr<float>();
  at::parallel_for(0, count, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(width);
    for (int64_t row = begin; row < end; ++row)
      swiglu_row(in + row * 2 * width, r[row], c, width, scratch.data(), out + row * width,
                 s + row);
  });
  return {levels, scales};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(streamgrok_cpu, m) {
  m.def("quantize_rows(Tensor x) -> (Tensor, Tensor)");
  m.def("scale_products(Tensor products, Tensor row_scales, Tensor col_scales, Tensor? bias)"
        " -> Tensor");
  m.def("swiglu_quantize_rows(Tensor products, Tensor row_scales, Tensor col_scales)"
        " -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(streamgrok_cpu, CPU, m) {
  m.impl("quantize_rows", &quantize_rows);
  m.impl("scale_products", &scale_products);
  m.impl("swiglu_quantize_rows", &swiglu_quantize_rows);
}
