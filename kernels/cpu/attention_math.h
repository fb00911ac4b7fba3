// Arithmetic shared by the CPU attention kernels (decode_attention.cpp, paged_attention.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace streamgrok_cpu {

// Asks for `bytes` from `p` to be brought into the cache ahead of their use. A thread's
// stream of K/V is read at a few GB/s per core, so the arithmetic between reads adds to the
// read time unless the next rows are already on their way.
// An asm statement where there is one: GCC deletes a loop of nothing but __builtin_prefetch
// as if it were empty.
inline void prefetch(const void* p, int64_t bytes) {
  const char* first = static_cast<const char*>(p);
  for (int64_t offset = 0; offset < bytes; offset += 64) {
#if defined(__x86_64__)
    asm volatile("prefetcht0 %0" : : "m"(first[offset]));
#elif defined(__aarch64__)
    asm volatile("prfm pldl1keep, %0" : : "Q"(first[offset]));
#else
    __builtin_prefetch(first + offset);
#endif
  }
}

inline float to_float(float x) { return x; }

inline float to_float(int8_t x) { return static_cast<float>(x); }

inline float to_float(uint16_t bf16) {
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// e^x for x <= 0 (a score minus the row's peak) as straight-line arithmetic the compiler
// vectorizes (std::exp is a scalar call: it took most of the kernel's time). Cephes' expf:
// x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6 polynomial, 2^n from the exponent bits;
// below -87 it returns e^-87 (~1.6e-38) instead of underflowing.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float power;
  std::memcpy(&power, &bits, sizeof(power));
  return p * power;
}

// s[0:length] replaced by exp(s - peak), where peak is the row's largest score (written to
// *peak); returns their sum. A softmax left unnormalized, for rows whose keys are split into
// parts that are combined afterwards.
inline float exponentials(float* s, int64_t length, float* peak_out) {
  float peak = s[0];
#pragma omp simd reduction(max : peak)
  for (int64_t t = 0; t < length; ++t) peak = std::max(peak, s[t]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < length; ++t) {
    s[t] = exp_nonpositive(s[t] - peak);
    sum += s[t];
  }
  *peak_out = peak;
  return sum;
}

// s[0:length] replaced by its softmax.
inline void softmax_row(float* s, int64_t length) {
  float peak;
  const float inverse = 1.f / exponentials(s, length, &peak);
#pragma omp simd
  for (int64_t t = 0; t < length; ++t) s[t] *= inverse;
}

// `rows` rows of `length` scores, one after another, each replaced by its softmax.
inline void softmax_rows(float* scores, int64_t rows, int64_t length) {
  for (int64_t r = 0; r < rows; ++r) softmax_row(scores + r * length, length);
}

}  // namespace streamgrok_cpu
