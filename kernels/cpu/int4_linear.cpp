// x W^T for a few rows of x and an int4 weight in PyTorch's CPU int4 layout (the layout of
// _weight_int4pack_mm_for_cpu; see kernels/cpu_int4.py for the contract and the reference).
//
// A decode step reads every weight once for one row (or a few); PyTorch's kernel converts
// each weight to a float before multiplying and ran at 7-13 GB/s here, under the ~22 GB/s the
// cores read. This one multiplies integers: each group of 32 activations is quantized to
// int8 levels plus int8 levels of what they left over (x ~ d * (a + b / 254), a precision
// near 1e-5 of the group's peak, finer than the bfloat16 activations PyTorch's kernel takes),
// and AVX-512 VNNI sums four level products per instruction straight from the weights'
// nibbles, which VBMI's byte permutes turn from the layout's [k][64 rows] order into the
// [rows][4 k] order the instruction reads. On AVX2 (no VNNI), byte and word unpacks make the
// same [rows][4 k] order and maddubs multiplies pairs of levels into 16-bit sums, which a
// group's eight steps add without overflow (8 x 2 x 15 x 127 < 2^15) before one widening.
// Elsewhere a portable loop does the same arithmetic (the integer sums are exact, so every
// path gives the same products).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "activation_levels.h"
#include "attention_math.h"
#include "native_ops.h"

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define STREAMGROK_INT4_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define STREAMGROK_INT4_AVX2 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

using streamgrok_cpu::kGroup;
using streamgrok_cpu::kResidualSteps;
using streamgrok_cpu::QuantizedRows;

constexpr int64_t kBlock = 64;  // output rows per block of the layout

// The layout: block j of output rows 64j..64j+63 is [in][32] bytes; byte c of input k holds
// row c in its low nibble and row c + 32 in its high one. Scales and zeros are
// [in / 32][out][2] bfloat16; a weight is (level - 8) * scale + zero.

// One group's 64 results of one row, from its integer sums: what the row's group adds,
// scale * (products - 8 sum) + zero * sum, as scale * products + (zero - 8 scale) * sum (the
// second factor is the group's and output's, shared by every row).
inline float group_result(int32_t coarse_sum, int32_t fine_sum, float step, float sum,
                          float scale, float zero) {
  const float products = static_cast<float>(coarse_sum) * step +
                         static_cast<float>(fine_sum) * (step / kResidualSteps);
  return scale * products + (zero - 8.f * scale) * sum;
}

// Portable: block `block`'s 64 outputs of every row.
void block_portable(const QuantizedRows& x, int64_t rows, const uint8_t* weights,
                    const uint16_t* scales_zeros, int64_t out_features, int64_t block,
                    float* out) {
  const int64_t width = x.width, first = block * kBlock;
  std::vector<int32_t> coarse(kBlock), fine(kBlock);
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<float> result(kBlock, 0.f);
    for (int64_t g = 0; g < x.groups; ++g) {
      std::fill(coarse.begin(), coarse.end(), 0);
      std::fill(fine.begin(), fine.end(), 0);
      for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) {
        const uint8_t* bytes = weights + k * (kBlock / 2);
        const int32_t a = x.coarse[r * width + k], b = x.fine[r * width + k];
        for (int64_t c = 0; c < kBlock / 2; ++c) {
          const int32_t low = bytes[c] & 15, high = bytes[c] >> 4;
          coarse[c] += low * a;
          fine[c] += low * b;
          coarse[c + kBlock / 2] += high * a;
          fine[c + kBlock / 2] += high * b;
        }
      }
      const uint16_t* pairs = scales_zeros + (g * out_features + first) * 2;
      for (int64_t j = 0; j < kBlock; ++j) {
        result[j] += group_result(coarse[j], fine[j], x.step[r * x.groups + g],
                                  x.sum[r * x.groups + g], streamgrok_cpu::to_float(pairs[2 * j]),
                                  streamgrok_cpu::to_float(pairs[2 * j + 1]));
      }
    }
    std::memcpy(out + r * out_features + first, result.data(), sizeof(float) * kBlock);
  }
}

#ifdef STREAMGROK_INT4_VNNI

