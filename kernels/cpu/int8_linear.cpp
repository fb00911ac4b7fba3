// x W^T for a few rows of x and an int8 weight [out, in] with one float32 scale per output
// row (weight-only int8: the q4 format's output head, q8 layers; see kernels/cpu_int8.py for
// the contract and the reference).
//
// PyTorch's weight-only int8 kernel turns every weight into a float before multiplying. This
// one multiplies integers, as the int4 kernel does: each group of 32 activations becomes int8
// levels plus int8 levels of what they left over (activation_levels.h), and AVX2 multiplies
// them by the weights 32 at a time: maddubs takes |activation| (unsigned) times the weight
// with the activation's sign (int8; |products| <= 2 x 127 x 127 < 2^15), madd widens the
// pairs to 32 bits. Elsewhere a portable loop does the same arithmetic (the integer sums are
// exact, so both give the same products up to the float sums' order).
//
// A model's output head (int8_head) needs its exact values only where a token could be
// chosen: it multiplies by the coarse levels alone (half the integer work; each logit then
// within about 1/254 of its groups' peak activations), and recomputes each row's `exact`
// largest logits from the float32 activations, so greedy and nucleus choices see float32
// products.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "activation_levels.h"
#include "attention_math.h"
#include "native_ops.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <functional>
#include <queue>
#include <utility>
#include <vector>

namespace {

using streamgrok_cpu::kGroup;
using streamgrok_cpu::kResidualSteps;
using streamgrok_cpu::QuantizedRows;

constexpr int64_t kRowsPerTask = 16;  // output rows a thread takes at least
constexpr int64_t kMaxRows = 64;  // rows of x per pass over the weights (their sums fit L1)

// Output row `r` of every row of x in [first, last): sum over groups of step * (coarse . w +
// fine . w / 254), times the row's scale (without the fine term unless `Fine`).
template <bool Fine>
void row_portable(const QuantizedRows& x, int64_t first, int64_t last, const int8_t* w,
                  float scale, float* out, int64_t out_stride) {
  for (int64_t i = first; i < last; ++i) {
    float total = 0.f;
    for (int64_t g = 0; g < x.groups; ++g) {
      int32_t coarse = 0, fine = 0;
      const int64_t at = i * x.width + g * kGroup;
      for (int64_t k = 0; k < kGroup; ++k) {
        coarse += static_cast<int32_t>(x.coarse[at + k]) * w[g * kGroup + k];
        if (Fine) fine += static_cast<int32_t>(x.fine[at + k]) * w[g * kGroup + k];
      }
      const float step = x.step[i * x.groups + g];
      total += static_cast<float>(coarse) * step +
               static_cast<float>(fine) * (step / kResidualSteps);
    }
    out[i * out_stride] = total * scale;
  }
}

#if defined(__AVX2__) && defined(__FMA__)

constexpr int64_t kOutTile = 4;  // output rows that share each load of the activations

// |levels| . (weights with the levels' signs), pairs widened: 8 int32 sums of 4 products.
inline __m256i products_of_32(__m256i magnitude, __m256i levels, __m256i weights,
                              __m256i ones) {
  return _mm256_madd_epi16(
      _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(weights, levels)), ones);
}

// The four vectors' sums, as four floats.
inline __m128 four_sums(const __m256* v) {
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

// Output rows r..r+3 of every row of x in [first, last) (the fine term only if `Fine`).
template <bool Fine>
void rows_avx2(const QuantizedRows& x, int64_t first, int64_t last, const int8_t* w,
               int64_t width, const float* scale, float* out, int64_t out_stride) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 sums[kMaxRows][kOutTile];
  for (int64_t i = first; i < last; ++i)
    for (int64_t j = 0; j < kOutTile; ++j) sums[i - first][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < x.groups; ++g) {
    __m256i weights[kOutTile];
    for (int64_t j = 0; j < kOutTile; ++j)
      weights[j] = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(w + j * width + g * kGroup));
    for (int64_t i = first; i < last; ++i) {
      const int64_t at = i * x.width + g * kGroup;
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.coarse.data() + at));
      const __m256i a_magnitude = _mm256_sign_epi8(a, a);
      const float step = x.step[i * x.groups + g];
      const __m256 d = _mm256_set1_ps(step);
      if (!Fine) {
        for (int64_t j = 0; j < kOutTile; ++j) {
          const __m256i coarse = products_of_32(a_magnitude, a, weights[j], ones);
          sums[i - first][j] =
              _mm256_fmadd_ps(_mm256_cvtepi32_ps(coarse), d, sums[i - first][j]);
        }
        continue;
      }
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.fine.data() + at));
      const __m256i b_magnitude = _mm256_sign_epi8(b, b);
      const __m256 fine_d = _mm256_set1_ps(step / kResidualSteps);
      for (int64_t j = 0; j < kOutTile; ++j) {
        const __m256i coarse = products_of_32(a_magnitude, a, weights[j], ones);
        const __m256i fine = products_of_32(b_magnitude, b, weights[j], ones);
        __m256 sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(coarse), d, sums[i - first][j]);
        sums[i - first][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(fine), fine_d, sum);
      }
    }
  }
  const __m128 scales = _mm_loadu_ps(scale);
  for (int64_t i = first; i < last; ++i) {
    alignas(16) float result[kOutTile];
    _mm_store_ps(result, _mm_mul_ps(four_sums(sums[i - first]), scales));
    for (int64_t j = 0; j < kOutTile; ++j) out[i * out_stride + j] = result[j];
  }
}

