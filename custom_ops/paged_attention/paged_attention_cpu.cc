// PagedAttention CPU kernel, float32. Three passes, each a ParallelFor:
//   1. prepare: rotary on q and k, scale folded into q          (per token chunk)
//   2. attend:  online softmax over key tiles                   (per work item)
//      + merge: the partial softmax of a context split          (per split group)
//   3. write:   new K/V rows into their cache slots             (per token chunk)
// Attention reads the cache before any write, so its result never depends on the write.
//
// A work item is (sequence, chunk of query tokens, context range) over all heads: it streams
// the cache in memory order (a cache row holds every kv head: [block, slot, kv head, D]), and
// each K/V row fetched serves every (token, head) of the chunk.
// A long context is split into ranges of whole segments when there are too few items to keep
// the threads busy (flash-decoding; the plan: paged_attention_plan.h); the split items write
// (max, sum, acc) rows that the merge pass combines. How a call is cut never changes a row's
// bits (pass 2 says how).
#include "paged_attention/paged_attention_cpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "paged_attention/attention_block.h"
#include "paged_attention/attention_math.h"
#include "paged_attention/attention_pass.h"
#include "paged_attention/paged_attention_plan.h"

// The vector helpers' templates are instantiated here, each always inlined into one ISA's
// copy: GCC's note that their calls would change the ABI across ISAs never applies.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace ort_lora {
namespace {

using attention_math::AccumulateValues;
using attention_math::Scores;
using attention_math::SoftmaxTile;
using attention_math::V16;
using attention_math::V4;
using attention_math::V8;
using paged_attention::AttendBlockBody;
using paged_attention::BlockBuffers;
using paged_attention::BlockRows;
using paged_attention::BlockScratch;
using paged_attention::CeilDiv;
using paged_attention::FirstSegment;
using paged_attention::KeyRun;
using paged_attention::kNegInf;
using paged_attention::kSegmentKeys;
using paged_attention::kTileKeys;
using paged_attention::KvRows;
using paged_attention::MakePlan;
using paged_attention::Plan;
using paged_attention::Problem;
using paged_attention::Segments;
using paged_attention::SoftmaxState;
using paged_attention::SplitGroup;
using paged_attention::UsesBlockForm;
using paged_attention::WorkItem;

constexpr int64_t kTokensPerChunk = 16;  // tokens per item of the prepare and write passes
constexpr size_t kUnclaimed = 2;         // last items of the attention pass not claimed ahead

// ---- pass 1: rotary and scale ------------------------------------------------------------

// dst[D] = rotary(src[D]) * mul at the position whose cos/sin rows are given.
void RotateRow(float* dst, const float* src, const float* cos, const float* sin, int64_t half,
               int64_t head_size, bool interleaved, float mul) {
  const int64_t step = interleaved ? 2 : 1, other = interleaved ? 1 : half;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = src[i * step], x2 = src[i * step + other];
    dst[i * step] = (x1 * cos[i] - x2 * sin[i]) * mul;
    dst[i * step + other] = (x2 * cos[i] + x1 * sin[i]) * mul;
  }
  for (int64_t i = 2 * half; i < head_size; ++i) dst[i] = src[i] * mul;
}

// rows [T, heads * D] of src -> dst, rotated at each token's position and multiplied by mul.
void PrepareRows(const Problem& p, const float* src, float* dst, int64_t heads, float mul,
                 int64_t t0, int64_t t1) {
  const auto& a = p.a;
  const int64_t d = a.head_size, half = a.rotary_half;
  for (int64_t t = t0; t < t1; ++t) {
    const float* cos = half ? a.cos_cache + p.positions[t] * half : nullptr;
    const float* sin = half ? a.sin_cache + p.positions[t] * half : nullptr;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t off = (t * heads + h) * d;
      if (half) {
        RotateRow(dst + off, src + off, cos, sin, half, d, a.rotary_interleaved, mul);
      } else {
        for (int64_t i = 0; i < d; ++i) dst[off + i] = src[off + i] * mul;
      }
    }
  }
}

