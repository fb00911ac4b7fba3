// The native kernels one another calls directly (decode_step.cpp runs a whole decode step
// through them, without the dispatcher between the calls).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

// Builds a function without fast math, for arithmetic that must equal PyTorch's reference
// bit for bit: a division stays a division (not a multiply by the inverse), rounding tricks
// are not folded away and nothing is contracted into an FMA. (Within such functions only
// builtins and plain expressions: a library call would not be inlined across the changed
// options, and would keep a loop from vectorizing.)
#define STREAMGROK_EXACT __attribute__((optimize("no-fast-math", "fp-contract=off")))

namespace streamgrok_cpu {

// x [rows, in] float32 times W^T, W [out, in] in PyTorch's CPU int4 layout (int4_linear.cpp;
// the contract and the reference in kernels/cpu_int4.py): [rows, out] float32.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed,
                       const at::Tensor& scales_and_zeros, bool portable);

// x [rows, in] float32 times W^T, W [out, in] int8 with a float32 scale per output row
// (int8_linear.cpp; the contract and the reference in kernels/cpu_int8.py): [rows, out].
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                       bool portable);

// An output head's logits, as int8_linear's but from the activations' coarse levels alone,
// with each row's `exact` largest recomputed in float32 from x (int8_linear.cpp).
at::Tensor int8_head(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                     int64_t exact, bool portable);

// Logits per row a decode step's int8 head recomputes in float32 (streamgrok.model.quantized's
// EXACT_TOP, which the eager head uses).
constexpr int64_t kHeadExactTop = 32;

// q [B, H, D] float32; keys, values [B, KVH, capacity, D] float32, bfloat16 or int8,
// contiguous; for int8, key_scales and value_scales [B, KVH, capacity] float16 (a value is
// int8 * its row's scale); lengths [B] int64 (row b attends to positions < lengths[b],
// 1 <= lengths[b] <= capacity): [B, H, D] float32 (decode_attention.cpp).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys,
                            const at::Tensor& values, const at::Tensor& lengths, double scale,
                            const c10::optional<at::Tensor>& key_scales,
                            const c10::optional<at::Tensor>& value_scales);

// Queries of several sequences over K/V read through page tables (paged_attention.cpp; the
// contract is kernels/cpu_attention.py's cpu_paged_attention): out [T, H, D] float32 and,
// with mass_rows > 0, the attention mass [B, P * page_size] (else an empty tensor).
std::tuple<at::Tensor, at::Tensor> paged_attention(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
    const at::Tensor& block_tables, const at::Tensor& cu_q, const at::Tensor& past,
    const at::Tensor& cos, const at::Tensor& sin, int64_t page_size, int64_t mass_rows,
    double scale);

}  // namespace streamgrok_cpu
