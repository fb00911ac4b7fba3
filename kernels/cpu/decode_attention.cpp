// Decode attention on the CPU: one query row per head over each sequence's cached keys and
// values, read once. See kernels/cpu_attention.py for the contract and the PyTorch reference.
//
// Work is split over (sequence, KV head): the group of query heads sharing that KV head is
// scored against each key while the key is in L1, the scores are soft-maxed, and the values
// are summed into accumulators that stay in registers where the head size and group are
// compile-time constants (the common shapes below); other shapes take the generic loop.
// While a key is scored its value row is fetched, and while the values are summed the next
// (sequence, KV head)'s keys are: at 32 sequences x 524 tokens of bfloat16 K/V, 30 layers,
// 2 threads, 41 -> 29-31 ms, near the 27 ms a plain read of those rows takes here (a core
// streams them at ~7 GB/s and waited on each row before).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention_math.h"
#include "native_ops.h"

namespace {

using streamgrok_cpu::prefetch;
using streamgrok_cpu::softmax_rows;
using streamgrok_cpu::to_float;

// The scale of row t of int8 K/V (one per token and KV head), 1 for float K/V (no scales).
inline float row_scale(const at::Half* scales, int64_t t) {
  return scales == nullptr ? 1.f : static_cast<float>(scales[t]);
}

// int8 rows are converted to floats once per key or value and read by every query head of
// the group: converting them in each head's loop left the kernel bound by conversions, as
// slow as bfloat16's twice the bytes (SmolLM2's shapes, 30 layers, 32 sequences x 522 keys,
// 2 threads: int8 17.6-17.8 -> 14.0-14.4 ms, 8 sequences 4.4 -> 3.5). Float and bfloat16
// rows gain nothing from it (float32 lost 5-10%: the copy is work the direct loads skip).
template <typename KV>
constexpr bool kConvertOnce = std::is_same_v<KV, int8_t>;

// q [G, D] f32, k/v [length, D] with their row scales ks/vs [length] (int8 K/V; else null),
// out [G, D] f32; scores: G * length scratch; next_k: the keys the thread reads next
// (next_length rows), or null.
template <typename KV, int D, int G>
void attend_fixed(const float* q, const KV* k, const KV* v, const at::Half* ks,
                  const at::Half* vs, int64_t length, float scale, float* scores, float* out,
                  const KV* next_k, int64_t next_length) {
  float row[D];  // an int8 key or value as floats, converted once for the whole group
  for (int64_t t = 0; t < length; ++t) {
    const KV* key = k + t * D;
    prefetch(v + t * D, D * sizeof(KV));
    const float key_scale = scale * row_scale(ks, t);
    if constexpr (kConvertOnce<KV>) {
#pragma omp simd
      for (int d = 0; d < D; ++d) row[d] = to_float(key[d]);
    }
    for (int g = 0; g < G; ++g) {
      const float* query = q + g * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int d = 0; d < D; ++d) {
        dot += query[d] * (kConvertOnce<KV> ? row[d] : to_float(key[d]));
      }
      scores[g * length + t] = dot * key_scale;
    }
  }
  softmax_rows(scores, G, length);
  float acc[G * D];
  for (int x = 0; x < G * D; ++x) acc[x] = 0.f;
  for (int64_t t = 0; t < length; ++t) {
    const KV* value = v + t * D;
    if (t < next_length) prefetch(next_k + t * D, D * sizeof(KV));
    const float value_scale = row_scale(vs, t);
    if constexpr (kConvertOnce<KV>) {
#pragma omp simd
      for (int d = 0; d < D; ++d) row[d] = to_float(value[d]);
    }
    for (int g = 0; g < G; ++g) {
      const float weight = scores[g * length + t] * value_scale;
#pragma omp simd
      for (int d = 0; d < D; ++d) {
        acc[g * D + d] += weight * (kConvertOnce<KV> ? row[d] : to_float(value[d]));
      }
    }
  }
  std::memcpy(out, acc, sizeof(acc));
}

template <typename KV>
void attend_any(const float* q, const KV* k, const KV* v, const at::Half* ks,
                const at::Half* vs, int64_t length, float scale, float* scores, float* out,
                int64_t groups, int64_t dim, const KV* next_k, int64_t next_length) {
  for (int64_t t = 0; t < length; ++t) {
    prefetch(v + t * dim, dim * sizeof(KV));
    const float key_scale = scale * row_scale(ks, t);
    for (int64_t g = 0; g < groups; ++g) {
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < dim; ++d) dot += q[g * dim + d] * to_float(k[t * dim + d]);
      scores[g * length + t] = dot * key_scale;
    }
  }
  softmax_rows(scores, groups, length);
  std::fill(out, out + groups * dim, 0.f);
  for (int64_t t = 0; t < length; ++t) {
    if (t < next_length) prefetch(next_k + t * dim, dim * sizeof(KV));
    const float value_scale = row_scale(vs, t);
    for (int64_t g = 0; g < groups; ++g) {
      const float weight = scores[g * length + t] * value_scale;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) out[g * dim + d] += weight * to_float(v[t * dim + d]);
    }
  }
}

template <typename KV>
using GroupFn = void (*)(const float*, const KV*, const KV*, const at::Half*,
                         const at::Half*, int64_t, float, float*, float*, const KV*, int64_t);

