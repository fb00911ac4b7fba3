// The parts of a native decode step that do not depend on where the K/V live: the layer loop
// (norms, the int4 matmuls, SwiGLU, residuals) around an attention callback, the final norm
// and the head, and the small per-row loops between the matmuls. decode_step.cpp attends over
// contiguous per-sequence stores, paged_decode_step.cpp over the paged pool's page tables.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "moe_ffn.h"
#include "native_ops.h"

namespace streamgrok_cpu::step {

constexpr int64_t kLayerTensors = 10;  // the weights of a layer, in the steps' order
constexpr float kInt8Max = 127.f;      // kernels/quant.py: INT8_MAX
constexpr float kMinAbsMax = 1e-4f;    // kernels/quant.py: MIN_ABS_MAX
// Rows a thread takes at least in the loops between the matmuls: several sequences' norms,
// rotary, K/V stores and SwiGLU run in parallel, one sequence's on the calling thread.
constexpr int64_t kRowGrain = 8;

// out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * weight (kernels/rmsnorm.py's reference).
inline void rms_norm(const float* x, const float* weight, int64_t rows, int64_t width,
                     float eps, float* out) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * width;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < width; ++i) squares += row[i] * row[i];
      const float inverse = 1.f / std::sqrt(squares / static_cast<float>(width) + eps);
      float* o = out + r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) o[i] = row[i] * inverse * weight[i];
    }
  });
}

// Half-split rotary of one head (x[:d/2] pairs with x[d/2:]) by cos/sin [d/2].
inline void rotate(const float* x, const float* cos, const float* sin, int64_t dim,
                   float* out) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    out[i] = x[i] * cos[i] - x[i + half] * sin[i];
    out[i + half] = x[i + half] * cos[i] + x[i] * sin[i];
  }
}

// kernels/quant.py's quantize_int8 of one head's row, bit for bit: levels and the scale,
// which is float16 (the store's) and quantized against as stored.
STREAMGROK_EXACT inline at::Half quantize_head(const float* x, int64_t dim, int8_t* levels) {
  float peak = 0.f;
  for (int64_t i = 0; i < dim; ++i) peak = std::max(peak, __builtin_fabsf(x[i]));
  const at::Half stored(std::max(peak, kMinAbsMax) / kInt8Max);
  const float scale = static_cast<float>(stored);
  for (int64_t i = 0; i < dim; ++i) {
    const float scaled = x[i] / scale;
    const float level = std::min(__builtin_floorf(__builtin_fabsf(scaled) + 0.5f), kInt8Max);
    levels[i] = static_cast<int8_t>(scaled < 0.f ? -level : level);
  }
  return stored;
}

// Writes one head's row `x` as element `row` of `rows` (float32, bfloat16, or int8 with its
// float16 scale at `scales[row]`), each row `dim` wide.
inline void store_head(const at::Tensor& rows, const at::Tensor& scales, int64_t row,
                       const float* x, int64_t dim) {
  switch (rows.scalar_type()) {
    case at::kFloat:
      std::memcpy(rows.data_ptr<float>() + row * dim, x, sizeof(float) * dim);
      break;
    case at::kBFloat16: {
      at::BFloat16* out = rows.data_ptr<at::BFloat16>() + row * dim;
      for (int64_t i = 0; i < dim; ++i) out[i] = at::BFloat16(x[i]);
      break;
    }
    default:
      scales.data_ptr<at::Half>()[row] =
          quantize_head(x, dim, rows.data_ptr<int8_t>() + row * dim);
  }
}

// x += y, rows [rows, width].
inline void add_into(float* x, const float* y, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin * width; i < end * width; ++i) x[i] += y[i];
  });
}

// act[b] = silu(gate[b]) * up[b], gate_up [B, 2 inner] holding gate's columns then up's.
inline at::Tensor swiglu(const at::Tensor& gate_up) {
  const int64_t batch = gate_up.size(0), inner = gate_up.size(1) / 2;
  at::Tensor act = at::empty({batch, inner}, gate_up.options());
  const float* gu = gate_up.data_ptr<float>();
  float* ap = act.data_ptr<float>();
  at::parallel_for(0, batch, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* gate = gu + b * 2 * inner;
      const float* up = gate + inner;
      float* a = ap + b * inner;
#pragma omp simd
      for (int64_t i = 0; i < inner; ++i) a[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  });
  return act;
}