// ---- pass 2: attention -------------------------------------------------------------------
//
// A query row's result depends only on its own query and keys, never on how the call was cut:
// keys go in tiles aligned to absolute positions (kTileKeys), whatever cache blocks or new rows
// hold them, and in segments aligned the same way (kSegmentKeys), whose softmax states are
// folded left to right by one function, in the item (a whole context) or in the merge (a split
// one). So a prompt whose prefix came from the prefix cache, or that shared its step with other
// sequences, gets the bits it would have got alone and uncached.

KeyRun NextRun(const Problem& p, const WorkItem& w, int64_t j, int64_t end) {
  const auto& a = p.a;
  const int64_t past = a.past_seqlens[w.seq];
  if (j < past) {
    const int64_t block = a.block_table[w.seq * a.max_blocks + j / a.block_size];
    const int64_t off = j % a.block_size;
    const int64_t count = std::min({a.block_size - off, past - j, end - j});
    const int64_t row = (block * a.block_size + off) * p.row_stride;
    return {a.key_cache + row, a.value_cache + row, j, count, a.block_size - off};
  }
  const int64_t token = a.cu_seqlens[w.seq] + j - past;
  return {p.k + token * p.row_stride, a.value + token * p.row_stride, j, end - j,
          a.num_tokens - token};
}

// The runs that hold keys [lo, hi) (at most one per position): their number.
int64_t TileRuns(const Problem& p, const WorkItem& w, int64_t lo, int64_t hi, KeyRun* runs) {
  int64_t n = 0;
  for (int64_t j = lo; j < hi; j += runs[n++].count) runs[n] = NextRun(p, w, j, hi);
  return n;
}

// The next tile's runs are fetched while the current one is computed, spread over its query
// rows so the memory requests stay few at a time but never stop: the cache is read once, in
// block-sized runs scattered over memory, where the hardware prefetcher alone stalls at each
// jump. Into L2, not L1: a tile's rows of every kv head (48 KB for SmolLM2's 3 heads of 64)
// would push the current tile's rows, which each kv head's query heads read in turn, out of
// L1 (on a Zen 4 EPYC, decode from memory 1.18-1.30x faster than into L1).
struct RunFetch {
  const float* k;
  const float* v;
  int64_t lines, share;  // the run's cache lines of keys (and as many of values); per part
};

// The next tile's runs as RunFetch, their lines shared out over `parts` parts.
ORT_LORA_INLINE void PlanFetches(const KeyRun* runs, int64_t num_runs, int64_t stride,
                                 int64_t parts, RunFetch* out) {
  for (int64_t r = 0; r < num_runs; ++r) {
    const int64_t lines = CeilDiv(runs[r].count * stride, 16);
    out[r] = {runs[r].k, runs[r].v, lines, CeilDiv(lines, parts)};
  }
}

// Asks for part `part` of every planned run.
ORT_LORA_INLINE void FetchPart(const RunFetch* fetch, int64_t num_runs, int64_t part) {
  for (int64_t r = 0; r < num_runs; ++r) {
    const RunFetch& f = fetch[r];
    const int64_t begin = f.share * part, end = std::min(f.lines, begin + f.share);
    for (int64_t i = begin; i < end; ++i) {
      __builtin_prefetch(f.k + i * 16, 0, 2);
      __builtin_prefetch(f.v + i * 16, 0, 2);
    }
  }
}

// (M, L, ACC) := (M, L, ACC) followed by (m, l, acc): the only way two softmax states meet.
// Out of line and built for one ISA, so that the item and the merge fold alike.
__attribute__((noinline)) void Fold(float& M, float& L, float* ACC, float m, float l,
                                    const float* acc, int64_t d) {
  if (m == kNegInf) return;  // the row saw no key of this segment
  if (M == kNegInf) {
    M = m, L = l;
    std::copy(acc, acc + d, ACC);
    return;
  }
  const float top = std::max(M, m), c0 = std::exp(M - top), c1 = std::exp(m - top);
  L = L * c0 + l * c1;
  for (int64_t i = 0; i < d; ++i) ACC[i] = ACC[i] * c0 + acc[i] * c1;
  M = top;
}

