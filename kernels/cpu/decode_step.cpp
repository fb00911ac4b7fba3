// A whole decode step of a Llama-family model with int4 projections on the CPU, in one call:
// for each layer the norm, the fused q/k/v matmul, rotary at each sequence's new position,
// the new K/V row stored (int8 with its scale, or as the store's floats), attention over the
// store, the output matmul and residual, the norm, SwiGLU and the down matmul; then the
// final norm and the output head. The matmuls and the attention are the native kernels
// (int4_linear.cpp, decode_attention.cpp), called directly; what lies between them is a few
// loops over a handful of rows. See streamgrok/model/native_decode.py for the contract: the
// eager model (and the compiled graph it replaces) is the reference.
//
// Why one call: the same step as a compiled graph runs under torch.compile, which keeps its
// compiler (dynamo, inductor, their graphs and guards) in the serving process, a few
// hundred MB, and costs a guard check and a Python wrapper per step.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "native_ops.h"
#include "step_parts.h"

namespace {

using namespace streamgrok_cpu::step;

// One layer's K/V store (or its scales) as the step writes it.
struct Store {
  at::Tensor rows;    // [B, KVH, capacity, D]
  at::Tensor scales;  // [B, KVH, capacity] float16 where rows are int8, else undefined
};

// Writes one head's row `x` at (b, kvh, position) of `store`.
void store_row(const Store& store, int64_t b, int64_t kvh, int64_t position, const float* x) {
  const int64_t kv_heads = store.rows.size(1), capacity = store.rows.size(2);
  store_head(store.rows, store.scales, (b * kv_heads + kvh) * capacity + position, x,
             store.rows.size(3));
}

void check_store(const at::Tensor& rows, const at::Tensor* scales, int64_t batch,
                 int64_t kv_heads, int64_t dim, at::ScalarType kind) {
  TORCH_CHECK(rows.dim() == 4 && rows.size(0) == batch && rows.size(1) == kv_heads &&
                  rows.size(3) == dim && rows.is_contiguous() && rows.scalar_type() == kind,
              "decode_step: K/V stores must be contiguous [", batch, ", ", kv_heads,
              ", capacity, ", dim, "] of one dtype, got ", rows.scalar_type(), " ", rows.sizes());
  if (scales != nullptr)
    TORCH_CHECK(scales->scalar_type() == at::kHalf && scales->is_contiguous() &&
                    scales->sizes() == rows.sizes().slice(0, 3),
                "decode_step: int8 stores need contiguous float16 scales [B, KVH, capacity]");
}

}  // namespace

