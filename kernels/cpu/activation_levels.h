// Activations as integer levels, for the native int4 and int8 matmuls (int4_linear.cpp,
// int8_linear.cpp): each group of 32 activations of a row becomes int8 levels plus int8
// levels of what they left over, x ~ step * (coarse + fine / 254), a precision near 1e-5 of
// the group's peak, with the group's exact float sum beside them.
#pragma once

#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace streamgrok_cpu {

constexpr int64_t kGroup = 32;  // input channels per activation step (and int4 scale/zero)
constexpr float kResidualSteps = 254.f;  // a level step's worth of leftover in residual levels
constexpr int64_t kQuantizeGrainRows = 4;  // rows a thread quantizes at least

// Each group of 32 activations of each row: int8 levels `coarse` and `fine` with
// x ~ step * (coarse + fine / 254), and the group's exact float sum (the zeros and the -8
// multiply it).
struct QuantizedRows {
  int64_t width = 0, groups = 0;
  std::vector<int8_t> coarse, fine;
  std::vector<float> step, sum;

  QuantizedRows(const float* x, int64_t rows, int64_t width_)
      : width(width_), groups(width_ / kGroup), coarse(rows * width_), fine(rows * width_),
        step(rows * groups), sum(rows * groups) {
    // rows in parallel where there are several (at 32 rows of SmolLM2's widths, quantizing
    // one group at a time on one thread took half the matmuls' time)
    at::parallel_for(0, rows, kQuantizeGrainRows, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t g = 0; g < groups; ++g) quantize_group(x + r * width + g * kGroup, r, g);
    });
  }

#if defined(__AVX512F__)
  // The scalar version's arithmetic, 16 values at a time.
  void quantize_group(const float* v, int64_t row, int64_t g) {
    const __m512 halves[2] = {_mm512_loadu_ps(v), _mm512_loadu_ps(v + 16)};
    const float peak = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_abs_ps(halves[0]), _mm512_abs_ps(halves[1])));
    const float d = peak > 0.f ? peak / 127.f : 1.f;
    const __m512 dv = _mm512_set1_ps(d), residual_steps = _mm512_set1_ps(kResidualSteps);
    const __m512 low = _mm512_set1_ps(-127.f), high = _mm512_set1_ps(127.f);
    constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const int64_t at = row * width + g * kGroup;
    for (int h = 0; h < 2; ++h) {
      const __m512 level = _mm512_roundscale_ps(_mm512_div_ps(halves[h], dv), kNearest);
      const __m512 left = _mm512_div_ps(_mm512_sub_ps(halves[h], _mm512_mul_ps(level, dv)), dv);
      __m512 rest = _mm512_roundscale_ps(_mm512_mul_ps(left, residual_steps), kNearest);
      rest = _mm512_min_ps(_mm512_max_ps(rest, low), high);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(coarse.data() + at + 16 * h),
                       _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(level)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(fine.data() + at + 16 * h),
                       _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(rest)));
    }
    step[row * groups + g] = d;
    sum[row * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(halves[0], halves[1]));
  }
#else
  void quantize_group(const float* v, int64_t row, int64_t g) {
    float peak = 0.f, total = 0.f;
    for (int64_t i = 0; i < kGroup; ++i) {
      peak = std::max(peak, std::fabs(v[i]));
      total += v[i];
    }
    const float d = peak > 0.f ? peak / 127.f : 1.f;
    const int64_t at = row * width + g * kGroup;
    for (int64_t i = 0; i < kGroup; ++i) {
      const float level = std::nearbyint(v[i] / d);
      coarse[at + i] = static_cast<int8_t>(level);
      const float rest = std::nearbyint((v[i] - level * d) / d * kResidualSteps);
      fine[at + i] = static_cast<int8_t>(std::clamp(rest, -127.f, 127.f));
    }
    step[row * groups + g] = d;
    sum[row * groups + g] = total;
  }
#endif
};

}  // namespace streamgrok_cpu