// acc / l, as one multiply per element (the same in every ISA's code).
__attribute__((noinline)) void Normalize(float* acc, float l, int64_t d) {
  const float inv = 1.0f / l;
  for (int64_t i = 0; i < d; ++i) acc[i] *= inv;
}

// One row's keys [lo, hi) of a tile, held by `runs`: online softmax update of s.
template <typename V>
ORT_LORA_INLINE void AttendTile(const float* q, const KeyRun* runs, int64_t num_runs, int64_t lo,
                                int64_t hi, int64_t head, int64_t stride, int64_t d, float softcap,
                                SoftmaxState& st, float* spare) {
  float s[kTileKeys + 16];  // Scores writes whole groups of up to 16
  const int64_t n = hi - lo;
  for (int64_t r = 0; r < num_runs; ++r) {
    const int64_t a = std::max(lo, runs[r].j), b = std::min(hi, runs[r].j + runs[r].count);
    if (a < b)
      Scores<V>(q, runs[r].k + (a - runs[r].j) * stride + head, stride, d, b - a,
                runs[r].room - (a - runs[r].j), s + a - lo, spare);
  }
  if (softcap > 0)
    for (int64_t j = 0; j < n; ++j) s[j] = softcap * std::tanh(s[j] / softcap);
  float alpha = SoftmaxTile<V, kTileKeys>(s, n, st.m, st.l);
  for (int64_t r = 0; r < num_runs; ++r) {  // acc * alpha once, then each run's values
    const int64_t a = std::max(lo, runs[r].j), b = std::min(hi, runs[r].j + runs[r].count);
    if (a >= b) continue;
    AccumulateValues<V>(st.acc, runs[r].v + (a - runs[r].j) * stride + head, s + a - lo, b - a,
                        stride, d, alpha);
    alpha = 1.0f;
  }
}

// Output row of query row r = token * num_heads + head of item w.
float* OutputRow(const Problem& p, const WorkItem& w, int64_t r) {
  return p.a.output + ((p.a.cu_seqlens[w.seq] + w.q_begin) * p.a.num_heads + r) * p.a.head_size;
}

// A split item's state row of query row r in its segment `seg` (counted from its first):
// [max, sum, acc[D]].
float* PartialRow(const Problem& p, const WorkItem& w, int64_t seg, int64_t r) {
  const int64_t rows = (w.q_end - w.q_begin) * p.a.num_heads, width = p.a.head_size + 2;
  return p.partials + w.partial + (seg * rows + r) * width;
}

// The end of the tile that holds key j, keys past `end` left out.
ORT_LORA_INLINE int64_t TileEnd(int64_t j, int64_t end) {
  return std::min(end, (j / kTileKeys + 1) * kTileKeys);
}