// Byte permutes that take two vectors of [2 k][32 bytes] (k..k+3) to [16 rows][4 k] levels:
// `first_rows` the rows 0-15 of the 32 a vector's nibbles hold, `last_rows` rows 16-31.
struct Permutes {
  __m512i first_rows, last_rows;
  Permutes() {
    alignas(64) uint8_t first[64], last[64];
    for (int j = 0; j < 16; ++j)
      for (int k = 0; k < 4; ++k) {
        first[4 * j + k] = static_cast<uint8_t>(32 * k + j);
        last[4 * j + k] = static_cast<uint8_t>(32 * k + 16 + j);
      }
    first_rows = _mm512_load_si512(first);
    last_rows = _mm512_load_si512(last);
  }
};

constexpr int kSteps = kGroup / 4;  // four inputs a step (a VNNI product sums four)
constexpr int64_t kGroupBytes = kGroup * (kBlock / 2);  // a block's weights of one group
// Groups fetched ahead of their use: a core streams a few GB/s of weights on its own; asked
// for ahead, the two cores read at nearer their shared rate (SmolLM2's 121 matmuls of one
// row, alternating runs: 1.0-1.4x faster, noisy).
constexpr int64_t kGroupsAhead = 2;

// A group's 32 x 64 levels as kSteps x 4 vectors of [16 rows][4 k]: rows 0-15, 16-31 (low
// nibbles), 32-47, 48-63 (high nibbles).
inline void group_levels(const uint8_t* bytes, const Permutes& permutes, __m512i* levels) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int s = 0; s < kSteps; ++s, bytes += 4 * (kBlock / 2)) {
    const __m512i first = _mm512_loadu_si512(bytes), second = _mm512_loadu_si512(bytes + 64);
    const __m512i low0 = _mm512_and_si512(first, nibble), low1 = _mm512_and_si512(second, nibble);
    const __m512i high0 = _mm512_and_si512(_mm512_srli_epi16(first, 4), nibble);
    const __m512i high1 = _mm512_and_si512(_mm512_srli_epi16(second, 4), nibble);
    levels[4 * s + 0] = _mm512_permutex2var_epi8(low0, permutes.first_rows, low1);
    levels[4 * s + 1] = _mm512_permutex2var_epi8(low0, permutes.last_rows, low1);
    levels[4 * s + 2] = _mm512_permutex2var_epi8(high0, permutes.first_rows, high1);
    levels[4 * s + 3] = _mm512_permutex2var_epi8(high0, permutes.last_rows, high1);
  }
}

inline __m512i broadcast_four(const int8_t* levels) {
  int32_t four;
  std::memcpy(&four, levels, sizeof(four));
  return _mm512_set1_epi32(four);
}

// `R` rows' sums over one group, added to their results [rows][64].
template <int R>
inline void rows_of_group(const QuantizedRows& x, int64_t row, int64_t g, const __m512i* levels,
                          const __m512* scales, const __m512* zeros, float* results) {
  __m512i coarse[R][4], fine[R][4];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < 4; ++p) coarse[r][p] = fine[r][p] = _mm512_setzero_si512();
  for (int s = 0; s < kSteps; ++s)
    for (int r = 0; r < R; ++r) {
      const int64_t at = (row + r) * x.width + g * kGroup + 4 * s;
      const __m512i a = broadcast_four(x.coarse.data() + at), b = broadcast_four(x.fine.data() + at);
      for (int p = 0; p < 4; ++p) {
        coarse[r][p] = _mm512_dpbusd_epi32(coarse[r][p], levels[4 * s + p], a);
        fine[r][p] = _mm512_dpbusd_epi32(fine[r][p], levels[4 * s + p], b);
      }
    }
  for (int r = 0; r < R; ++r) {
    const float step = x.step[(row + r) * x.groups + g], sum = x.sum[(row + r) * x.groups + g];
    const __m512 d = _mm512_set1_ps(step), fine_d = _mm512_set1_ps(step / kResidualSteps);
    const __m512 total = _mm512_set1_ps(sum);
    float* result = results + (row + r) * kBlock;
    for (int p = 0; p < 4; ++p) {
      __m512 products = _mm512_mul_ps(_mm512_cvtepi32_ps(coarse[r][p]), d);
      products = _mm512_fmadd_ps(_mm512_cvtepi32_ps(fine[r][p]), fine_d, products);
      __m512 out = _mm512_loadu_ps(result + 16 * p);
      out = _mm512_fmadd_ps(scales[p], products, out);
      out = _mm512_fmadd_ps(zeros[p], total, out);
      _mm512_storeu_ps(result + 16 * p, out);
    }
  }
}