namespace streamgrok_cpu {

// embedded [B, hidden] float32: the new tokens' embeddings. weights: per layer, attn_norm,
// qkv packed, qkv scales_and_zeros, wo packed, wo scales, ffn_norm, gate_up packed, gate_up
// scales, down packed, down scales (int4 layouts of int4_linear; gate_up is gate's rows then
// up's); then the final norm, the head's weight and scales: int4 (packed uint8 and bfloat16
// scales and zeros, as the layers') or int8 (int8 [vocab, hidden] and float32 scales [vocab],
// int8_linear's), or no head (then the final norm's output [B, hidden] is returned, for the
// caller's head). qkv_biases: none, or one float32
// [(H + 2 KVH) D] per layer. keys/values: a store per layer, [B, KVH, capacity, D] float32,
// bfloat16 or int8 (then key_scales/value_scales, float16 [B, KVH, capacity], else empty),
// written at `positions` [B] int64; cos/sin [B, D/2] float32, the new positions' rotary.
// moe_weights/moe_layout/expert_counts: a mixture of experts' layers (moe_ffn.h; empty for
// a dense model).
// Returns the logits [B, vocab] float32 (or the normed hidden state: see the head above).
at::Tensor decode_step(const at::Tensor& embedded, at::TensorList weights,
                       at::TensorList qkv_biases, at::TensorList keys, at::TensorList values,
                       at::TensorList key_scales, at::TensorList value_scales,
                       const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                       int64_t num_heads, int64_t num_kv_heads, double eps,
                       at::TensorList moe_weights, at::IntArrayRef moe_layout,
                       const at::Tensor& expert_counts) {
  const int64_t layers = static_cast<int64_t>(keys.size());
  TORCH_CHECK(embedded.dim() == 2 && embedded.scalar_type() == at::kFloat,
              "decode_step: embedded must be float32 [B, hidden]");
  TORCH_CHECK(static_cast<int64_t>(values.size()) == layers,
              "decode_step: a key and a value store per layer");
  const bool quantized = !key_scales.empty();
  TORCH_CHECK(static_cast<int64_t>(key_scales.size()) == (quantized ? layers : 0) &&
                  value_scales.size() == key_scales.size(),
              "decode_step: int8 stores need a key and a value scale tensor per layer");
  TORCH_CHECK(qkv_biases.empty() || static_cast<int64_t>(qkv_biases.size()) == layers,
              "decode_step: no q/k/v biases or one per layer");
  const int64_t batch = embedded.size(0), hidden = embedded.size(1);
  check_weights("decode_step", weights, layers, hidden);
  const MixtureOfExperts moe(moe_weights, moe_layout, expert_counts, layers, hidden,
                             "decode_step");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == batch && cos.sizes() == sin.sizes() &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "decode_step: cos and sin must be float32 [B, D/2]");
  const int64_t dim = cos.size(1) * 2;
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == batch,
              "decode_step: positions must be int64 [B]");
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "decode_step: heads must be a multiple of KV heads");
  const at::ScalarType kind = layers > 0 ? keys[0].scalar_type() : at::kFloat;
  TORCH_CHECK(kind == at::kFloat || kind == at::kBFloat16 || kind == at::kChar,
              "decode_step: K/V stores must be float32, bfloat16 or int8, got ", kind);
  TORCH_CHECK(quantized == (kind == at::kChar),
              "decode_step: int8 stores and only they come with scales");
  for (int64_t l = 0; l < layers; ++l) {
    check_store(keys[l], quantized ? &key_scales[l] : nullptr, batch, num_kv_heads, dim, kind);
    check_store(values[l], quantized ? &value_scales[l] : nullptr, batch, num_kv_heads, dim,
                kind);
  }
  const at::Tensor where = positions.contiguous();
  const int64_t* pos = where.data_ptr<int64_t>();
  const int64_t capacity = layers > 0 ? keys[0].size(2) : 1;
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(pos[b] >= 0 && pos[b] < capacity, "decode_step: position ", pos[b],
                " of row ", b, " is outside the stores' 0..", capacity - 1);
  const at::Tensor lengths = where + 1;
  const at::Tensor rotary_cos = cos.contiguous(), rotary_sin = sin.contiguous();
  const float* cp = rotary_cos.data_ptr<float>();
  const float* sp = rotary_sin.data_ptr<float>();
  const int64_t half = dim / 2, q_width = num_heads * dim, kv_width = num_kv_heads * dim;
  const float norm_eps = static_cast<float>(eps);
  const double attention_scale = 1.0 / std::sqrt(static_cast<double>(dim));
  at::Tensor q = at::empty({batch, num_heads, dim}, embedded.options());

  // rotary at each row's new position, the new K/V stored in the contiguous stores, then
  // attention over them
  const auto attend = [&](int64_t l, const at::Tensor& qkv) {
    const Store key_store{keys[l], quantized ? key_scales[l] : at::Tensor()};
    const Store value_store{values[l], quantized ? value_scales[l] : at::Tensor()};
    const float* all = qkv.data_ptr<float>();
    float* qp = q.data_ptr<float>();
    at::parallel_for(0, batch, kRowGrain, [&](int64_t begin, int64_t end) {
      std::vector<float> rotated(dim);
      for (int64_t b = begin; b < end; ++b) {
        const float* row = all + b * qkv.size(1);
        const float* c = cp + b * half;
        const float* s = sp + b * half;
        for (int64_t head = 0; head < num_heads; ++head)
          rotate(row + head * dim, c, s, dim, qp + (b * num_heads + head) * dim);
        for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
          rotate(row + q_width + kvh * dim, c, s, dim, rotated.data());
          store_row(key_store, b, kvh, pos[b], rotated.data());
          store_row(value_store, b, kvh, pos[b], row + q_width + kv_width + kvh * dim);
        }
      }
    });
    return decode_attention(
               q, keys[l], values[l], lengths, attention_scale,
               quantized ? c10::optional<at::Tensor>(key_scales[l]) : c10::nullopt,
               quantized ? c10::optional<at::Tensor>(value_scales[l]) : c10::nullopt)
        .view({batch, q_width});
  };
  const at::Tensor x = run_layers(embedded, weights, qkv_biases, layers,
                                  q_width + 2 * kv_width, norm_eps, moe, attend);
  return finish(x, weights, layers, norm_eps);
}

}  // namespace streamgrok_cpu

TORCH_LIBRARY_FRAGMENT(streamgrok_cpu, m) {
  m.def("decode_step(Tensor embedded, Tensor[] weights, Tensor[] qkv_biases, "
        "Tensor(a!)[] keys, Tensor(b!)[] values, Tensor(c!)[] key_scales, "
        "Tensor(d!)[] value_scales, Tensor positions, Tensor cos, Tensor sin, int num_heads, "
        "int num_kv_heads, float eps, Tensor[] moe_weights, int[] moe_layout, "
        "Tensor(e!) expert_counts) -> Tensor");
}

TORCH_LIBRARY_IMPL(streamgrok_cpu, CPU, m) {
  m.impl("decode_step", &streamgrok_cpu::decode_step);
}