// Every query row of item w over the keys of segment [lo, hi), tile by tile; the next tile's
// runs are prefetched meanwhile, and with `after` (the thread's next item, given for w's last
// segment) that item's first tile too, a share at each part of every tile.
template <typename V, bool kBlock>
ORT_LORA_INLINE void AttendSegment(const Problem& p, const WorkItem& w, int64_t lo, int64_t hi,
                                   std::vector<SoftmaxState>& st, float* spare,
                                   const WorkItem* after) {
  const auto& a = p.a;
  const int64_t d = a.head_size, parts = (w.q_end - w.q_begin) * a.num_heads;
  KeyRun runs[kTileKeys], next[kTileKeys];
  RunFetch fetch[kTileKeys];
  // The block form: q transposed per kv head, at the item's first segment (the thread's
  // buffer keeps it for the item's others), and the tile's scores.
  const int64_t rows = BlockRows<V>(p, w);
  if constexpr (kBlock) {
    if (lo == w.ctx_begin) {
      const int64_t kv_rows = KvRows(p, w);
      std::vector<float>& qt = BlockScratch().qt;
      BlockScratch().scores.resize(kTileKeys * rows);
      qt.assign(a.kv_num_heads * d * rows, 0.0f);
      for (int64_t r = 0; r < kv_rows * a.kv_num_heads; ++r) {
        const int64_t kv = r / kv_rows, t = w.q_begin + r % kv_rows / p.group;
        const int64_t h = kv * p.group + r % p.group;
        const float* q = p.q + ((a.cu_seqlens[w.seq] + t) * a.num_heads + h) * d;
        for (int64_t i = 0; i < d; ++i) qt[(kv * d + i) * rows + r % kv_rows] = q[i];
      }
    }
  }
  int64_t num_next = TileRuns(p, w, lo, TileEnd(lo, hi), next);
  RunFetch ahead[kTileKeys];
  int64_t num_ahead = 0, ahead_part = 0;
  if (after != nullptr) {
    KeyRun first[kTileKeys];
    const int64_t b = after->ctx_begin;
    num_ahead = TileRuns(p, *after, b, TileEnd(b, after->ctx_end), first);
    const int64_t tiles = (hi - 1) / kTileKeys - lo / kTileKeys + 1;
    PlanFetches(first, num_ahead, p.row_stride, parts * tiles, ahead);
  }
  for (int64_t j = lo; j < hi;) {
    const int64_t j1 = TileEnd(j, hi), num_runs = num_next;
    std::copy(next, next + num_next, runs);
    num_next = j1 < hi ? TileRuns(p, w, j1, TileEnd(j1, hi), next) : 0;
    PlanFetches(next, num_next, p.row_stride, parts, fetch);
    // One kv head at a time: its rows of the tile (16 KB for SmolLM2) stay in L1 for all of
    // its query rows, where a token's heads in turn read all three (48 KB).
    for (int64_t kv = 0; kv < a.kv_num_heads; ++kv) {
      if constexpr (kBlock) {
        for (int64_t t = 0; t < w.q_end - w.q_begin; ++t) {
          for (int64_t h = kv * p.group; h < (kv + 1) * p.group; ++h) {
            FetchPart(fetch, num_next, t * a.num_heads + h);
            FetchPart(ahead, num_ahead, ahead_part++);
          }
        }
        BlockBuffers& b = BlockScratch();
        const float* q = b.qt.data() + kv * d * rows;
        AttendBlockBody<V>({p, w, kv, q, rows, runs, num_runs, j, j1, st, b.scores.data()});
        continue;
      }
      for (int64_t t = w.q_begin; t < w.q_end; ++t) {
        const int64_t pos = a.past_seqlens[w.seq] + t;
        const int64_t k0 = a.local_window >= 0 ? std::max(j, pos - a.local_window) : j;
        const int64_t k1 = std::min(j1, pos + 1);
        const int64_t r0 = (t - w.q_begin) * a.num_heads;
        const float* q = p.q + (a.cu_seqlens[w.seq] + t) * a.num_heads * d;  // [H, D]
        for (int64_t h = kv * p.group; h < (kv + 1) * p.group; ++h) {
          FetchPart(fetch, num_next, r0 + h);
          FetchPart(ahead, num_ahead, ahead_part++);
          if (k0 >= k1) continue;
          AttendTile<V>(q + h * d, runs, num_runs, k0, k1, kv * d, p.row_stride, d, a.softcap,
                        st[r0 + h], spare);
        }
      }
    }
    j = j1;
  }
}