// Block `block`'s 64 outputs of every row: each group's levels permuted once, then every
// row's sums over them, two rows at a time (their accumulators fill the registers).
void block_vnni(const QuantizedRows& x, int64_t rows, const uint8_t* weights,
                const uint16_t* scales_zeros, int64_t out_features, int64_t block,
                const Permutes& permutes, float* results, float* out) {
  const int64_t first = block * kBlock;
  const __m512i high_half = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const __m512 eight = _mm512_set1_ps(8.f);
  std::fill(results, results + rows * kBlock, 0.f);
  __m512i levels[4 * kSteps];
  for (int64_t g = 0; g < x.groups; ++g) {
    // the weights ahead run on into the next block's (a thread's blocks are consecutive)
    streamgrok_cpu::prefetch(weights + (g + kGroupsAhead) * kGroupBytes, kGroupBytes);
    if (g + kGroupsAhead < x.groups)
      streamgrok_cpu::prefetch(scales_zeros + ((g + kGroupsAhead) * out_features + first) * 2,
                               kBlock * 2 * sizeof(uint16_t));
    group_levels(weights + g * kGroupBytes, permutes, levels);
    // a (scale, zero) pair is one 32-bit word: scale in the low half, zero in the high one
    const uint16_t* pairs = scales_zeros + (g * out_features + first) * 2;
    __m512 scales[4], zeros[4];
    for (int p = 0; p < 4; ++p) {
      const __m512i words = _mm512_loadu_si512(pairs + 32 * p);
      scales[p] = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
      // zero - 8 scale: the levels' offset of 8 folded in once for every row (group_result)
      zeros[p] = _mm512_fnmadd_ps(eight, scales[p],
                                  _mm512_castsi512_ps(_mm512_and_si512(words, high_half)));
    }
    int64_t r = 0;
    for (; r + 2 <= rows; r += 2) rows_of_group<2>(x, r, g, levels, scales, zeros, results);
    for (; r < rows; ++r) rows_of_group<1>(x, r, g, levels, scales, zeros, results);
  }
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(out + r * out_features + first, results + r * kBlock, sizeof(float) * kBlock);
}

#endif

#ifdef STREAMGROK_INT4_AVX2

constexpr int kSteps = kGroup / 4;  // four inputs a step, as the VNNI path takes them
constexpr int64_t kGroupBytes = kGroup * (kBlock / 2);  // a block's weights of one group
constexpr int64_t kGroupsAhead = 2;  // groups fetched ahead of their use (as block_vnni)

// A group's 32 x 64 levels as [kSteps][8] vectors of [8 rows][4 k] bytes. Vector 4 h + p of a
// step holds, for the half h (0: rows 0-31 from the low nibbles, 1: rows 32-63 from the high
// ones), the rows {4p..4p+3, 16+4p..16+4p+3} of that half: the lane order the unpacks leave,
// put right once per group by `rows_in_order`.
inline void group_levels_avx2(const uint8_t* bytes, __m256i* levels) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int s = 0; s < kSteps; ++s, bytes += 4 * (kBlock / 2)) {
    __m256i k[4];
    for (int i = 0; i < 4; ++i)
      k[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + i * (kBlock / 2)));
    for (int h = 0; h < 2; ++h) {
      __m256i n[4];
      for (int i = 0; i < 4; ++i)
        n[i] = h == 0 ? _mm256_and_si256(k[i], nibble)
                      : _mm256_and_si256(_mm256_srli_epi16(k[i], 4), nibble);
      const __m256i pairs01_low = _mm256_unpacklo_epi8(n[0], n[1]);  // rows 0-7, 16-23
      const __m256i pairs23_low = _mm256_unpacklo_epi8(n[2], n[3]);
      const __m256i pairs01_high = _mm256_unpackhi_epi8(n[0], n[1]);  // rows 8-15, 24-31
      const __m256i pairs23_high = _mm256_unpackhi_epi8(n[2], n[3]);
      __m256i* out = levels + s * 8 + 4 * h;
      out[0] = _mm256_unpacklo_epi16(pairs01_low, pairs23_low);    // rows 0-3, 16-19
      out[1] = _mm256_unpackhi_epi16(pairs01_low, pairs23_low);    // rows 4-7, 20-23
      out[2] = _mm256_unpacklo_epi16(pairs01_high, pairs23_high);  // rows 8-11, 24-27
      out[3] = _mm256_unpackhi_epi16(pairs01_high, pairs23_high);  // rows 12-15, 28-31
    }
  }
}

