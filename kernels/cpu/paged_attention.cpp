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
//
// Where a step has fewer (sequence, KV head) pairs of one query token than would keep the
// threads busy (one sequence has 3 KV heads for 2 threads), each pair's keys are split into
// parts (as flash-decoding does): a part's task leaves its rows' peak score, sum of
// exponentials and unnormalized value sums (and, for the mass, its exponentials), and a
// second pass combines the parts of each pair exactly.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "attention_math.h"
#include "native_ops.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define STREAMGROK_ATTENTION_AVX2 1
#endif

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
  int64_t keys;                       // keys its last query sees
  int64_t key_first = 0;              // the keys it reads: [key_first, keys)
  int64_t part = -1;                  // its slot among the split parts, or -1 (whole)
  int64_t cost() const { return keys - key_first; }
};

// What a part of a split (sequence, KV head) leaves for the combining pass: per row, the
// peak score, the sum of exp(score - peak) and the values weighted by those exponentials;
// with the mass wanted, the exponentials themselves.
struct Parts {
  float* peaks;   // [parts, rows]
  float* sums;    // [parts, rows]
  float* values;  // [parts, rows, D]
  float* exps;    // [parts, rows, part width], or null
  int64_t rows, dim, width;
};

// A thread's buffers, reused from task to task.
struct Scratch {
  std::vector<float> floats;   // scores, a block of keys or values, accumulators
  std::vector<int64_t> slots;  // the slot of each key of the task's sequence
};

// Where row `row` of a task's query (and its output) starts in q and out.
inline int64_t row_offset(const Problem& p, const Task& task, int64_t row) {
  const int64_t group = p.heads / p.kv_heads;
  return ((p.cu_q[task.seq] + task.first + row / group) * p.heads + task.kv_head * group +
          row % group) * p.dim;
}

template <typename KV, int FixedD>
class TaskRunner {
 public:
  TaskRunner(const Problem& p, const Task& task, Scratch& scratch)
      : p_(p), task_(task), dim_(FixedD > 0 ? FixedD : p.dim), group_(p.heads / p.kv_heads),
        rows_((task.last - task.first) * group_), key0_(task.key_first),
        width_(task.keys - task.key_first), past_(p.past[task.seq]),
        table_(p.tables + task.seq * p.table_stride) {
    scratch.floats.resize(rows_ * width_ + kBlock * dim_ + rows_ * dim_);
    scores_ = scratch.floats.data();
    // every key's slot, found once (several reads per key), page by page (a division per
    // key took a tenth of a long decode row's time)
    scratch.slots.resize(width_);
    slots_ = scratch.slots.data();
    const int64_t page_size = p.page_size;
    for (int64_t t = 0, page = key0_ / page_size; t < width_; ++page) {
      const int64_t base = static_cast<int64_t>(table_[page]) * page_size;
      for (int64_t at = (key0_ + t) % page_size; at < page_size && t < width_; ++at, ++t)
        slots_[t] = base + at;
    }
    block_ = scores_ + rows_ * width_;
    acc_ = block_ + kBlock * dim_;
  }

  // Scores, softmax, values, output; adds the mass rows' probabilities to `mass` (or null).
  // A part of a split pair leaves its share in `parts` instead (see Parts).
  void run(float* mass, const Parts& parts) {
    if (rows_ <= kFewRows) {
      score_few_rows();
    } else {
      score();
    }
    if (task_.part < 0) {
      for (int64_t r = 0; r < rows_; ++r) softmax_row(scores_ + r * width_, limit(r));
      if (mass != nullptr) add_mass(mass);
      sum_values();
      write_rows();
      return;
    }
    // a part: one query token, so every row sees every key of the part
    const int64_t at = task_.part * parts.rows;
    for (int64_t r = 0; r < rows_; ++r) {
      float* row = scores_ + r * width_;
      parts.sums[at + r] = streamgrok_cpu::exponentials(row, width_, parts.peaks + at + r);
      if (parts.exps != nullptr)
        std::copy(row, row + width_, parts.exps + (at + r) * parts.width);
    }
    sum_values();
    std::copy(acc_, acc_ + rows_ * dim(), parts.values + at * parts.dim);
  }