// A segment in the block form, out of line, one copy per ISA as the item's: with both forms
// inlined into the item's function, the per-row form (decode) ran 2-7 % slower (the compiler's
// choices for its loops changed).
using SegmentFn = void (*)(const Problem&, const WorkItem&, int64_t, int64_t,
                           std::vector<SoftmaxState>&, float*, const WorkItem*);
#ifdef ORT_LORA_ISA_COPIES
__attribute__((target("arch=x86-64-v4"),
               noinline)) void BlockSegmentAvx512(const Problem& p, const WorkItem& w, int64_t lo,
                                                  int64_t hi, std::vector<SoftmaxState>& st,
                                                  float* spare, const WorkItem* after) {
  AttendSegment<V16, true>(p, w, lo, hi, st, spare, after);
}
__attribute__((target("arch=x86-64-v3"), noinline)) void BlockSegmentAvx2(
    const Problem& p, const WorkItem& w, int64_t lo, int64_t hi, std::vector<SoftmaxState>& st,
    float* spare, const WorkItem* after) {
  AttendSegment<V8, true>(p, w, lo, hi, st, spare, after);
}
__attribute__((noinline)) void BlockSegmentBase(const Problem& p, const WorkItem& w, int64_t lo,
                                                int64_t hi, std::vector<SoftmaxState>& st,
                                                float* spare, const WorkItem* after) {
  AttendSegment<V4, true>(p, w, lo, hi, st, spare, after);
}
template <typename V>
constexpr SegmentFn kBlockSegment = sizeof(V) == 64   ? BlockSegmentAvx512
                                    : sizeof(V) == 32 ? BlockSegmentAvx2
                                                      : BlockSegmentBase;
#else
template <typename V>
__attribute__((noinline)) void BlockSegmentOne(const Problem& p, const WorkItem& w, int64_t lo,
                                               int64_t hi, std::vector<SoftmaxState>& st,
                                               float* spare, const WorkItem* after) {
  AttendSegment<V, true>(p, w, lo, hi, st, spare, after);
}
template <typename V>
constexpr SegmentFn kBlockSegment = BlockSegmentOne<V>;
#endif

// Item w, segment by segment: a split item leaves each segment's states in its partial rows
// (the merge folds them); a whole one accumulates its first segment in the output rows (as
// Fold would copy it there) and folds the others into them as it goes.
template <typename V>
ORT_LORA_INLINE void RunItemBody(const Problem& p, const WorkItem& w, const WorkItem* after) {
  const int64_t d = p.a.head_size, rows = (w.q_end - w.q_begin) * p.a.num_heads;
  thread_local std::vector<SoftmaxState> st, folded;  // a segment's states; the folded ones
  thread_local std::vector<float> scratch;            // later segments' accumulators
  thread_local std::vector<float> spare;              // Scores' last keys (zeros at first)
  st.resize(rows);
  spare.resize(sizeof(V) / sizeof(float) * d);
  folded.resize(rows);
  const int64_t first = FirstSegment(w.ctx_begin), count = Segments(w.ctx_begin, w.ctx_end);
  if (w.partial < 0 && count > 1) scratch.resize(rows * d);
  const bool block = UsesBlockForm<V>(p, w);
  for (int64_t seg = 0; seg < count; ++seg) {
    const int64_t lo = std::max<int64_t>(w.ctx_begin, (first + seg) * kSegmentKeys);
    const int64_t hi = std::min<int64_t>(w.ctx_end, (first + seg + 1) * kSegmentKeys);
    for (int64_t r = 0; r < rows; ++r) {
      float* acc = w.partial >= 0 ? PartialRow(p, w, seg, r) + 2
                   : seg == 0     ? OutputRow(p, w, r)
                                  : scratch.data() + r * d;
      st[r] = {kNegInf, 0.0f, acc};
      std::fill(acc, acc + d, 0.0f);
    }
    const WorkItem* then = seg + 1 == count ? after : nullptr;
    if (block)
      kBlockSegment<V>(p, w, lo, hi, st, spare.data(), then);
    else
      AttendSegment<V, false>(p, w, lo, hi, st, spare.data(), then);
    for (int64_t r = 0; r < rows; ++r) {
      if (w.partial >= 0) {
        st[r].acc[-2] = st[r].m;
        st[r].acc[-1] = st[r].l;
      } else if (seg == 0) {
        folded[r] = st[r];
      } else {
        Fold(folded[r].m, folded[r].l, folded[r].acc, st[r].m, st[r].l, st[r].acc, d);
      }
    }
  }
  if (w.partial < 0)
    for (int64_t r = 0; r < rows; ++r) Normalize(folded[r].acc, folded[r].l, d);
}

