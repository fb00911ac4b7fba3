// Paged attention on the CPU: chunks of new queries (a decode step's one query per sequence,
// or a prefill chunk) over keys and values read through page tables. See
// kernels/cpu_attention.py (`cpu_paged_attention`) for the contract; the oracle is
// kernels.paged_prefill_attention.reference.
//
// Keys are stored before rotary. A task is (sequence, KV head, up to 16 query tokens): every
// query row of the task (its tokens x the KV head's query group) is scored against a block of
// 16 keys at a time, which is gathered from its pages, dequantized and rotated to its cache
// positions once and transposed, so that a row scores the whole block with one vector
// multiply-add per element. The scores stay in a buffer and are soft-maxed exactly over each
// row's causal length (which also gives the exact attention mass), then the values are summed
// block by block into per-row accumulators. A task of a few rows (decode) scores untransposed
// rows instead (`score_few_rows`). Tasks are taken from a shared counter, longest first, so
// causal chunks of unequal length keep every thread busy.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <tuple>
#include <vector>

#include "attention_math.h"
#include "native_ops.h"

namespace {

using streamgrok_cpu::prefetch;
using streamgrok_cpu::softmax_row;
using streamgrok_cpu::to_float;

constexpr int64_t kBlock = 16;       // keys scored together
constexpr int64_t kQueryChunk = 16;  // query tokens of one task
constexpr int64_t kRows = 4;         // query rows scored together
constexpr int64_t kFewRows = 8;      // up to this many rows, keys are scored untransposed

struct Problem {
  const float* q;  // [T, H, D], rotated
  const void* k;   // [slots, KVH, D], before rotary
  const void* v;
  const at::Half* k_scale;  // [slots, KVH] for int8 storage, else null
  const at::Half* v_scale;
  const int32_t* tables;  // [B, P]
  int64_t table_stride;
  const int64_t* cu_q;  // [B + 1]
  const int64_t* past;  // [B]
  const float* cos;     // [positions, D / 2]
  const float* sin;
  float* out;  // [T, H, D]
  int64_t heads, kv_heads, dim, page_size, mass_rows;
  float scale;
};

struct Task {
  int64_t seq, kv_head, first, last;  // query tokens [first, last) of sequence `seq`
  int64_t keys;                       // keys its last query sees (its cost)
};

// A thread's buffers, reused from task to task.
struct Scratch {
  std::vector<float> floats;   // scores, a block of keys or values, accumulators
  std::vector<int64_t> slots;  // the slot of each key of the task's sequence
};

template <typename KV, int FixedD>
class TaskRunner {
 public:
  TaskRunner(const Problem& p, const Task& task, Scratch& scratch)
      : p_(p), task_(task), dim_(FixedD > 0 ? FixedD : p.dim), group_(p.heads / p.kv_heads),
        rows_((task.last - task.first) * group_), width_(task.keys),
        past_(p.past[task.seq]), query0_(p.cu_q[task.seq] + task.first),
        table_(p.tables + task.seq * p.table_stride) {
    scratch.floats.resize(rows_ * width_ + kBlock * dim_ + rows_ * dim_);
    scores_ = scratch.floats.data();
    // every key's slot, found once (a division per key, several reads per key)
    scratch.slots.resize(width_);
    slots_ = scratch.slots.data();
    for (int64_t t = 0; t < width_; ++t) {
      slots_[t] = static_cast<int64_t>(table_[t / p.page_size]) * p.page_size + t % p.page_size;
    }
    block_ = scores_ + rows_ * width_;
    acc_ = block_ + kBlock * dim_;
  }

  // Scores, softmax, values, output; adds the mass rows' probabilities to `mass` (or null).
  void run(float* mass) {
    if (rows_ <= kFewRows) {
      score_few_rows();
    } else {
      score();
    }
    for (int64_t r = 0; r < rows_; ++r) softmax_row(scores_ + r * width_, limit(r));
    if (mass != nullptr) add_mass(mass);
    sum_values();
  }