#endif

// Checks int8_linear's and int8_head's arguments.
void check_arguments(const char* op, const at::Tensor& x, const at::Tensor& weight,
                     const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), op,
              ": x must be a 2-d float32 CPU tensor, got ", x.scalar_type(), " ", x.sizes());
  const int64_t width = x.size(1);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.size(1) == width,
              op, ": weight must be int8 [out, ", width, "], got ", weight.scalar_type(), " ",
              weight.sizes());
  TORCH_CHECK(width % kGroup == 0, op, ": needs input sizes divisible by ", kGroup, ", got ",
              width);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == weight.size(0), op,
              ": scales must be float32 [", weight.size(0), "], got ", scales.scalar_type(), " ",
              scales.sizes());
}

// x W^T times the row scales, [rows, out] float32 (with the fine levels if `Fine`).
template <bool Fine>
at::Tensor products(const at::Tensor& input, const at::Tensor& levels,
                    const at::Tensor& row_scales, bool portable) {
  const int64_t rows = input.size(0), width = input.size(1), out_features = levels.size(0);
  const QuantizedRows quantized(input.data_ptr<float>(), rows, width);
  at::Tensor out = at::empty({rows, out_features}, input.options());
  const int8_t* w = levels.data_ptr<int8_t>();
  const float* s = row_scales.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, out_features, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t first = 0; first < rows; first += kMaxRows) {
      const int64_t last = std::min(rows, first + kMaxRows);
      int64_t r = begin;
#if defined(__AVX2__) && defined(__FMA__)
      for (; !portable && r + kOutTile <= end; r += kOutTile) {
        streamgrok_cpu::prefetch(w + (r + kRowsPerTask) * width, kOutTile * width);
        rows_avx2<Fine>(quantized, first, last, w + r * width, width, s + r, o + r,
                        out_features);
      }
#endif
      for (; r < end; ++r)
        row_portable<Fine>(quantized, first, last, w + r * width, s[r], o + r, out_features);
    }
  });
  return out;
}

// The `k` largest entries' columns of `row` [n] (in no particular order).
std::vector<int64_t> largest(const float* row, int64_t n, int64_t k) {
  using Entry = std::pair<float, int64_t>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> kept;  // smallest on top
  for (int64_t j = 0; j < n; ++j) {
    if (static_cast<int64_t>(kept.size()) < k) {
      kept.emplace(row[j], j);
    } else if (row[j] > kept.top().first) {
      kept.pop();
      kept.emplace(row[j], j);
    }
  }
  std::vector<int64_t> columns;
  columns.reserve(kept.size());
  for (; !kept.empty(); kept.pop()) columns.push_back(kept.top().second);
  return columns;
}

// x . w times the scale, in float32 (w one int8 output row).
float exact_product(const float* x, const int8_t* w, int64_t width, float scale) {
  float total = 0.f;
  for (int64_t k = 0; k < width; ++k) total += x[k] * static_cast<float>(w[k]);
  return total * scale;
}

}  // namespace

namespace streamgrok_cpu {

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                       bool portable) {
  check_arguments("int8_linear", x, weight, scales);
  return products<true>(x.contiguous(), weight.contiguous(), scales.contiguous(), portable);
}

at::Tensor int8_head(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                     int64_t exact, bool portable) {
  check_arguments("int8_head", x, weight, scales);
  TORCH_CHECK(exact >= 0, "int8_head: exact must be >= 0, got ", exact);
  const at::Tensor input = x.contiguous(), levels = weight.contiguous();
  const at::Tensor row_scales = scales.contiguous();
  at::Tensor out = products<false>(input, levels, row_scales, portable);
  const int64_t rows = input.size(0), width = input.size(1), out_features = levels.size(0);
  const int64_t k = std::min(exact, out_features);
  if (k == 0) return out;
  const float* xs = input.data_ptr<float>();
  const int8_t* w = levels.data_ptr<int8_t>();
  const float* s = row_scales.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = o + i * out_features;
      for (const int64_t j : largest(row, out_features, k))
        row[j] = exact_product(xs + i * width, w + j * width, width, s[j]);
    }
  });
  return out;
}

}  // namespace streamgrok_cpu

TORCH_LIBRARY_FRAGMENT(streamgrok_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scales, bool portable=False) -> Tensor");
  m.def("int8_head(Tensor x, Tensor weight, Tensor scales, int exact, bool portable=False) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(streamgrok_cpu, CPU, m) {
  m.impl("int8_linear", &streamgrok_cpu::int8_linear);
  m.impl("int8_head", &streamgrok_cpu::int8_head);
}