 private:
  int64_t dim() const { return FixedD > 0 ? FixedD : dim_; }
  // How many of the task's keys row `row` sees.
  int64_t limit(int64_t row) const {
    return std::min(width_, past_ + task_.first + row / group_ + 1 - key0_);
  }

  // The first row whose query sees the task's key t (rows are query-token major, so every
  // later row sees it too).
  int64_t first_row(int64_t t) const {
    const int64_t token = key0_ + t - past_;
    return token <= task_.first ? 0 : (token - task_.first) * group_;
  }

  int64_t slot(int64_t t) const { return slots_[t]; }

  int64_t offset(int64_t row) const { return row_offset(p_, task_, row); }

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
      const int64_t t = t0 + j, s = slot(t), position = key0_ + t;
      const KV* key = row_of(p_.k, s);
      const float ks = stored_scale(p_.k_scale, s);
      const float* c = p_.cos + position * half;
      const float* sn = p_.sin + position * half;
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
#ifdef STREAMGROK_ATTENTION_AVX2
      if constexpr (FixedD > 0 && FixedD % 8 == 0) {
        int64_t r = first_row(t0);
        for (; r + 2 <= rows_; r += 2)
          for (int64_t j0 = 0; j0 < n; j0 += 4) score_four_keys<2>(r, t0, j0, n);
        for (; r < rows_; ++r)
          for (int64_t j0 = 0; j0 < n; j0 += 4) score_four_keys<1>(r, t0, j0, n);
        continue;
      }
#endif
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

#ifdef STREAMGROK_ATTENTION_AVX2
  // Rows r..r+R-1 against keys j0..j0+3 of the block loaded by `load_keys<true>`: 4R dot
  // products in independent accumulators, each key's vectors loaded once for the R rows,
  // summed across lanes four keys at a time (a horizontal sum per key, a chain of shuffles
  // and adds, took as long as its dot product). Stores the scores of keys before n.
  template <int R>
  void score_four_keys(int64_t r, int64_t t0, int64_t j0, int64_t n) {
    constexpr int64_t D = FixedD;
    __m256 acc[R][4];
    const float* query[R];
    for (int i = 0; i < R; ++i) {
      query[i] = p_.q + offset(r + i);
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_ps();
    }
    const float* keys = block_ + j0 * D;
    for (int64_t d = 0; d < D; d += 8) {
      __m256 key[4];
      for (int j = 0; j < 4; ++j) key[j] = _mm256_loadu_ps(keys + j * D + d);
      for (int i = 0; i < R; ++i) {
        const __m256 q = _mm256_loadu_ps(query[i] + d);
        for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_fmadd_ps(q, key[j], acc[i][j]);
      }
    }
    const __m128 scale = _mm_set1_ps(p_.scale);
    for (int i = 0; i < R; ++i) {
      // [k0 k1 k2 k3 | k0 k1 k2 k3] partial sums, then the two halves added
      const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(acc[i][0], acc[i][1]),
                                         _mm256_hadd_ps(acc[i][2], acc[i][3]));
      const __m128 scores = _mm_mul_ps(
          _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1)), scale);
      float* out = scores_ + (r + i) * width_ + t0 + j0;
      if (j0 + 4 <= n) {
        _mm_storeu_ps(out, scores);
      } else {
        alignas(16) float four[4];
        _mm_store_ps(four, scores);
        for (int64_t j = 0; j < n - j0; ++j) out[j] = four[j];
      }
    }
  }