 private:
  int64_t dim() const { return FixedD > 0 ? FixedD : dim_; }
  int64_t limit(int64_t row) const { return past_ + task_.first + row / group_ + 1; }

  // The first row whose query sees key t (rows are query-token major, so every later row
  // sees it too).
  int64_t first_row(int64_t t) const {
    const int64_t token = t - past_;
    return token <= task_.first ? 0 : (token - task_.first) * group_;
  }

  int64_t slot(int64_t t) const { return slots_[t]; }

  // Where a row's query (and its output) starts in q and out.
  int64_t offset(int64_t row) const {
    return ((query0_ + row / group_) * p_.heads + task_.kv_head * group_ + row % group_) * dim();
  }

  float stored_scale(const at::Half* scales, int64_t s) const {
    return scales == nullptr ? 1.f : static_cast<float>(scales[s * p_.kv_heads + task_.kv_head]);
  }

  const KV* row_of(const void* data, int64_t s) const {
    return static_cast<const KV*>(data) + (s * p_.kv_heads + task_.kv_head) * dim();
  }

  // Key t0 + j rotated to its position, element d at block_[d * kBlock + j] (transposed,
  // zero past n) or, with `Rows`, at block_[j * D + d] (one row per key).
  template <bool Rows>
  void load_keys(int64_t t0, int64_t n) {
    const int64_t D = dim(), half = D / 2;
    const int64_t key_step = Rows ? D : 1, dim_step = Rows ? 1 : kBlock;
    if (!Rows) std::fill(block_, block_ + D * kBlock, 0.f);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t t = t0 + j, s = slot(t);
      const KV* key = row_of(p_.k, s);
      const float ks = stored_scale(p_.k_scale, s);
      const float* c = p_.cos + t * half;
      const float* sn = p_.sin + t * half;
      float* out = block_ + j * key_step;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = to_float(key[i]) * ks, x2 = to_float(key[i + half]) * ks;
        out[i * dim_step] = x1 * c[i] - x2 * sn[i];
        out[(i + half) * dim_step] = x2 * c[i] + x1 * sn[i];
      }
    }
  }

  // Asks for the rows of `data` (keys or values) of the block from t0 (a thread reads its
  // rows at a few GB/s: the arithmetic between reads would add to that).
  void prefetch_block(const void* data, int64_t t0) const {
    const int64_t bytes = dim() * static_cast<int64_t>(sizeof(KV));
    for (int64_t t = t0; t < std::min(t0 + kBlock, width_); ++t) {
      prefetch(row_of(data, slot(t)), bytes);
    }
  }

  // A task of a few rows (a decode step: one query token's group) scores each key as a row
  // of dot products: transposing the block (`load_keys<false>`) costs more than its rows
  // save, and the next block's keys and this block's values are fetched while it is
  // scored. SmolLM2's shapes, 2 threads, 30 layers, decode rows: 32 sequences x 524 keys
  // float32 121 -> 68 ms, bfloat16 109 -> 53, int8 115 -> 54; 8 x 512 bfloat16 30 -> 13;
  // 1 x 2048 float32 22 -> 10.
  // (Prefill chunks keep the transposed blocks; fetching ahead made them no faster.)
  void score_few_rows() {
    const int64_t D = dim();
    prefetch_block(p_.k, 0);
    for (int64_t t0 = 0; t0 < width_; t0 += kBlock) {
      const int64_t n = std::min(kBlock, width_ - t0);
      prefetch_block(p_.k, t0 + kBlock);
      prefetch_block(p_.v, t0);
      load_keys<true>(t0, n);
      for (int64_t r = first_row(t0); r < rows_; ++r) {
        const float* query = p_.q + offset(r);
        float* out = scores_ + r * width_ + t0;
        for (int64_t j = 0; j < n; ++j) {
          const float* key = block_ + j * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += query[d] * key[d];
          out[j] = dot * p_.scale;
        }
      }
    }
  }

  // Rows are scored kRows at a time (independent accumulators: one row's chain of
  // multiply-adds alone would wait on its own latency); the last group repeats its final row.
  void score() {
    const int64_t D = dim();
    for (int64_t t0 = 0; t0 < width_; t0 += kBlock) {
      const int64_t n = std::min(kBlock, width_ - t0);
      load_keys<false>(t0, n);
      for (int64_t r = first_row(t0); r < rows_; r += kRows) {
        const float* q[kRows];
        for (int64_t i = 0; i < kRows; ++i) q[i] = p_.q + offset(std::min(r + i, rows_ - 1));
        float dots[kRows][kBlock] = {};
        for (int64_t d = 0; d < D; ++d) {
          const float* keys = block_ + d * kBlock;
          for (int64_t i = 0; i < kRows; ++i) {
            const float qd = q[i][d];
#pragma omp simd
            for (int64_t j = 0; j < kBlock; ++j) dots[i][j] += qd * keys[j];
          }
        }
        // scores past a row's causal limit are written but never read
        for (int64_t i = 0; i < kRows && r + i < rows_; ++i) {
          float* out = scores_ + (r + i) * width_ + t0;
          for (int64_t j = 0; j < n; ++j) out[j] = dots[i][j] * p_.scale;
        }
      }
    }
  }

  void add_mass(float* mass) const {
    const int64_t count = p_.cu_q[task_.seq + 1] - p_.cu_q[task_.seq];
    const int64_t first_token = std::max(task_.first, count - p_.mass_rows);
    for (int64_t r = (first_token - task_.first) * group_; r < rows_; ++r) {
      const float* probs = scores_ + r * width_;
      const int64_t n = limit(r);
#pragma omp simd
      for (int64_t t = 0; t < n; ++t) mass[t] += probs[t];
    }
  }

  void sum_values() {
    const int64_t D = dim();
    std::fill(acc_, acc_ + rows_ * D, 0.f);
    for (int64_t t0 = 0; t0 < width_; t0 += kBlock) {
      const int64_t n = std::min(kBlock, width_ - t0);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t s = slot(t0 + j);
        const KV* value = row_of(p_.v, s);
        const float vs = stored_scale(p_.v_scale, s);
        float* dst = block_ + j * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) dst[d] = to_float(value[d]) * vs;
      }
      for (int64_t r = first_row(t0); r < rows_; ++r) {
        const int64_t seen = std::min(n, limit(r) - t0);
        add_values(acc_ + r * D, scores_ + r * width_ + t0, seen);
      }
    }
    for (int64_t r = 0; r < rows_; ++r) {
      std::copy(acc_ + r * D, acc_ + (r + 1) * D, p_.out + offset(r));
    }
  }

  // acc[0:D] += sum over j < seen of probs[j] * block_ value j (in registers when D is fixed).
  void add_values(float* acc, const float* probs, int64_t seen) const {
    if constexpr (FixedD > 0) {
      float sum[FixedD];
      std::copy(acc, acc + FixedD, sum);
      for (int64_t j = 0; j < seen; ++j) {
        const float w = probs[j];
        const float* value = block_ + j * FixedD;
#pragma omp simd
        for (int64_t d = 0; d < FixedD; ++d) sum[d] += w * value[d];
      }
      std::copy(sum, sum + FixedD, acc);
    } else {
      for (int64_t j = 0; j < seen; ++j) {
        const float w = probs[j];
        const float* value = block_ + j * dim_;
#pragma omp simd
        for (int64_t d = 0; d < dim_; ++d) acc[d] += w * value[d];
      }
    }
  }

  const Problem& p_;
  const Task& task_;
  const int64_t dim_, group_, rows_, width_, past_, query0_;
  const int32_t* table_;
  int64_t* slots_;
  float* scores_;
  float* block_;  // a block of keys [D, kBlock], or of values [kBlock, D]
  float* acc_;
};