inline __m256i broadcast_four_avx2(const int8_t* levels) {
  int32_t four;
  std::memcpy(&four, levels, sizeof(four));
  return _mm256_set1_epi32(four);
}

// The four sums vectors of a half (in the unpacks' row order) as rows 0-7, 8-15, 16-23, 24-31.
inline void rows_in_order(const __m256i* sums, __m256i* ordered) {
  ordered[0] = _mm256_permute2x128_si256(sums[0], sums[1], 0x20);
  ordered[1] = _mm256_permute2x128_si256(sums[2], sums[3], 0x20);
  ordered[2] = _mm256_permute2x128_si256(sums[0], sums[1], 0x31);
  ordered[3] = _mm256_permute2x128_si256(sums[2], sums[3], 0x31);
}

// One row's sums over one group for the 32 rows of half `h`, added to its results [64].
inline void row_half_of_group(const QuantizedRows& x, int64_t row, int64_t g, int h,
                              const __m256i* levels, const __m256* scales, const __m256* zeros,
                              float* result) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i coarse[4], fine[4];
  for (int p = 0; p < 4; ++p) coarse[p] = fine[p] = _mm256_setzero_si256();
  const int64_t at = row * x.width + g * kGroup;
  // Unrolled by two, not fully: fully unrolled, GCC summed each accumulator's eight products
  // as a tree, kept all 64 live and spilled them to the stack (a store and a load per
  // product); 32 rows of SmolLM2's matmuls took 1.4-1.7x longer.
#pragma GCC unroll 2
  for (int s = 0; s < kSteps; ++s) {
    const __m256i a = broadcast_four_avx2(x.coarse.data() + at + 4 * s);
    const __m256i b = broadcast_four_avx2(x.fine.data() + at + 4 * s);
    const __m256i* step_levels = levels + s * 8 + 4 * h;
    for (int p = 0; p < 4; ++p) {
      coarse[p] = _mm256_add_epi16(coarse[p], _mm256_maddubs_epi16(step_levels[p], a));
      fine[p] = _mm256_add_epi16(fine[p], _mm256_maddubs_epi16(step_levels[p], b));
    }
  }
  for (int p = 0; p < 4; ++p) {
    coarse[p] = _mm256_madd_epi16(coarse[p], ones);
    fine[p] = _mm256_madd_epi16(fine[p], ones);
  }
  __m256i coarse_rows[4], fine_rows[4];
  rows_in_order(coarse, coarse_rows);
  rows_in_order(fine, fine_rows);
  const float step = x.step[row * x.groups + g], sum = x.sum[row * x.groups + g];
  const __m256 d = _mm256_set1_ps(step), fine_d = _mm256_set1_ps(step / kResidualSteps);
  const __m256 total = _mm256_set1_ps(sum);
  for (int p = 0; p < 4; ++p) {
    __m256 products = _mm256_mul_ps(_mm256_cvtepi32_ps(coarse_rows[p]), d);
    products = _mm256_fmadd_ps(_mm256_cvtepi32_ps(fine_rows[p]), fine_d, products);
    float* out = result + 32 * h + 8 * p;
    __m256 value = _mm256_loadu_ps(out);
    value = _mm256_fmadd_ps(scales[4 * h + p], products, value);
    value = _mm256_fmadd_ps(zeros[4 * h + p], total, value);
    _mm256_storeu_ps(out, value);
  }
}