// One copy of the attention pass per instruction set, its vector width following the widest
// registers (the AVX2 copy must not be the AVX-512 one split in halves: its 16-key score
// tiles would need 32 of AVX2's 16 registers).
using ItemFn = void (*)(const Problem&, const WorkItem&, const WorkItem*);
#ifdef ORT_LORA_ISA_COPIES
__attribute__((target("arch=x86-64-v4"))) void RunItemAvx512(const Problem& p, const WorkItem& w,
                                                             const WorkItem* after) {
  RunItemBody<V16>(p, w, after);
}
__attribute__((target("arch=x86-64-v3"))) void RunItemAvx2(const Problem& p, const WorkItem& w,
                                                           const WorkItem* after) {
  RunItemBody<V8>(p, w, after);
}
void RunItemBase(const Problem& p, const WorkItem& w, const WorkItem* after) {
  RunItemBody<V4>(p, w, after);
}

// The widest ISA the CPU has, capped by ORT_LORA_ATTENTION_ISA (avx512 | avx2 | baseline) so
// that tests can run the narrower copies on a machine that has AVX-512.
ItemFn SelectRunItem() {
  __builtin_cpu_init();
  const char* cap = std::getenv("ORT_LORA_ATTENTION_ISA");
  const bool allow512 = cap == nullptr || std::strcmp(cap, "avx512") == 0;
  const bool allow2 = allow512 || std::strcmp(cap, "avx2") == 0;
  if (allow512 && __builtin_cpu_supports("x86-64-v4")) return RunItemAvx512;
  if (allow2 && __builtin_cpu_supports("x86-64-v3")) return RunItemAvx2;
  return RunItemBase;
}
#else  // one ISA, the compiler's target
ItemFn SelectRunItem() {
#if defined(__AVX512F__)
  return RunItemBody<V16>;
#elif defined(__AVX2__)
  return RunItemBody<V8>;
#else
  return RunItemBody<V4>;
#endif
}
#endif

// Folds the segment states of one split group, item by item and segment by segment, into
// the output.
void MergeSplits(const Problem& p, const Plan& plan, const SplitGroup& g) {
  const int64_t d = p.a.head_size;
  const WorkItem& w0 = plan.items[g.first];
  const int64_t rows = (w0.q_end - w0.q_begin) * p.a.num_heads;
  for (int64_t r = 0; r < rows; ++r) {
    float m = kNegInf, l = 0.0f;
    float* out = OutputRow(p, w0, r);
    std::fill(out, out + d, 0.0f);
    for (int64_t s = 0; s < g.count; ++s) {
      const WorkItem& w = plan.items[g.first + s];
      for (int64_t seg = 0; seg < Segments(w.ctx_begin, w.ctx_end); ++seg) {
        const float* src = PartialRow(p, w, seg, r);
        Fold(m, l, out, src[0], src[1], src + 2, d);
      }
    }
    Normalize(out, l, d);
  }
}

// ---- pass 3: cache write -----------------------------------------------------------------

void WriteRows(const Problem& p, int64_t t0, int64_t t1) {
  const auto& a = p.a;
  for (int64_t t = t0; t < t1; ++t) {
    if (p.slots[t] < 0) continue;
    const size_t bytes = static_cast<size_t>(p.row_stride) * sizeof(float);
    std::memcpy(a.key_cache + p.slots[t] * p.row_stride, p.k + t * p.row_stride, bytes);
    std::memcpy(a.value_cache + p.slots[t] * p.row_stride, a.value + t * p.row_stride, bytes);
  }
}