template <typename KV>
using RunFn = void (*)(const Problem&, const Task&, Scratch&, float*);

template <typename KV, int FixedD>
void run_task(const Problem& p, const Task& task, Scratch& scratch, float* mass) {
  TaskRunner<KV, FixedD>(p, task, scratch).run(mass);
}

template <typename KV>
RunFn<KV> runner_for(int64_t dim) {
  if (dim == 64) return run_task<KV, 64>;
  if (dim == 128) return run_task<KV, 128>;
  return run_task<KV, 0>;
}

std::vector<Task> make_tasks(const Problem& p, int64_t batch) {
  std::vector<Task> tasks;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t count = p.cu_q[b + 1] - p.cu_q[b];
    for (int64_t first = 0; first < count; first += kQueryChunk) {
      const int64_t last = std::min(count, first + kQueryChunk);
      for (int64_t h = 0; h < p.kv_heads; ++h) tasks.push_back({b, h, first, last, p.past[b] + last});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.keys > b.keys; });
  return tasks;
}

template <typename KV>
void run_all(const Problem& p, const std::vector<Task>& tasks, float* mass_parts,
             int64_t mass_width) {
  const RunFn<KV> run = runner_for<KV>(p.dim);
  std::atomic<int64_t> next{0};
  const int64_t total = static_cast<int64_t>(tasks.size());
  const int64_t workers = std::min<int64_t>(total, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t i = next.fetch_add(1); i < total; i = next.fetch_add(1)) {
      run(p, tasks[i], scratch, mass_parts == nullptr ? nullptr : mass_parts + i * mass_width);
    }
  });
}

