// The mixture-of-experts feed-forward of a native decode step (streamgrok/model/moe.py is the
// reference): the router's softmax top-k (renormalised or not), the rows grouped by expert so
// each chosen expert runs its int4 matmuls once over all of its rows, weighted sums in expert
// order, and a shared expert (gated by a sigmoid or not) on every row.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "native_ops.h"

namespace streamgrok_cpu::step {

inline at::Tensor swiglu(const at::Tensor& gate_up);  // step_parts.h

// What the op's `moe_weights` and `moe_layout` say. moe_layout: [num_experts, top_k,
// normalize, shared, shared_gated] then, per layer, the index in moe_weights of its router
// (-1: a dense layer, whose MLP is in the layer's own weights). After a router [E, hidden]
// float32 come 4 tensors per expert (gate/up packed and scales, down packed and scales, as
// the dense layers'), then with `shared` the shared expert's 4 and with `shared_gated` its
// gate [1, hidden] float32. expert_counts: [layers, experts] int64 that each step adds the
// rows every expert took to (empty: nothing counted).
struct MixtureOfExperts {
  at::TensorList weights;
  int64_t* counts = nullptr;
  int64_t experts = 0, top_k = 0;
  bool normalize = false, shared = false, shared_gated = false;
  std::vector<int64_t> first;  // per layer: the router's index, or -1

  MixtureOfExperts(at::TensorList moe_weights, at::IntArrayRef layout,
                   const at::Tensor& expert_counts, int64_t layers, int64_t hidden,
                   const char* op)
      : weights(moe_weights) {
    if (layout.empty()) {
      first.assign(layers, -1);
      return;
    }
    TORCH_CHECK(static_cast<int64_t>(layout.size()) == 5 + layers, op,
                ": moe_layout must hold 5 numbers and one per layer");
    experts = layout[0];
    top_k = layout[1];
    normalize = layout[2] != 0;
    shared = layout[3] != 0;
    shared_gated = layout[4] != 0;
    TORCH_CHECK(experts > 0 && top_k > 0 && top_k <= experts, op,
                ": moe_layout needs 1 <= top_k <= experts");
    if (expert_counts.numel() > 0) {
      TORCH_CHECK(expert_counts.scalar_type() == at::kLong && expert_counts.dim() == 2 &&
                      expert_counts.size(0) == layers && expert_counts.size(1) == experts &&
                      expert_counts.is_contiguous(),
                  op, ": expert_counts must be contiguous int64 [layers, experts]");
      counts = expert_counts.data_ptr<int64_t>();
    }
    const int64_t per_layer = 1 + 4 * experts + (shared ? 4 : 0) + (shared_gated ? 1 : 0);
    for (int64_t l = 0; l < layers; ++l) {
      const int64_t at = layout[5 + l];
      TORCH_CHECK(at == -1 || (at >= 0 && at + per_layer <= static_cast<int64_t>(
                                                      moe_weights.size())),
                  op, ": layer ", l, "'s experts are outside moe_weights");
      if (at >= 0) {
        const at::Tensor& router = moe_weights[at];
        TORCH_CHECK(router.scalar_type() == at::kFloat && router.dim() == 2 &&
                        router.size(0) == experts && router.size(1) == hidden,
                    op, ": a router must be float32 [experts, hidden]");
      }
      first.push_back(at);
    }
  }

  bool sparse(int64_t layer) const { return first[layer] >= 0; }

  // The layer's output for its normed input h [B, hidden] float32.
  at::Tensor forward(int64_t layer, const at::Tensor& h) const {
    const at::Tensor* w = weights.data() + first[layer];
    const int64_t batch = h.size(0);
    const at::Tensor probs = at::softmax(at::linear(h, w[0]), -1);
    auto [chosen_weights, chosen] = at::topk(probs, top_k, -1);
    if (normalize) chosen_weights = chosen_weights / chosen_weights.sum(-1, true);
    const at::Tensor ids = chosen.contiguous(), gains = chosen_weights.contiguous();
    const int64_t* id = ids.data_ptr<int64_t>();
    const float* gain = gains.data_ptr<float>();
    std::vector<std::vector<int64_t>> rows(experts);
    std::vector<std::vector<float>> scales(experts);
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t j = 0; j < top_k; ++j) {
        const int64_t e = id[b * top_k + j];
        rows[e].push_back(b);
        scales[e].push_back(gain[b * top_k + j]);
      }
    at::Tensor out = at::zeros_like(h);
    const auto index_options = at::TensorOptions().dtype(at::kLong);
    for (int64_t e = 0; e < experts; ++e) {
      if (rows[e].empty()) continue;
      const int64_t n = static_cast<int64_t>(rows[e].size());
      if (counts != nullptr) counts[layer * experts + e] += n;
      const at::Tensor index = at::from_blob(rows[e].data(), {n}, index_options).clone();
      const at::Tensor gains_e =
          at::from_blob(scales[e].data(), {n, 1}, at::TensorOptions().dtype(at::kFloat))
              .clone();
      const at::Tensor* ew = w + 1 + 4 * e;
      const at::Tensor part = n == batch ? h : h.index_select(0, index);
      at::Tensor y = int4_linear(swiglu(int4_linear(part, ew[0], ew[1], false)), ew[2], ew[3],
                                 false);
      out.index_add_(0, index, y.mul_(gains_e));
    }
    if (shared) {
      const at::Tensor* sw = w + 1 + 4 * experts;
      at::Tensor s = int4_linear(swiglu(int4_linear(h, sw[0], sw[1], false)), sw[2], sw[3],
                                 false);
      if (shared_gated) s.mul_(at::sigmoid(at::linear(h, sw[4])));
      out.add_(s);
    }
    return out;
  }
};

}  // namespace streamgrok_cpu::step