// Block `block`'s 64 outputs of every row: each group's levels reordered once, then every
// row's sums over them, half a block at a time (a half's accumulators fill the registers).
void block_avx2(const QuantizedRows& x, int64_t rows, const uint8_t* weights,
                const uint16_t* scales_zeros, int64_t out_features, int64_t block,
                float* results, float* out) {
  const int64_t first = block * kBlock;
  const __m256i high_half = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const __m256 eight = _mm256_set1_ps(8.f);
  std::fill(results, results + rows * kBlock, 0.f);
  alignas(32) __m256i levels[8 * kSteps];
  for (int64_t g = 0; g < x.groups; ++g) {
    streamgrok_cpu::prefetch(weights + (g + kGroupsAhead) * kGroupBytes, kGroupBytes);
    if (g + kGroupsAhead < x.groups)
      streamgrok_cpu::prefetch(scales_zeros + ((g + kGroupsAhead) * out_features + first) * 2,
                               kBlock * 2 * sizeof(uint16_t));
    group_levels_avx2(weights + g * kGroupBytes, levels);
    // a (scale, zero) pair is one 32-bit word: scale in the low half, zero in the high one
    const uint16_t* pairs = scales_zeros + (g * out_features + first) * 2;
    __m256 scales[8], zeros[8];
    for (int p = 0; p < 8; ++p) {
      const __m256i words =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + 16 * p));
      scales[p] = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
      zeros[p] = _mm256_fnmadd_ps(eight, scales[p],
                                  _mm256_castsi256_ps(_mm256_and_si256(words, high_half)));
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int h = 0; h < 2; ++h)
        row_half_of_group(x, r, g, h, levels, scales, zeros, results + r * kBlock);
  }
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(out + r * out_features + first, results + r * kBlock, sizeof(float) * kBlock);
}

#endif

// That `packed` and `scales_and_zeros` are the layout of a weight [out, in_features].
void check_layout(const char* op, const at::Tensor& packed, const at::Tensor& scales_and_zeros,
                  int64_t in_features) {
  const int64_t out_features = packed.size(0);
  TORCH_CHECK(in_features % kGroup == 0 && out_features % kBlock == 0, op,
              ": needs input sizes divisible by ", kGroup, " and output sizes by ", kBlock,
              ", got ", out_features, "x", in_features);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte &&
                  packed.size(1) == in_features / 2,
              op, ": packed must be uint8 [", out_features, ", ", in_features / 2, "], got ",
              packed.scalar_type(), " ", packed.sizes());
  TORCH_CHECK(scales_and_zeros.scalar_type() == at::kBFloat16 &&
                  scales_and_zeros.sizes() ==
                      at::IntArrayRef({in_features / kGroup, out_features, 2}),
              op, ": scales_and_zeros must be bfloat16 [", in_features / kGroup, ", ",
              out_features, ", 2], got ", scales_and_zeros.scalar_type(), " ",
              scales_and_zeros.sizes());
}

}  // namespace

namespace streamgrok_cpu {

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed,
                       const at::Tensor& scales_and_zeros, bool portable) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "int4_linear: x must be a 2-d float32 CPU tensor, got ", x.scalar_type(), " ",
              x.sizes());
  const int64_t rows = x.size(0), width = x.size(1), out_features = packed.size(0);
  check_layout("int4_linear", packed, scales_and_zeros, width);
  const at::Tensor input = x.contiguous(), weights = packed.contiguous();
  const at::Tensor pairs = scales_and_zeros.contiguous();
  const QuantizedRows quantized(input.data_ptr<float>(), rows, width);
  at::Tensor out = at::empty({rows, out_features}, input.options());
  const uint8_t* w = weights.data_ptr<uint8_t>();
  const uint16_t* sz = reinterpret_cast<const uint16_t*>(pairs.data_ptr<at::BFloat16>());
  float* o = out.data_ptr<float>();
  const int64_t block_bytes = kBlock * (width / 2);
#ifdef STREAMGROK_INT4_VNNI
  if (!portable) {
    const Permutes permutes;
    at::parallel_for(0, out_features / kBlock, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> results(rows * kBlock);
      for (int64_t block = begin; block < end; ++block)
        block_vnni(quantized, rows, w + block * block_bytes, sz, out_features, block, permutes,
                   results.data(), o);
    });
    return out;
  }
#elif defined(STREAMGROK_INT4_AVX2)
  if (!portable) {
    at::parallel_for(0, out_features / kBlock, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> results(rows * kBlock);
      for (int64_t block = begin; block < end; ++block)
        block_avx2(quantized, rows, w + block * block_bytes, sz, out_features, block,
                   results.data(), o);
    });
    return out;
  }
#endif
  at::parallel_for(0, out_features / kBlock, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block)
      block_portable(quantized, rows, w + block * block_bytes, sz, out_features, block, o);
  });
  return out;
}

}  // namespace streamgrok_cpu