template <typename KV, int D>
GroupFn<KV> fixed_for_group(int64_t groups) {
  switch (groups) {
    case 1: return attend_fixed<KV, D, 1>;
    case 2: return attend_fixed<KV, D, 2>;
    case 3: return attend_fixed<KV, D, 3>;
    case 4: return attend_fixed<KV, D, 4>;
    case 5: return attend_fixed<KV, D, 5>;
    case 6: return attend_fixed<KV, D, 6>;
    case 7: return attend_fixed<KV, D, 7>;
    case 8: return attend_fixed<KV, D, 8>;
    default: return nullptr;
  }
}

template <typename KV>
GroupFn<KV> fixed_for(int64_t dim, int64_t groups) {
  if (dim == 64) return fixed_for_group<KV, 64>(groups);
  if (dim == 128) return fixed_for_group<KV, 128>(groups);
  return nullptr;
}

template <typename KV>
void attend_all(const float* q, const KV* keys, const KV* values, const at::Half* key_scales,
                const at::Half* value_scales, const int64_t* lengths, float* out,
                int64_t batch, int64_t heads, int64_t kv_heads, int64_t capacity, int64_t dim,
                float scale) {
  const int64_t groups = heads / kv_heads;
  const GroupFn<KV> fixed = fixed_for<KV>(dim, groups);
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / kv_heads, h = i % kv_heads, length = lengths[b];
      const int64_t row = (b * heads + h * groups) * dim;
      const int64_t store = i * capacity * dim;  // (sequence b, KV head h)'s rows
      const KV* next_k = nullptr;
      int64_t next_length = 0;
      if (i + 1 < end) {  // the thread's next (sequence, KV head): the following store
        next_k = keys + store + capacity * dim;
        next_length = lengths[(i + 1) / kv_heads];
      }
      const at::Half* ks = key_scales == nullptr ? nullptr : key_scales + i * capacity;
      const at::Half* vs = value_scales == nullptr ? nullptr : value_scales + i * capacity;
      scores.resize(groups * length);
      if (fixed != nullptr) {
        fixed(q + row, keys + store, values + store, ks, vs, length, scale, scores.data(),
              out + row, next_k, next_length);
      } else {
        attend_any(q + row, keys + store, values + store, ks, vs, length, scale,
                   scores.data(), out + row, groups, dim, next_k, next_length);
      }
    }
  });
}

}  // namespace

namespace streamgrok_cpu {

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys,
                            const at::Tensor& values, const at::Tensor& lengths, double scale,
                            const c10::optional<at::Tensor>& key_scales,
                            const c10::optional<at::Tensor>& value_scales) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 4 && values.sizes() == keys.sizes(),
              "decode_attention: q [B, H, D], keys and values [B, KVH, capacity, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "decode_attention: q must be float32");
  const auto kind = keys.scalar_type();
  TORCH_CHECK(kind == values.scalar_type() &&
                  (kind == at::kFloat || kind == at::kBFloat16 || kind == at::kChar),
              "decode_attention: keys and values must both be float32, bfloat16 or int8");
  const bool quantized = kind == at::kChar;
  TORCH_CHECK(quantized == key_scales.has_value() && quantized == value_scales.has_value(),
              "decode_attention: int8 keys and values need key_scales and value_scales, "
              "float ones none");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.numel() == q.size(0),
              "decode_attention: lengths must be int64 [B]");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = keys.size(1), capacity = keys.size(2);
  TORCH_CHECK(keys.size(0) == batch && keys.size(3) == dim && heads % kv_heads == 0,
              "decode_attention: shapes do not match");
  at::Tensor k_scales, v_scales;
  if (quantized) {
    k_scales = key_scales->contiguous();
    v_scales = value_scales->contiguous();
    const std::vector<int64_t> expected{batch, kv_heads, capacity};
    TORCH_CHECK(k_scales.sizes() == at::IntArrayRef(expected) &&
                    v_scales.sizes() == at::IntArrayRef(expected) &&
                    k_scales.scalar_type() == at::kHalf &&
                    v_scales.scalar_type() == at::kHalf,
                "decode_attention: scales must be float16 [B, KVH, capacity]");
  }
  auto query = q.contiguous();
  auto k = keys.contiguous();
  auto v = values.contiguous();
  auto lens = lengths.contiguous();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= capacity, "decode_attention: length ", lp[b],
                " of row ", b, " is outside 1..", capacity);
  }
  auto out = at::empty_like(query);
  const float s = static_cast<float>(scale);
  const float* qp = query.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (kind == at::kFloat) {
    attend_all<float>(qp, k.data_ptr<float>(), v.data_ptr<float>(), nullptr, nullptr, lp, op,
                      batch, heads, kv_heads, capacity, dim, s);
  } else if (kind == at::kBFloat16) {
    attend_all<uint16_t>(qp, reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>()),
                         reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>()),
                         nullptr, nullptr, lp, op, batch, heads, kv_heads, capacity, dim, s);
  } else {
    attend_all<int8_t>(qp, k.data_ptr<int8_t>(), v.data_ptr<int8_t>(),
                       k_scales.data_ptr<at::Half>(), v_scales.data_ptr<at::Half>(), lp, op,
                       batch, heads, kv_heads, capacity, dim, s);
  }
  return out;
}

}  // namespace streamgrok_cpu

// A dispatcher op, not a Python function: a compiled graph calls it without Python in between.
TORCH_LIBRARY(streamgrok_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor keys, Tensor values, Tensor lengths, float scale,"
        " Tensor? key_scales=None, Tensor? value_scales=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(streamgrok_cpu, CPU, m) {
  m.impl("decode_attention", &streamgrok_cpu::decode_attention);
}