void check_tables(const at::Tensor& tables, const int64_t* past, const int64_t* cu_q,
                  int64_t page_size, int64_t pages_in_pool) {
  const int64_t batch = tables.size(0), width = tables.size(1) * page_size;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t count = cu_q[b + 1] - cu_q[b], total = past[b] + count;
    TORCH_CHECK(count >= 0 && past[b] >= 0, "paged_attention: row ", b,
                " has a negative past or query count");
    TORCH_CHECK(total <= width, "paged_attention: row ", b, " needs ", total,
                " keys but its page table holds ", width);
    const int32_t* row = tables.data_ptr<int32_t>() + b * tables.stride(0);
    for (int64_t i = 0; i < (total + page_size - 1) / page_size; ++i) {
      TORCH_CHECK(row[i] >= 0 && row[i] < pages_in_pool, "paged_attention: page ", row[i],
                  " of row ", b, " is outside the pool of ", pages_in_pool, " pages");
    }
  }
}

}  // namespace

namespace streamgrok_cpu {

// q [T, H, D] float32 (rotated); k, v [slots, KVH, D] float32, bfloat16 or int8 (int8 with
// float16 k_scale, v_scale [slots, KVH]); block_tables [B, P] int32; cu_q [B + 1] and past [B]
// int64; cos, sin float32 [>= max(past + count), D / 2]. Sequence b's queries are rows
// cu_q[b]..cu_q[b+1] at cache positions past[b], past[b] + 1, ...; each sees the keys up to
// its own position. Returns out [T, H, D] float32 and, with mass_rows > 0, mass [B, P * page]
// (the probabilities the last mass_rows queries of each sequence gave each key, summed over
// heads; zero past the keys), else an empty tensor.
std::tuple<at::Tensor, at::Tensor> paged_attention(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
    const at::Tensor& block_tables, const at::Tensor& cu_q, const at::Tensor& past,
    const at::Tensor& cos, const at::Tensor& sin, int64_t page_size, int64_t mass_rows,
    double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "paged_attention: q [T, H, D] float32");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.scalar_type() == v.scalar_type(),
              "paged_attention: k and v [slots, KVH, D] of one dtype");
  const auto kv_type = k.scalar_type();
  TORCH_CHECK(kv_type == at::kFloat || kv_type == at::kBFloat16 || kv_type == at::kChar,
              "paged_attention: K/V must be float32, bfloat16 or int8");
  const bool quantized = kv_type == at::kChar;
  TORCH_CHECK(quantized == (k_scale.has_value() && v_scale.has_value()),
              "paged_attention: int8 K/V need k_scale and v_scale, other dtypes none");
  const int64_t heads = q.size(1), dim = q.size(2), kv_heads = k.size(1);
  TORCH_CHECK(k.size(2) == dim && dim % 2 == 0 && heads % kv_heads == 0,
              "paged_attention: head sizes do not match");
  TORCH_CHECK(page_size > 0 && k.size(0) % page_size == 0, "paged_attention: bad page size");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt,
              "paged_attention: block_tables [B, P] int32");
  const int64_t batch = block_tables.size(0);
  TORCH_CHECK(cu_q.scalar_type() == at::kLong && cu_q.numel() == batch + 1 &&
                  past.scalar_type() == at::kLong && past.numel() == batch,
              "paged_attention: cu_q [B + 1] and past [B] int64");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.sizes() == cos.sizes() && cos.dim() == 2 &&
                  cos.size(1) == dim / 2,
              "paged_attention: cos and sin float32 [positions, D / 2]");
  auto tables = block_tables.stride(1) == 1 ? block_tables : block_tables.contiguous();
  auto cu = cu_q.contiguous();
  auto before = past.contiguous();
  const int64_t* cu_p = cu.data_ptr<int64_t>();
  const int64_t* past_p = before.data_ptr<int64_t>();
  TORCH_CHECK(cu_p[0] == 0 && cu_p[batch] == q.size(0), "paged_attention: cu_q must run 0..T");
  check_tables(tables, past_p, cu_p, page_size, k.size(0) / page_size);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(past_p[b] + cu_p[b + 1] - cu_p[b] <= cos.size(0),
                "paged_attention: the rotary tables are shorter than row ", b, "'s keys");
  }
  auto query = q.contiguous();
  auto keys = k.contiguous();
  auto values = v.contiguous();
  at::Tensor ks, vs;
  if (quantized) {
    ks = k_scale->contiguous();
    vs = v_scale->contiguous();
    TORCH_CHECK(ks.scalar_type() == at::kHalf && vs.scalar_type() == at::kHalf &&
                    ks.numel() == k.size(0) * kv_heads && vs.numel() == ks.numel(),
                "paged_attention: scales float16 [slots, KVH]");
  }
  auto c = cos.contiguous();
  auto s = sin.contiguous();
  auto out = at::empty_like(query);
  Problem p{query.data_ptr<float>(), keys.data_ptr(), values.data_ptr(),
            quantized ? ks.data_ptr<at::Half>() : nullptr,
            quantized ? vs.data_ptr<at::Half>() : nullptr,
            tables.data_ptr<int32_t>(), tables.stride(0), cu_p, past_p,
            c.data_ptr<float>(), s.data_ptr<float>(), out.data_ptr<float>(),
            heads, kv_heads, dim, page_size, mass_rows, static_cast<float>(scale)};
  const std::vector<Task> tasks = make_tasks(p, batch);
  const int64_t mass_width = block_tables.size(1) * page_size;
  at::Tensor parts, mass = at::empty({0}, q.options());
  if (mass_rows > 0) parts = at::zeros({static_cast<int64_t>(tasks.size()), mass_width}, q.options());
  float* parts_p = mass_rows > 0 ? parts.data_ptr<float>() : nullptr;
  if (kv_type == at::kFloat) {
    run_all<float>(p, tasks, parts_p, mass_width);
  } else if (kv_type == at::kBFloat16) {
    run_all<uint16_t>(p, tasks, parts_p, mass_width);
  } else {
    run_all<int8_t>(p, tasks, parts_p, mass_width);
  }
  if (mass_rows > 0) {
    std::vector<int64_t> owners;
    owners.reserve(tasks.size());
    for (const Task& task : tasks) owners.push_back(task.seq);
    auto index = at::tensor(owners, cu.options());
    mass = at::zeros({batch, mass_width}, q.options()).index_add_(0, index, parts);
  }
  return {out, mass};
}

}  // namespace streamgrok_cpu

TORCH_LIBRARY_FRAGMENT(streamgrok_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor? k_scale, Tensor? v_scale, "
        "Tensor block_tables, Tensor cu_q, Tensor past, Tensor cos, Tensor sin, int page_size, "
        "int mass_rows, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(streamgrok_cpu, CPU, m) { m.impl("paged_attention", &streamgrok_cpu::paged_attention); }
