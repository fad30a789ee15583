// The block form of PagedAttention's attention pass (paged_attention_cpu.cc), for items with a
// register's worth of query rows per kv head or more (a prompt's tokens): a tile's keys are scored
// against all of a kv head's rows at once, the rows in the lanes of a few registers (q transposed:
// qt[i][row]). Each (row, key) score takes Scores' operations in Scores' order, lane class by lane
// class: Scores puts dimension c * W + l in lane l and multiply-adds chunk c into it in turn, then
// sums the W lanes by a tree (TransposeSum: lane l with lane l + W / 2, and so on down); here lane
// class l is a register of rows that multiply-adds q's dimension c * W + l for c in turn, and the
// tree adds those registers the same way. So a row gets the bits the per-row form would give it
// (the cut tests check), with no shuffles and each key's dimensions read as broadcasts. The tile's
// softmax step likewise follows SoftmaxTile per lane: the max, the exps, the sum of the exps by
// their position in the tile modulo W, then the same tree. The value sums are each row's, four rows
// at a time where their keys are the same. Needs every row's keys to start at the tile's start (no
// local window) and d to be C whole registers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "paged_attention/attention_math.h"
#include "paged_attention/attention_pass.h"
#include "paged_attention/paged_attention_plan.h"

namespace ort_lora::paged_attention {

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"  // always inlined into one ISA's copy: no ABI

using attention_math::AccumulateValues;
using attention_math::Load;

constexpr int kMaxBlockRows = 32;  // a kv head's query rows in an item, most

// Item w's query rows of one kv head (token by token, then its heads): their number, and that
// padded to whole registers of V (the block form's row count).
inline int64_t KvRows(const Problem& p, const WorkItem& w) {
  return (w.q_end - w.q_begin) * p.group;
}
template <typename V>
int64_t BlockRows(const Problem& p, const WorkItem& w) {
  constexpr int W = sizeof(V) / sizeof(float);
  return CeilDiv(KvRows(p, w), W) * W;
}

// Whether item w takes the block form: a kv head has a register's worth of query rows or more
// (at most 4 registers, kMaxBlockRows), d is 4 or 8 registers, no local window (every row's
// keys in a tile start at the tile's start).
template <typename V>
bool UsesBlockForm(const Problem& p, const WorkItem& w) {
  constexpr int W = sizeof(V) / sizeof(float);
  const int64_t d = p.a.head_size, rows = BlockRows<V>(p, w);
  return p.a.local_window < 0 && (d == 4 * W || d == 8 * W) && KvRows(p, w) >= W && rows <= 4 * W &&
         rows <= kMaxBlockRows;
}

// A thread's buffers for the block form.
struct BlockBuffers {
  std::vector<float> qt, scores;
};
inline BlockBuffers& BlockScratch() {
  thread_local BlockBuffers buffers;
  return buffers;
}

// The lane-class tree of NK keys' scores over NV registers of rows (q: qt[d][ROWS]): node
// (K, L) is node (K - 1, L) + node (K - 1, L + W >> K); a leaf is lane class L's chunks'
// multiply-adds. out[k * NV + v]: key k's scores of register v's rows.
template <typename V, int C, int ROWS, int NK, int NV, int K, int L>
ORT_LORA_INLINE void ScoreTree(const float* qt, const float* const* key, V* out) {
  constexpr int W = sizeof(V) / sizeof(float);
  if constexpr (K == 0) {
    V acc[NK * NV];
    for (int i = 0; i < NK * NV; ++i) acc[i] = V{};
    for (int c = 0; c < C; ++c) {
      V q[NV];
      for (int v = 0; v < NV; ++v) q[v] = Load<V>(qt + (c * W + L) * ROWS + v * W);
      for (int k = 0; k < NK; ++k) {
        const float x = key[k][c * W + L];
        for (int v = 0; v < NV; ++v) acc[k * NV + v] += q[v] * x;
      }
    }
    for (int i = 0; i < NK * NV; ++i) out[i] = acc[i];
  } else {
    V left[NK * NV], right[NK * NV];
    ScoreTree<V, C, ROWS, NK, NV, K - 1, L>(qt, key, left);
    ScoreTree<V, C, ROWS, NK, NV, K - 1, L + (W >> K)>(qt, key, right);
    for (int i = 0; i < NK * NV; ++i) out[i] = left[i] + right[i];
  }
}

template <int W>
constexpr int Log2() {
  return W == 1 ? 0 : 1 + Log2<W / 2>();
}

// NK keys against the NV registers of rows from register v0: out[key][ROWS].
template <typename V, int C, int ROWS, int NK, int NV>
ORT_LORA_INLINE void ScoreKeys(const float* qt, const float* const* key, int v0, float* out) {
  constexpr int W = sizeof(V) / sizeof(float);
  V score[NK * NV];
  ScoreTree<V, C, ROWS, NK, NV, Log2<W>(), 0>(qt + v0 * W, key, score);
  for (int k = 0; k < NK; ++k)
    for (int v = 0; v < NV; ++v)
      std::memcpy(out + k * ROWS + (v0 + v) * W, &score[k * NV + v], sizeof(V));
}

// Scores of keys [j, j1) (held by `runs`, kv head at offset `head`) against ROWS query rows
// whose q is qt[d][ROWS]: out[key - j][row]. Two registers of rows and four keys at a time, so
// that each load of q serves four keys' multiply-adds and each key's broadcast two registers'
// (AVX-512 and AVX2 alike: four keys were 1.2-1.3x two, or one on AVX2; eight slower).
template <typename V, int C, int ROWS>
ORT_LORA_INLINE void ScoreBlock(const float* qt, const KeyRun* runs, int64_t num_runs, int64_t j,
                                int64_t j1, int64_t head, int64_t stride, float* out) {
  constexpr int W = sizeof(V) / sizeof(float), NK = 4, R = ROWS / W;
  const float* keys[kTileKeys];
  int64_t n = 0;
  for (int64_t r = 0; r < num_runs; ++r) {
    const int64_t a = std::max(j, runs[r].j), b = std::min(j1, runs[r].j + runs[r].count);
    for (int64_t k = a; k < b; ++k) keys[n++] = runs[r].k + (k - runs[r].j) * stride + head;
  }
  int64_t k = 0;
  for (; k + NK <= n; k += NK) {
    for (int v = 0; v + 2 <= R; v += 2) ScoreKeys<V, C, ROWS, NK, 2>(qt, keys + k, v, out);
    if constexpr (R % 2) ScoreKeys<V, C, ROWS, NK, 1>(qt, keys + k, R - 1, out);
    out += NK * ROWS;
  }
  for (; k < n; ++k) {
    for (int v = 0; v + 2 <= R; v += 2) ScoreKeys<V, C, ROWS, 1, 2>(qt, keys + k, v, out);
    if constexpr (R % 2) ScoreKeys<V, C, ROWS, 1, 1>(qt, keys + k, R - 1, out);
    out += ROWS;
  }
}

// Query rows whose values AccumulateValuesRows sums together: 4 where V has 32 registers (16
// accumulators of 64 columns), else 1 (one row's 64 columns fill AVX2's or SSE's 16).
template <typename V>
constexpr int kValueRows = sizeof(V) == 64 ? 4 : 1;

// The values of m (1 to kValueRows<V>) adjacent rows of a block.
template <typename V>
ORT_LORA_INLINE void RowValues(int m, float* const* acc, const float* v, const float* p, int64_t n,
                               int64_t stride, int64_t d, const float* alpha, int64_t p_stride) {
  using attention_math::AccumulateValuesRows;
  switch (m) {
    case 1:
      return AccumulateValues<V, true>(acc[0], v, p, n, stride, d, alpha[0], p_stride);
    case 2:
      if constexpr (kValueRows<V> >= 2)
        return AccumulateValuesRows<V, 2>(acc, v, p, n, stride, d, alpha, p_stride);
      break;
    case 3:
      if constexpr (kValueRows<V> >= 3)
        return AccumulateValuesRows<V, 3>(acc, v, p, n, stride, d, alpha, p_stride);
      break;
    case 4:
      if constexpr (kValueRows<V> >= 4)
        return AccumulateValuesRows<V, 4>(acc, v, p, n, stride, d, alpha, p_stride);
      break;
  }
}

// SoftmaxTile for the rows of one register at once: s[k * rows] the scores of key j + k for
// its W rows, n_row[lane] each row's keys in the tile (0: none, its state untouched), n the
// most; writes the rows' probabilities in place of their scores and updates their states.
template <typename V>
ORT_LORA_INLINE void SoftmaxBlock(float* s, int64_t rows, int64_t n,
                                  const typename attention_math::Ints<V>::type& n_row,
                                  SoftmaxState* const* st, float* alpha) {
  constexpr int W = sizeof(V) / sizeof(float);
  const V lowest = V{} + kNegInf;
  float m[W];
  for (int i = 0; i < W; ++i) m[i] = st[i] ? st[i]->m : kNegInf;
  V top = Load<V>(m);
  for (int64_t k = 0; k < n; ++k) {
    const V x = Load<V>(s + k * rows);
    top = attention_math::Max(top, static_cast<int32_t>(k) < n_row ? x : lowest);
  }
  V cls[W];  // exps summed by key position modulo W, as SoftmaxTile's lanes
  for (int l = 0; l < W; ++l) cls[l] = V{};
  for (int64_t k = 0; k < n; ++k) {
    V e = attention_math::Exp(Load<V>(s + k * rows) - top);
    e = static_cast<int32_t>(k) < n_row ? e : V{};
    std::memcpy(s + k * rows, &e, sizeof(V));
    cls[k % W] += e;
  }
  for (int width = W / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) cls[l] = cls[l] + cls[l + width];
  float m_new[W], sum[W];
  std::memcpy(m_new, &top, sizeof(m_new));
  std::memcpy(sum, &cls[0], sizeof(sum));
  for (int i = 0; i < W; ++i) {
    if (n_row[i] <= 0) continue;
    float& mi = st[i]->m;
    alpha[i] = mi == kNegInf ? 0.0f : std::exp(mi - m_new[i]);
    st[i]->l = st[i]->l * alpha[i] + sum[i];
    mi = m_new[i];
  }
}

// One kv head's part of a tile in the block form.
struct BlockTile {
  const Problem& p;
  const WorkItem& w;
  int64_t kv;          // the kv head
  const float* qt;     // its query rows' q, transposed: [d][rows]
  int64_t rows;        // its query rows, token by token, padded to whole registers
  const KeyRun* runs;  // the tile's keys [j, j1)
  int64_t num_runs, j, j1;
  std::vector<SoftmaxState>& st;  // the item's rows' states
  float* buf;                     // kTileKeys x rows floats
};

// Tile t for ROWS rows (t.rows) whose head size is C registers.
template <typename V, int C, int ROWS>
ORT_LORA_INLINE void AttendBlock(const BlockTile& t) {
  const Problem& p = t.p;
  const WorkItem& w = t.w;
  const KeyRun* runs = t.runs;
  const int64_t kv = t.kv, num_runs = t.num_runs, j = t.j, j1 = t.j1;
  float* buf = t.buf;
  std::vector<SoftmaxState>& st = t.st;
  constexpr int64_t rows = ROWS;
  constexpr int W = sizeof(V) / sizeof(float);
  const auto& a = p.a;
  const int64_t d = a.head_size, n = j1 - j, group = p.group;
  const int64_t past = a.past_seqlens[w.seq], used = (w.q_end - w.q_begin) * group;
  ScoreBlock<V, C, ROWS>(t.qt, runs, num_runs, j, j1, kv * d, p.row_stride, buf);
  if (a.softcap > 0)
    for (int64_t i = 0; i < n * rows; ++i) buf[i] = a.softcap * std::tanh(buf[i] / a.softcap);
  for (int64_t v = 0; v < rows; v += W) {
    typename attention_math::Ints<V>::type n_row;
    SoftmaxState* row_st[W];
    float alpha[W];
    for (int i = 0; i < W; ++i) {
      const int64_t r = v + i, token = r / group;  // counted from the item's first
      const int64_t keys = r < used ? std::min(j1, past + w.q_begin + token + 1) - j : 0;
      n_row[i] = static_cast<int32_t>(std::max<int64_t>(keys, 0));
      row_st[i] = r < used ? &st[token * a.num_heads + kv * group + r % group] : nullptr;
    }
    SoftmaxBlock<V>(buf + v, rows, n, n_row, row_st, alpha);
    for (int i = 0; i < W;) {
      if (n_row[i] <= 0) {
        ++i;
        continue;
      }
      // Rows i .. i + m - 1 read the same keys: their values together, kValueRows at most.
      int m = 1;
      while (d % 64 == 0 && m < kValueRows<V> && i + m < W && n_row[i + m] == n_row[i]) ++m;
      const int64_t k1 = j + n_row[i];
      float* acc[kValueRows<V>];
      for (int r = 0; r < m; ++r) acc[r] = row_st[i + r]->acc;
      for (int64_t r = 0; r < num_runs; ++r) {  // acc * alpha once, then each run's values
        const int64_t lo = std::max(j, runs[r].j), hi = std::min(k1, runs[r].j + runs[r].count);
        if (lo >= hi) continue;
        const float* vals = runs[r].v + (lo - runs[r].j) * p.row_stride + kv * d;
        const float* probs = buf + (lo - j) * rows + v + i;
        RowValues<V>(m, acc, vals, probs, hi - lo, p.row_stride, d, alpha + i, rows);
        std::fill(alpha + i, alpha + i + m, 1.0f);
      }
      i += m;
    }
  }
}

// AttendBlock for t's rows (1 to 4 registers, at most kMaxBlockRows) and head size.
template <typename V, int C>
ORT_LORA_INLINE void AttendBlockRows(const BlockTile& t) {
  constexpr int W = sizeof(V) / sizeof(float);
  switch (t.rows / W) {
    case 1:
      return AttendBlock<V, C, W>(t);
    case 2:
      if constexpr (2 * W <= kMaxBlockRows) return AttendBlock<V, C, 2 * W>(t);
      break;
    case 3:
      if constexpr (3 * W <= kMaxBlockRows) return AttendBlock<V, C, 3 * W>(t);
      break;
    case 4:
      if constexpr (4 * W <= kMaxBlockRows) return AttendBlock<V, C, 4 * W>(t);
      break;
  }
}

template <typename V>
ORT_LORA_INLINE void AttendBlockBody(const BlockTile& t) {
  if (t.p.a.head_size == 4 * static_cast<int64_t>(sizeof(V) / sizeof(float)))
    AttendBlockRows<V, 4>(t);
  else
    AttendBlockRows<V, 8>(t);
}

#pragma GCC diagnostic pop

}  // namespace ort_lora::paged_attention