// Checks the weights' count and norms for `layers` layers of width `hidden`; returns how many
// tensors follow the layers: 3 (the final norm and a head's two) or 1 (the final norm only).
inline int64_t check_weights(const char* op, at::TensorList weights, int64_t layers,
                             int64_t hidden) {
  const int64_t extra = static_cast<int64_t>(weights.size()) - kLayerTensors * layers;
  TORCH_CHECK(extra == 3 || extra == 1, op, ": ", kLayerTensors,
              " weights per layer and 3 more (or 1, without the head)");
  const auto check_norm = [&](const at::Tensor& norm) {
    TORCH_CHECK(norm.scalar_type() == at::kFloat && norm.is_contiguous() &&
                    norm.numel() == hidden,
                op, ": norm weights must be float32 [hidden]");
  };
  for (int64_t l = 0; l < layers; ++l) {
    check_norm(weights[kLayerTensors * l]);
    check_norm(weights[kLayerTensors * l + 5]);
  }
  check_norm(weights[kLayerTensors * layers]);
  return extra;
}

// Runs every layer on the residual stream `embedded` [B, hidden] float32 and returns it.
// `attend(layer, qkv)` gets the layer's q/k/v matmul output [B, (H + 2 KVH) D] (biases added,
// not rotated) and returns the attention output [B, H D] float32; it stores the new K/V.
// The feed-forward of a layer `moe` calls sparse is its mixture of experts (the layer's own
// MLP weights are then placeholders).
template <typename Attend>
at::Tensor run_layers(const at::Tensor& embedded, at::TensorList weights,
                      at::TensorList qkv_biases, int64_t layers, int64_t qkv_width, float eps,
                      const MixtureOfExperts& moe, Attend&& attend) {
  at::Tensor x = embedded.contiguous().clone();
  at::Tensor h = at::empty_like(x);
  const int64_t batch = x.size(0), hidden = x.size(1);
  float* xp = x.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + kLayerTensors * l;
    rms_norm(xp, w[0].data_ptr<float>(), batch, hidden, eps, hp);
    at::Tensor qkv = int4_linear(h, w[1], w[2], false);
    TORCH_CHECK(qkv.size(1) == qkv_width, "decode step: the q/k/v matmul has ", qkv.size(1),
                " outputs, not ", qkv_width);
    if (!qkv_biases.empty()) qkv.add_(qkv_biases[l]);
    const at::Tensor attended = attend(l, qkv);
    at::Tensor out = int4_linear(attended, w[3], w[4], false);
    add_into(xp, out.data_ptr<float>(), batch, hidden);
    rms_norm(xp, w[5].data_ptr<float>(), batch, hidden, eps, hp);
    at::Tensor down = moe.sparse(l) ? moe.forward(l, h)
                                    : int4_linear(swiglu(int4_linear(h, w[6], w[7], false)),
                                                  w[8], w[9], false);
    add_into(xp, down.data_ptr<float>(), batch, hidden);
  }
  return x;
}

// The final norm of the residual stream `x`, times the head when `weights` end with one
// (int4: packed and scales; int8: int8 rows and float32 scales, by int8_head): logits
// [B, vocab] float32, else the normed hidden state [B, hidden].
inline at::Tensor finish(const at::Tensor& x, at::TensorList weights, int64_t layers,
                         float eps) {
  const at::Tensor* last = weights.data() + kLayerTensors * layers;
  at::Tensor h = at::empty_like(x);
  rms_norm(x.data_ptr<float>(), last[0].data_ptr<float>(), x.size(0), x.size(1), eps,
           h.data_ptr<float>());
  if (static_cast<int64_t>(weights.size()) == kLayerTensors * layers + 1) return h;
  if (last[1].scalar_type() == at::kChar)
    return int8_head(h, last[1], last[2], kHeadExactTop, false);
  return int4_linear(h, last[1], last[2], false);
}

}  // namespace streamgrok_cpu::step
