// Vectorized micro-kernels of the PagedAttention CPU kernel: scores of a tile of keys, a tile's
// step of the online softmax, and the weighted sum of value rows. Plain C++ and GCC vector
// types, inlined into each ISA's copy of the kernel (paged_attention_cpu.cc: AVX-512, AVX2+FMA,
// baseline x86-64, chosen at run time), which passes the vector type V of its widest registers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

// Helpers must be always_inline: GCC does not inline a function of the default arch into a
// function with a target attribute otherwise; and a helper left out of line that only
// prefetches is found side-effect free and its calls deleted. ORT_LORA_NO_CLONES builds only
// the compiler's target ISA (to check one ISA's code: -march=x86-64-v3 -DORT_LORA_NO_CLONES).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(ORT_LORA_NO_CLONES)
#define ORT_LORA_ISA_COPIES 1
#endif
#if defined(__GNUC__)
#define ORT_LORA_INLINE inline __attribute__((always_inline))
#else
#define ORT_LORA_INLINE inline
#endif

namespace ort_lora {
namespace attention_math {

// GCC vector types: V16 one AVX-512 register, V8 one AVX2 register, V4 one SSE register
// (a wider type is split into narrower registers where the ISA lacks it). Used where plain
// loops vectorize badly (horizontal sums, register tiles).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"  // the vector helpers are always inlined: no ABI
typedef float V16 __attribute__((vector_size(64)));
typedef float V8 __attribute__((vector_size(32)));
typedef float V4 __attribute__((vector_size(16)));
typedef int32_t I16 __attribute__((vector_size(64)));
typedef int32_t I8 __attribute__((vector_size(32)));
typedef int32_t I4 __attribute__((vector_size(16)));

// The int32 vector of V's width (what comparing two V gives).
template <typename V>
struct Ints;
template <>
struct Ints<V16> {
  typedef I16 type;
};
template <>
struct Ints<V8> {
  typedef I8 type;
};
template <>
struct Ints<V4> {
  typedef I4 type;
};

template <typename V>
ORT_LORA_INLINE V Load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Sixteen row sums at once: out[j] is the sum of the lanes of r[j]. A transpose
// tree (15 adds for 16 rows) instead of a horizontal sum per row.
ORT_LORA_INLINE void TransposeSum(const V16* r, float* out) {
  V16 a[8], b[4], c[2];
  for (int t = 0; t < 8; ++t)
    a[t] = __builtin_shufflevector(r[2 * t], r[2 * t + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19,
                                   20, 21, 22, 23) +
           __builtin_shufflevector(r[2 * t], r[2 * t + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26,
                                   27, 28, 29, 30, 31);
  for (int t = 0; t < 4; ++t)
    b[t] = __builtin_shufflevector(a[2 * t], a[2 * t + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19,
                                   24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * t], a[2 * t + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22,
                                   23, 28, 29, 30, 31);
  for (int t = 0; t < 2; ++t)
    c[t] = __builtin_shufflevector(b[2 * t], b[2 * t + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21,
                                   24, 25, 28, 29) +
           __builtin_shufflevector(b[2 * t], b[2 * t + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22,
                                   23, 26, 27, 30, 31);
  const V16 sums = __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22,
                                           24, 26, 28, 30) +
                   __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23,
                                           25, 27, 29, 31);
  std::memcpy(out, &sums, sizeof(sums));
}

// Eight row sums at once (AVX2): out[j] is the sum of the lanes of r[j]; 7 adds for 8 rows.
ORT_LORA_INLINE void TransposeSum(const V8* r, float* out) {
  V8 a[4], b[2];
  for (int t = 0; t < 4; ++t)  // a[t] = 4 partial sums of r[2t], then 4 of r[2t + 1]
    a[t] = __builtin_shufflevector(r[2 * t], r[2 * t + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(r[2 * t], r[2 * t + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int t = 0; t < 2; ++t)  // b[t] = 2 partial sums of each of r[4t .. 4t + 3]
    b[t] = __builtin_shufflevector(a[2 * t], a[2 * t + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(a[2 * t], a[2 * t + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  const V8 sums = __builtin_shufflevector(b[0], b[1], 0, 2, 4, 6, 8, 10, 12, 14) +
                  __builtin_shufflevector(b[0], b[1], 1, 3, 5, 7, 9, 11, 13, 15);
  std::memcpy(out, &sums, sizeof(sums));
}

// Four row sums at once (baseline SSE).
ORT_LORA_INLINE void TransposeSum(const V4* r, float* out) {
  const V4 a0 = __builtin_shufflevector(r[0], r[1], 0, 1, 4, 5) +
                __builtin_shufflevector(r[0], r[1], 2, 3, 6, 7);
  const V4 a1 = __builtin_shufflevector(r[2], r[3], 0, 1, 4, 5) +
                __builtin_shufflevector(r[2], r[3], 2, 3, 6, 7);
  const V4 sums =
      __builtin_shufflevector(a0, a1, 0, 2, 4, 6) + __builtin_shufflevector(a0, a1, 1, 3, 5, 7);
  std::memcpy(out, &sums, sizeof(sums));
}

// s[j] = q . k[j * stride + :d] for j < n: W keys at a time, W = the lanes of V (one register
// per key: W independent FMA chains, then one transpose tree for their W sums). A key's score
// takes the same operations wherever it falls, through the one loop body below: the last keys
// go as a whole group too, the rows after them scored and dropped (`room` rows from k may be
// read; where fewer are left, the last keys are copied into `spare`: W rows of d finite
// floats), and the dimensions past a multiple of W as a zero-padded register. (Two inlined
// copies of the body, one for whole groups and one for the last, were compiled into different
// arithmetic.) s must have room for n rounded up to a multiple of W: the last group's dropped
// lanes are written too. C > 0: d is C registers, which hold q for the whole call, and each
// key's chunks go in turn through one row pointer (with d read in the loop, the compiler kept
// the W keys' row pointers in vector registers and moved one back for every load); C = 0: any
// d. Both sum a key's chunks in the same order, so the two give the same bits.
template <typename V, int C>
ORT_LORA_INLINE void ScoresOf(const float* __restrict q, const float* __restrict k, int64_t stride,
                              int64_t d, int64_t n, int64_t room, float* __restrict s,
                              float* spare) {
  constexpr int W = sizeof(V) / sizeof(float);
  V held[C > 0 ? C : 1];
  for (int i = 0; i < C; ++i) held[i] = Load<V>(q + i * W);
  for (int64_t j = 0; j < n; j += W) {
    const int64_t m = std::min<int64_t>(W, n - j);
    const float* key = k + j * stride;
    int64_t step = stride;
    if (j + W > room) {
      for (int64_t c = 0; c < m; ++c)
        std::copy(key + c * stride, key + c * stride + d, spare + c * d);
      key = spare, step = d;
    }
    V r[W];
    if constexpr (C > 0) {
      for (int c = 0; c < W; ++c) {
        const float* row = key + c * step;
        V acc = V{};
        for (int i = 0; i < C; ++i) acc += held[i] * Load<V>(row + i * W);
        r[c] = acc;
      }
    } else {
      for (int c = 0; c < W; ++c) r[c] = V{};
      int64_t i = 0;
      for (; i + W <= d; i += W) {
        const V qv = Load<V>(q + i);
        for (int c = 0; c < W; ++c) r[c] += qv * Load<V>(key + c * step + i);
      }
      if (i < d) {
        V qv = {};
        std::memcpy(&qv, q + i, (d - i) * sizeof(float));
        for (int c = 0; c < W; ++c) {
          V kv = {};
          std::memcpy(&kv, key + c * step + i, (d - i) * sizeof(float));
          r[c] += qv * kv;
        }
      }
    }
    TransposeSum(r, s + j);  // all W lanes: s has room for them
  }
}

// ScoresOf for this d: q held in registers where d is 4 or 8 of them.
template <typename V>
ORT_LORA_INLINE void Scores(const float* __restrict q, const float* __restrict k, int64_t stride,
                            int64_t d, int64_t n, int64_t room, float* __restrict s, float* spare) {
  constexpr int W = sizeof(V) / sizeof(float);
  if (d == 4 * W) return ScoresOf<V, 4>(q, k, stride, d, n, room, s, spare);
  if (W >= 8 && d == 8 * W) return ScoresOf<V, 8>(q, k, stride, d, n, room, s, spare);
  ScoresOf<V, 0>(q, k, stride, d, n, room, s, spare);
}

// The sum and the max of a register's lanes, halves folded onto each other (a fixed tree).
ORT_LORA_INLINE V4 Lo(V8 v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3); }
ORT_LORA_INLINE V4 Hi(V8 v) { return __builtin_shufflevector(v, v, 4, 5, 6, 7); }
ORT_LORA_INLINE V8 Lo(V16 v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7); }
ORT_LORA_INLINE V8 Hi(V16 v) { return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15); }
ORT_LORA_INLINE float LaneSum(V4 v) {
  const V4 a = v + __builtin_shufflevector(v, v, 2, 3, 0, 1);
  return a[0] + a[1];
}
ORT_LORA_INLINE float LaneSum(V8 v) { return LaneSum(Lo(v) + Hi(v)); }
ORT_LORA_INLINE float LaneSum(V16 v) { return LaneSum(Lo(v) + Hi(v)); }
template <typename V>
ORT_LORA_INLINE V Max(V a, V b) {
  return a < b ? b : a;  // std::max's, lane-wise
}
ORT_LORA_INLINE float LaneMax(V4 v) {
  const V4 a = Max(v, __builtin_shufflevector(v, v, 2, 3, 0, 1));
  return std::max(a[0], a[1]);
}
ORT_LORA_INLINE float LaneMax(V8 v) { return LaneMax(Max(Lo(v), Hi(v))); }
ORT_LORA_INLINE float LaneMax(V16 v) { return LaneMax(Max(Lo(v), Hi(v))); }

// exp(x) for x <= 0 in every lane (Cephes expf polynomial, ~1 ulp).
template <typename V>
ORT_LORA_INLINE V Exp(V x) {
  typedef typename Ints<V>::type I;
  const V v = x < -87.0f ? V{} - 87.0f : x;
  const V fn = (v * 1.44269504f + 12582912.0f) - 12582912.0f;  // round to nearest
  const V r = v - fn * 0.693359375f + fn * 2.12194440e-4f;
  V y = V{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const I bits = (__builtin_convertvector(fn, I) + 127) << 23;
  V two_n;
  std::memcpy(&two_n, &bits, sizeof(V));
  return y * two_n;
}

// One tile's step of a row's online softmax, in registers: with s[0, n) the tile's scores
// (n <= N; s has room for N rounded up to whole registers), m the row's running max and l its
// running sum, s[j] := exp(s[j] - m') for j < n where m' = max(m, s[0, n)), l := l * alpha +
// the sum of those, m := m'; returns alpha = exp(m - m') (0 before the row's first keys). The
// scores are read once into registers and their exps summed lane-wise, then by a fixed tree:
// no chain of n dependent adds, as in the scalar loops this replaced.
template <typename V, int N>
ORT_LORA_INLINE float SoftmaxTile(float* s, int64_t n, float& m, float& l) {
  typedef typename Ints<V>::type I;
  constexpr int W = sizeof(V) / sizeof(float), G = (N + W - 1) / W;
  const int64_t groups = (n + W - 1) / W;
  I index;
  for (int i = 0; i < W; ++i) index[i] = i;
  const V lowest = V{} - std::numeric_limits<float>::infinity();
  V x[G] = {}, top = lowest;
  for (int g = 0; g < G && g < groups; ++g) {
    x[g] = Load<V>(s + g * W);
    x[g] = index + g * W < static_cast<int32_t>(n) ? x[g] : lowest;
    top = Max(top, x[g]);
  }
  const float m_new = std::max(m, LaneMax(top));
  V sum = V{};
  for (int g = 0; g < G && g < groups; ++g) {
    V e = Exp(x[g] - m_new);
    e = index + g * W < static_cast<int32_t>(n) ? e : V{};
    std::memcpy(s + g * W, &e, sizeof(V));
    sum += e;
  }
  const float alpha = m == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(m - m_new);
  l = l * alpha + LaneSum(sum);
  m = m_new;
  return alpha;
}

// acc[D] = acc * alpha + sum_j p[j * P] * v[j * stride + :D], each column's sum in j order.
// The accumulators are registers of V (64 columns: four AVX-512, eight AVX2 FMA chains)
// whatever the code around, and the last columns past a multiple of the lanes fused
// explicitly. P: the distance between probabilities, p_stride where kStrided (a block's rows
// apart), else 1.
template <typename V, bool kStrided = false>
ORT_LORA_INLINE void AccumulateValues(float* __restrict acc, const float* __restrict v,
                                      const float* __restrict p, int64_t n, int64_t stride,
                                      int64_t d, float alpha, int64_t p_stride = 1) {
  constexpr int W = sizeof(V) / sizeof(float), R = 64 / W;
  const int64_t P = kStrided ? p_stride : 1;
  int64_t i = 0;
  for (; i + 64 <= d; i += 64) {
    V r[R];
    for (int k = 0; k < R; ++k) r[k] = Load<V>(acc + i + k * W) * alpha;
    for (int64_t j = 0; j < n; ++j) {
      const float* row = v + j * stride + i;
      for (int k = 0; k < R; ++k) r[k] += p[j * P] * Load<V>(row + k * W);
    }
    std::memcpy(acc + i, r, sizeof(r));
  }
  for (; i + W <= d; i += W) {
    V r = Load<V>(acc + i) * alpha;
    for (int64_t j = 0; j < n; ++j) r += p[j * P] * Load<V>(v + j * stride + i);
    std::memcpy(acc + i, &r, sizeof(r));
  }
  for (; i < d; ++i) {
    float r = acc[i] * alpha;
    for (int64_t j = 0; j < n; ++j) r = std::fma(p[j * P], v[j * stride + i], r);
    acc[i] = r;
  }
}

// AccumulateValues (kStrided, its first branch: d a multiple of 64) for M rows that read the
// same values and keys: row m's accumulators acc[m], its probabilities p + m (p_stride apart),
// its alpha[m]; each value register loaded once for the M rows (an empty asm keeps the
// compiler from folding the load into each row's multiply-add again). A row's arithmetic is
// AccumulateValues'.
template <typename V, int M>
ORT_LORA_INLINE void AccumulateValuesRows(float* const* acc, const float* __restrict v,
                                          const float* __restrict p, int64_t n, int64_t stride,
                                          int64_t d, const float* alpha, int64_t p_stride) {
  constexpr int W = sizeof(V) / sizeof(float), R = 64 / W;
  for (int64_t i = 0; i + 64 <= d; i += 64) {
    V r[M][R];
    for (int m = 0; m < M; ++m)
      for (int k = 0; k < R; ++k) r[m][k] = Load<V>(acc[m] + i + k * W) * alpha[m];
    for (int64_t j = 0; j < n; ++j) {
      const float* row = v + j * stride + i;
      for (int k = 0; k < R; ++k) {
        V x = Load<V>(row + k * W);
        asm("" : "+v"(x));
        for (int m = 0; m < M; ++m) r[m][k] += p[j * p_stride + m] * x;
      }
    }
    for (int m = 0; m < M; ++m)  // register by register: a copy of all of r[m] went by the stack
      for (int k = 0; k < R; ++k) std::memcpy(acc[m] + i + k * W, &r[m][k], sizeof(V));
  }
}

#pragma GCC diagnostic pop

}  // namespace attention_math
}  // namespace ort_lora