#endif

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
      for (int64_t t = 0; t < n; ++t) mass[key0_ + t] += probs[t];
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
  }

  void write_rows() const {
    const int64_t D = dim();
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
  const int64_t dim_, group_, rows_, key0_, width_, past_;
  const int32_t* table_;
  int64_t* slots_;
  float* scores_;
  float* block_;  // a block of keys [D, kBlock], or of values [kBlock, D]
  float* acc_;
};

template <typename KV>
using RunFn = void (*)(const Problem&, const Task&, Scratch&, float*, const Parts&);

template <typename KV, int FixedD>
void run_task(const Problem& p, const Task& task, Scratch& scratch, float* mass,
              const Parts& parts) {
  TaskRunner<KV, FixedD>(p, task, scratch).run(mass, parts);
}

template <typename KV>
RunFn<KV> runner_for(int64_t dim) {
  if (dim == 64) return run_task<KV, 64>;
  if (dim == 128) return run_task<KV, 128>;
  return run_task<KV, 0>;
}

constexpr int64_t kTasksPerThread = 4;  // split pairs' keys until there are this many tasks
constexpr int64_t kMinPartKeys = 256;   // a part's keys at least (its merge has a cost)

// The step's tasks, longest first, and how many of them are parts of split pairs. A pair
// of one query token is split where the pairs of one token are fewer than
// kTasksPerThread x threads, into parts of whole blocks.
std::vector<Task> make_tasks(const Problem& p, int64_t batch, int64_t threads,
                             int64_t* part_count) {
  int64_t single = 0;  // (sequence, KV head) pairs of one query token
  for (int64_t b = 0; b < batch; ++b) single += (p.cu_q[b + 1] - p.cu_q[b] == 1) * p.kv_heads;
  const int64_t wanted = kTasksPerThread * threads;
  std::vector<Task> tasks;
  int64_t parts = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t count = p.cu_q[b + 1] - p.cu_q[b], keys = p.past[b] + count;
    int64_t split = 1;
    if (count == 1 && single > 0 && single < wanted) {
      split = std::min((wanted + single - 1) / single, keys / kMinPartKeys);
    }
    if (split > 1) {
      const int64_t part_keys = (keys + split - 1) / split;
      const int64_t step = (part_keys + kBlock - 1) / kBlock * kBlock;
      for (int64_t h = 0; h < p.kv_heads; ++h)
        for (int64_t k0 = 0; k0 < keys; k0 += step) {
          Task task{b, h, 0, 1, std::min(keys, k0 + step)};
          task.key_first = k0;
          task.part = parts++;
          tasks.push_back(task);
        }
      continue;
    }
    for (int64_t first = 0; first < count; first += kQueryChunk) {
      const int64_t last = std::min(count, first + kQueryChunk);
      for (int64_t h = 0; h < p.kv_heads; ++h) tasks.push_back({b, h, first, last, p.past[b] + last});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.cost() > b.cost(); });
  *part_count = parts;
  return tasks;
}

template <typename KV>
void run_all(const Problem& p, const std::vector<Task>& tasks, float* mass_parts,
             int64_t mass_width, const Parts& parts) {
  const RunFn<KV> run = runner_for<KV>(p.dim);
  std::atomic<int64_t> next{0};
  const int64_t total = static_cast<int64_t>(tasks.size());
  const int64_t workers = std::min<int64_t>(total, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t i = next.fetch_add(1); i < total; i = next.fetch_add(1)) {
      run(p, tasks[i], scratch,
          mass_parts == nullptr ? nullptr : mass_parts + i * mass_width, parts);
    }
  });
}