namespace {

// Block `block` of the layout as columns 64 block .. 64 block + 63 of W^T [in, out]: a group's
// 64 scales and zeros made floats once, then each of its 32 inputs' row of 64 weights, which
// the compiler vectorizes. `Out` is float or at::BFloat16 (rounded to nearest even).
template <typename Out>
void unpack_block(const uint8_t* weights, const uint16_t* scales_zeros, int64_t in_features,
                  int64_t out_features, int64_t block, Out* out) {
  const int64_t first = block * kBlock;
  float scale[kBlock], zero[kBlock];
  for (int64_t g = 0; g < in_features / kGroup; ++g) {
    const uint16_t* pairs = scales_zeros + (g * out_features + first) * 2;
    for (int64_t c = 0; c < kBlock; ++c) {
      scale[c] = streamgrok_cpu::to_float(pairs[2 * c]);
      zero[c] = streamgrok_cpu::to_float(pairs[2 * c + 1]) - 8.f * scale[c];
    }
    for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) {
      const uint8_t* bytes = weights + k * (kBlock / 2);
      Out* row = out + k * out_features + first;
      for (int64_t c = 0; c < kBlock / 2; ++c) {
        const float low = static_cast<float>(bytes[c] & 15) * scale[c] + zero[c];
        const float high =
            static_cast<float>(bytes[c] >> 4) * scale[c + kBlock / 2] + zero[c + kBlock / 2];
        row[c] = static_cast<Out>(low);
        row[c + kBlock / 2] = static_cast<Out>(high);
      }
    }
  }
}

// W^T [in, out] in `dtype` (float32 or bfloat16) from the layout: a prefill chunk multiplies
// by it. PyTorch's elementwise ops took 230 of a 512-token q4 prefill's 355 ms to build it.
at::Tensor int4_unpack_transposed(const at::Tensor& packed, const at::Tensor& scales_and_zeros,
                                  at::ScalarType dtype) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.device().is_cpu(),
              "int4_unpack_transposed: packed must be a 2-d uint8 CPU tensor, got ",
              packed.scalar_type(), " ", packed.sizes());
  const int64_t out_features = packed.size(0), in_features = packed.size(1) * 2;
  check_layout("int4_unpack_transposed", packed, scales_and_zeros, in_features);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "int4_unpack_transposed: dtype must be float32 or bfloat16, got ", dtype);
  const at::Tensor weights = packed.contiguous(), pairs = scales_and_zeros.contiguous();
  at::Tensor out = at::empty({in_features, out_features}, packed.options().dtype(dtype));
  const uint8_t* w = weights.data_ptr<uint8_t>();
  const uint16_t* sz = reinterpret_cast<const uint16_t*>(pairs.data_ptr<at::BFloat16>());
  const int64_t block_bytes = kBlock * (in_features / 2);
  at::parallel_for(0, out_features / kBlock, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      if (dtype == at::kFloat)
        unpack_block(w + block * block_bytes, sz, in_features, out_features, block,
                     out.data_ptr<float>());
      else
        unpack_block(w + block * block_bytes, sz, in_features, out_features, block,
                     out.data_ptr<at::BFloat16>());
    }
  });
  return out;
}

// Which loop int4_linear runs unless told `portable`: "avx512-vnni", "avx2" or "portable".
std::string int4_linear_kernel() {
#if defined(STREAMGROK_INT4_VNNI)
  return "avx512-vnni";
#elif defined(STREAMGROK_INT4_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

bool int4_linear_vectorized() { return int4_linear_kernel() != "portable"; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(streamgrok_cpu, m) {
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales_and_zeros, bool portable=False)"
        " -> Tensor");
  m.def("int4_linear_vectorized() -> bool", &int4_linear_vectorized);
  m.def("int4_linear_kernel() -> str", &int4_linear_kernel);
  m.def("int4_unpack_transposed(Tensor packed, Tensor scales_and_zeros, ScalarType dtype)"
        " -> Tensor");
}

TORCH_LIBRARY_IMPL(streamgrok_cpu, CPU, m) {
  m.impl("int4_linear", &streamgrok_cpu::int4_linear);
  m.impl("int4_unpack_transposed", &int4_unpack_transposed);
}
