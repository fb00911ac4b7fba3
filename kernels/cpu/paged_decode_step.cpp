// A whole decode step of a Llama-family model with int4 projections over the engine's paged
// streaming cache, in one call: decode_step.cpp's layer loop (step_parts.h), with each
// layer's new K/V written into the page pool at the slots the cache reserved and attention
// read through that layer's page tables (paged_attention.cpp), which also gives the attention
// mass eviction scores. See streamgrok/model/native_decode.py for the contract; the eager
// model over the same cache is the reference (tests/test_paged_native_decode.py).
//
// The paged cache keeps keys before rotary and positions relative to what it retains, so a
// query is rotated to its row's cache position (the layer's length before this token) and
// keys are rotated as they are read, as in the eager path.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "native_ops.h"
#include "step_parts.h"

namespace streamgrok_cpu {

using namespace step;

// embedded [B, hidden] float32; weights and qkv_biases as decode_step's. k, v: the page pool
// [slots, KVH, D] float32, bfloat16 or int8 (then k_scale, v_scale float16 [slots, KVH]).
// new_slots [L, B] int64: where each row's new K/V go in each layer; block_tables [L, B, P]
// int32 and lengths [L, B] int32: each layer's page table and the row's key count including
// the new token; cos/sin [positions, D/2] float32 (positions >= every length). Returns the
// logits [B, vocab] (or the normed hidden state, as decode_step) and, with want_mass, the
// attention mass [L, B, P * page_size] float32 each row's query gave each key, summed over
// heads (an empty tensor otherwise). moe_weights/moe_layout/expert_counts: a
// mixture of experts' layers (moe_ffn.h; empty for a dense model).
std::tuple<at::Tensor, at::Tensor> paged_decode_step(
    const at::Tensor& embedded, at::TensorList weights, at::TensorList qkv_biases,
    const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& k_scale,
    const c10::optional<at::Tensor>& v_scale, const at::Tensor& new_slots,
    const at::Tensor& block_tables, const at::Tensor& lengths, const at::Tensor& cos,
    const at::Tensor& sin, int64_t page_size, int64_t num_heads, int64_t num_kv_heads,
    double eps, bool want_mass, at::TensorList moe_weights, at::IntArrayRef moe_layout,
    const at::Tensor& expert_counts) {
  TORCH_CHECK(embedded.dim() == 2 && embedded.scalar_type() == at::kFloat,
              "paged_decode_step: embedded must be float32 [B, hidden]");
  TORCH_CHECK(block_tables.dim() == 3 && block_tables.scalar_type() == at::kInt,
              "paged_decode_step: block_tables must be int32 [L, B, P]");
  const int64_t layers = block_tables.size(0), batch = embedded.size(0);
  const int64_t hidden = embedded.size(1);
  TORCH_CHECK(block_tables.size(1) == batch, "paged_decode_step: a page table per row");
  TORCH_CHECK(new_slots.scalar_type() == at::kLong && new_slots.dim() == 2 &&
                  new_slots.size(0) == layers && new_slots.size(1) == batch,
              "paged_decode_step: new_slots must be int64 [L, B]");
  TORCH_CHECK(lengths.scalar_type() == at::kInt && lengths.dim() == 2 &&
                  lengths.size(0) == layers && lengths.size(1) == batch,
              "paged_decode_step: lengths must be int32 [L, B]");
  TORCH_CHECK(qkv_biases.empty() || static_cast<int64_t>(qkv_biases.size()) == layers,
              "paged_decode_step: no q/k/v biases or one per layer");
  check_weights("paged_decode_step", weights, layers, hidden);
  const MixtureOfExperts moe(moe_weights, moe_layout, expert_counts, layers, hidden,
                             "paged_decode_step");
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "paged_decode_step: heads must be a multiple of KV heads");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == num_kv_heads &&
                  k.is_contiguous() && v.is_contiguous() &&
                  k.scalar_type() == v.scalar_type(),
              "paged_decode_step: the pool's k and v must be contiguous [slots, KVH, D]");
  const at::ScalarType kind = k.scalar_type();
  TORCH_CHECK(kind == at::kFloat || kind == at::kBFloat16 || kind == at::kChar,
              "paged_decode_step: K/V must be float32, bfloat16 or int8, got ", kind);
  const bool quantized = kind == at::kChar;
  TORCH_CHECK(quantized == (k_scale.has_value() && v_scale.has_value()),
              "paged_decode_step: int8 K/V and only they come with scales");
  if (quantized)
    TORCH_CHECK(k_scale->is_contiguous() && v_scale->is_contiguous() &&
                    k_scale->scalar_type() == at::kHalf && v_scale->scalar_type() == at::kHalf &&
                    k_scale->numel() == k.size(0) * num_kv_heads &&
                    v_scale->numel() == k_scale->numel(),
                "paged_decode_step: scales must be contiguous float16 [slots, KVH]");
  const int64_t dim = k.size(2), slots = k.size(0);
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) * 2 == dim && cos.sizes() == sin.sizes() &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "paged_decode_step: cos and sin must be float32 [positions, D/2]");
  const at::Tensor where = new_slots.contiguous();
  const int64_t* slot = where.data_ptr<int64_t>();
  const at::Tensor past = lengths.to(at::kLong).sub_(1).contiguous();  // the queries' positions
  const int64_t* pos = past.data_ptr<int64_t>();
  for (int64_t i = 0; i < layers * batch; ++i) {
    TORCH_CHECK(slot[i] >= 0 && slot[i] < slots, "paged_decode_step: slot ", slot[i],
                " is outside the pool of ", slots);
    TORCH_CHECK(pos[i] >= 0 && pos[i] < cos.size(0), "paged_decode_step: length ", pos[i] + 1,
                " is outside 1..", cos.size(0), " (the rotary tables)");
  }
  const at::Tensor rotary_cos = cos.contiguous(), rotary_sin = sin.contiguous();
  const float* cp = rotary_cos.data_ptr<float>();
  const float* sp = rotary_sin.data_ptr<float>();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor cu_q = at::arange(batch + 1, past.options());
  const int64_t half = dim / 2, q_width = num_heads * dim, kv_width = num_kv_heads * dim;
  const float norm_eps = static_cast<float>(eps);
  const double attention_scale = 1.0 / std::sqrt(static_cast<double>(dim));
  const at::Tensor no_scales;
  at::Tensor q = at::empty({batch, num_heads, dim}, embedded.options());
  std::vector<at::Tensor> masses;

  // q rotated to each row's position; k (unrotated) and v stored at the reserved slots; then
  // attention through the layer's page tables
  const auto attend = [&](int64_t l, const at::Tensor& qkv) {
    const float* all = qkv.data_ptr<float>();
    float* qp = q.data_ptr<float>();
    at::parallel_for(0, batch, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const float* row = all + b * qkv.size(1);
        const int64_t position = pos[l * batch + b], at_slot = slot[l * batch + b];
        const float* c = cp + position * half;
        const float* s = sp + position * half;
        for (int64_t head = 0; head < num_heads; ++head)
          rotate(row + head * dim, c, s, dim, qp + (b * num_heads + head) * dim);
        for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
          const int64_t stored = at_slot * num_kv_heads + kvh;
          store_head(k, quantized ? *k_scale : no_scales, stored, row + q_width + kvh * dim,
                     dim);
          store_head(v, quantized ? *v_scale : no_scales, stored,
                     row + q_width + kv_width + kvh * dim, dim);
        }
      }
    });
    auto [out, mass] = paged_attention(q, k, v, k_scale, v_scale, tables.select(0, l), cu_q,
                                       past.select(0, l), rotary_cos, rotary_sin, page_size,
                                       want_mass ? 1 : 0, attention_scale);
    if (want_mass) masses.push_back(mass);
    return out.view({batch, q_width});
  };
  const at::Tensor x = run_layers(embedded, weights, qkv_biases, layers,
                                  q_width + 2 * kv_width, norm_eps, moe, attend);
  return {finish(x, weights, layers, norm_eps),
          want_mass ? at::stack(masses) : at::empty({0}, embedded.options())};
}

}  // namespace streamgrok_cpu

TORCH_LIBRARY_FRAGMENT(streamgrok_cpu, m) {
  m.def("paged_decode_step(Tensor embedded, Tensor[] weights, Tensor[] qkv_biases, "
        "Tensor(a!) k, Tensor(b!) v, Tensor(c!)? k_scale, Tensor(d!)? v_scale, "
        "Tensor new_slots, Tensor block_tables, Tensor lengths, Tensor cos, Tensor sin, "
        "int page_size, int num_heads, int num_kv_heads, float eps, bool want_mass, "
        "Tensor[] moe_weights, int[] moe_layout, Tensor(e!) expert_counts) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(streamgrok_cpu, CPU, m) {
  m.impl("paged_decode_step", &streamgrok_cpu::paged_decode_step);
}