// The combining pass: each split pair's rows from its parts' shares, exactly (the parts'
// exponentials rescaled to the pair's peak and sum), into out and, with the mass wanted,
// each part's row of mass_parts (its task's).
void combine_parts(const Problem& p, const std::vector<Task>& tasks, const Parts& parts,
                   float* mass_parts, int64_t mass_width) {
  std::vector<std::vector<int64_t>> pairs;  // task indices of each split pair
  {
    std::vector<std::pair<int64_t, int64_t>> keyed;  // (seq * KVH + head, task index)
    for (int64_t i = 0; i < static_cast<int64_t>(tasks.size()); ++i)
      if (tasks[i].part >= 0) keyed.push_back({tasks[i].seq * p.kv_heads + tasks[i].kv_head, i});
    std::stable_sort(keyed.begin(), keyed.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    for (size_t i = 0; i < keyed.size(); ++i) {
      if (i == 0 || keyed[i].first != keyed[i - 1].first) pairs.emplace_back();
      pairs.back().push_back(keyed[i].second);
    }
  }
  const int64_t rows = parts.rows, D = parts.dim;
  at::parallel_for(0, static_cast<int64_t>(pairs.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights;
    for (int64_t pair = begin; pair < end; ++pair) {
      const std::vector<int64_t>& members = pairs[pair];
      weights.resize(members.size());
      for (int64_t r = 0; r < rows; ++r) {
        // (built with -ffast-math: no infinities, so the first part's peak starts the max)
        float peak = parts.peaks[tasks[members[0]].part * rows + r];
        for (int64_t i : members) peak = std::max(peak, parts.peaks[tasks[i].part * rows + r]);
        float sum = 0.f;
        for (size_t m = 0; m < members.size(); ++m) {
          const int64_t at = tasks[members[m]].part * rows + r;
          weights[m] = std::exp(parts.peaks[at] - peak);
          sum += parts.sums[at] * weights[m];
        }
        for (size_t m = 0; m < members.size(); ++m) weights[m] /= sum;
        float* out = p.out + row_offset(p, tasks[members[0]], r);
        std::fill(out, out + D, 0.f);
        for (size_t m = 0; m < members.size(); ++m) {
          const Task& task = tasks[members[m]];
          const float* values = parts.values + (task.part * rows + r) * D;
          const float w = weights[m];
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) out[d] += w * values[d];
          if (mass_parts != nullptr) {
            const float* exps = parts.exps + (task.part * rows + r) * parts.width;
            float* mass = mass_parts + members[m] * mass_width + task.key_first;
            const int64_t n = task.cost();
#pragma omp simd
            for (int64_t t = 0; t < n; ++t) mass[t] += w * exps[t];
          }
        }
      }
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
  int64_t part_count = 0;
  const std::vector<Task> tasks = make_tasks(p, batch, at::get_num_threads(), &part_count);
  const int64_t mass_width = block_tables.size(1) * page_size;
  at::Tensor parts, mass = at::empty({0}, q.options());
  if (mass_rows > 0) parts = at::zeros({static_cast<int64_t>(tasks.size()), mass_width}, q.options());
  float* parts_p = mass_rows > 0 ? parts.data_ptr<float>() : nullptr;
  // the split pairs' shares (one query token: a part's rows are the query group)
  const int64_t group = heads / kv_heads;
  int64_t part_width = 0;
  for (const Task& task : tasks)
    if (task.part >= 0) part_width = std::max(part_width, task.cost());
  const int64_t share = group * (2 + dim) + (mass_rows > 0 ? group * part_width : 0);
  at::Tensor shares = at::empty({part_count * share}, q.options());
  float* share_p = shares.data_ptr<float>();
  const Parts split{share_p, share_p + part_count * group, share_p + 2 * part_count * group,
                    mass_rows > 0 ? share_p + part_count * group * (2 + dim) : nullptr,
                    group, dim, part_width};
  if (kv_type == at::kFloat) {
    run_all<float>(p, tasks, parts_p, mass_width, split);
  } else if (kv_type == at::kBFloat16) {
    run_all<uint16_t>(p, tasks, parts_p, mass_width, split);
  } else {
    run_all<int8_t>(p, tasks, parts_p, mass_width, split);
  }
  if (part_count > 0) combine_parts(p, tasks, split, parts_p, mass_width);
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