// Position and cache slot of every new token.
void LocateTokens(Problem& p) {
  const auto& a = p.a;
  p.positions.resize(a.num_tokens);
  p.slots.resize(a.num_tokens);
  for (int64_t b = 0; b < a.num_seqs; ++b) {
    for (int64_t t = a.cu_seqlens[b]; t < a.cu_seqlens[b + 1]; ++t) {
      const int64_t pos = a.past_seqlens[b] + t - a.cu_seqlens[b];
      p.positions[t] = static_cast<int32_t>(pos);
      if (a.slot_mapping) {
        p.slots[t] = a.slot_mapping[t];
      } else {
        const int64_t block = a.block_table[b * a.max_blocks + pos / a.block_size];
        p.slots[t] = static_cast<int32_t>(block * a.block_size + pos % a.block_size);
      }
    }
  }
}

}  // namespace

void PagedAttentionCpu(const PagedAttentionArgs& a, const ParallelFor& parallel_for) {
  if (a.num_tokens == 0) return;
  const int64_t group = a.num_heads / a.kv_num_heads;
  // Scratch written in full before it is read: not zeroed first.
  const std::unique_ptr<float[]> q(new float[a.num_tokens * a.num_heads * a.head_size]);
  const std::unique_ptr<float[]> k(
      a.rotary_half ? new float[a.num_tokens * a.kv_num_heads * a.head_size] : nullptr);
  Problem p{
      a,  group, a.kv_num_heads * a.head_size, q.get(), a.rotary_half ? k.get() : a.key, nullptr,
      {}, {}};
  LocateTokens(p);
  const size_t token_chunks = CeilDiv(a.num_tokens, kTokensPerChunk);
  parallel_for(token_chunks, [&](size_t c) {
    const int64_t t0 = c * kTokensPerChunk, t1 = std::min(a.num_tokens, t0 + kTokensPerChunk);
    PrepareRows(p, a.query, q.get(), a.num_heads, a.scale, t0, t1);
    if (a.rotary_half) PrepareRows(p, a.key, k.get(), a.kv_num_heads, 1.0f, t0, t1);
  });
  const Plan plan = MakePlan(a, group);
  const std::unique_ptr<float[]> partials(new float[plan.partial_floats]);
  p.partials = partials.get();
  static const ItemFn run_item = SelectRunItem();
  const size_t n = plan.items.size();
  if (a.num_tokens > a.num_seqs) {  // a prompt: its items share their keys, which stay cached
    parallel_for(n, [&](size_t i) { run_item(p, plan.items[i], nullptr); });
  } else {
    // Decode: each thread claims its next item before it runs the current one, which fetches
    // the next one's first tile meanwhile (a decode item is one token over a context of often
    // one or two tiles, whose first tile would otherwise wait on memory). The last kUnclaimed
    // items are not claimed ahead, so that no thread idles at the end while another holds two.
    std::atomic<size_t> claimed{0};
    parallel_for(n, [&](size_t) {
      for (size_t i = claimed.fetch_add(1); i < n;) {
        const size_t j = i + kUnclaimed < n ? claimed.fetch_add(1) : n;
        run_item(p, plan.items[i], j < n ? &plan.items[j] : nullptr);
        i = j < n ? j : claimed.fetch_add(1);
      }
    });
  }
  parallel_for(plan.splits.size(), [&](size_t i) { MergeSplits(p, plan, plan.splits[i]); });
  parallel_for(token_chunks, [&](size_t c) {
    const int64_t t0 = c * kTokensPerChunk;
    WriteRows(p, t0, std::min(a.num_tokens, t0 + kTokensPerChunk));
  });
}

}  // namespace ort_lora
