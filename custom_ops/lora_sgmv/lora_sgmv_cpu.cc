// LoraSGMV CPU kernel (float32, adapter rows float32, bfloat16, float16 or int8): balanced work
// items, register-blocked micro-kernels written with GCC vector extensions, compiled three times
// (AVX-512, AVX2+FMA, baseline x86-64) for each row type and selected at run time, so the
// library runs on any x86-64 without -march=native.
#include "lora_sgmv/lora_sgmv_cpu.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "common/float16.h"
#include "lora_sgmv/lora_sgmv_plan.h"
#include "lora_sgmv/lora_sgmv_read_ahead.h"

// Every function that passes a vector by value is always inlined into an ISA-specific clone,
// so GCC's note that such calls would change the ABI across ISAs never applies.
#pragma GCC diagnostic ignored "-Wpsabi"
#define ORT_LORA_INLINE inline __attribute__((always_inline))

namespace ort_lora {
namespace {

// Unaligned float vectors: 16 lanes for AVX-512, 8 for AVX2, 4 for the baseline (SSE2).
typedef float V16 __attribute__((vector_size(64), aligned(4)));
typedef float V8 __attribute__((vector_size(32), aligned(4)));
typedef float V4 __attribute__((vector_size(16), aligned(4)));

template <typename V>
ORT_LORA_INLINE V Load(const float* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof(V));
  return v;
}

// Lanes of bfloat16 widened to float32 exactly: zero-extend, shift into the high half. GCC 12
// emits vpmovzxwd per 128 bits plus inserts for the vector conversion (intrinsics included), so
// the AVX2 / AVX-512 clones zero-extend with one vpmovzxwd from memory (as int8 rows below).
template <int kLanes>
struct Bf16Bits {  // by lane count: a vector type with attributes cannot be a template argument
  typedef uint16_t U16 __attribute__((vector_size(2 * kLanes), aligned(2)));
  typedef uint32_t U32 __attribute__((vector_size(4 * kLanes)));
};

template <typename V>
ORT_LORA_INLINE V Load(const uint16_t* p) {
  using Bits = Bf16Bits<sizeof(V) / sizeof(float)>;
  typename Bits::U32 w;
  if constexpr (sizeof(V) >= 32) {
    // Only the AVX2 / AVX-512 clones have vectors this wide, so this never runs without them.
    // The row is read through a register operand, not a declared memory one: rows are inputs
    // no kernel writes, and a memory operand makes GCC store every accumulator array to the
    // stack before each load (it could alias them).
    asm("vpmovzxwd (%1), %0" : "=v"(w) : "r"(p));
  } else {
    typename Bits::U16 h;
    __builtin_memcpy(&h, p, sizeof(h));
    w = __builtin_convertvector(h, typename Bits::U32);
  }
  w <<= 16;
  V v;
  __builtin_memcpy(&v, &w, sizeof(V));
  return v;
}

// An IEEE float16 row value: its bit pattern, a type of its own so that the kernels can tell
// float16 rows (Half) from bfloat16 rows (uint16_t).
struct Half {
  uint16_t bits;
};

// float16 -> float32 (common/float16.h): the scalar tails and the baseline clone. The AVX2 /
// AVX-512 clones convert lanes with vcvtph2ps (F16C: every CPU with AVX2 has it).
ORT_LORA_INLINE float ToFloat(Half h) { return HalfToFloat(h.bits); }

template <typename V>
ORT_LORA_INLINE V Load(const Half* p) {
  V v;
  if constexpr (sizeof(V) >= 32) {
    // As for bfloat16 rows: only in the AVX2 / AVX-512 clones, through a register operand.
    asm("vcvtph2ps (%1), %0" : "=v"(v) : "r"(p));
  } else {
    for (size_t i = 0; i < sizeof(V) / sizeof(float); ++i) v[i] = ToFloat(p[i]);
  }
  return v;
}

// Lanes of int8 widened to float32 exactly (sign-extend, convert); the row's scale is applied
// by the caller (folded into the shrink scale, lora_sgmv_plan.cc). GCC 12 turns a direct int8 ->
// int32 vector conversion into scalar byte extracts: the AVX2 / AVX-512 clones sign-extend with
// one vpmovsxbd from memory, the baseline goes through int16 (punpck / pcmpgt).
template <int kLanes>
struct Int8Bits {  // by lane count, as Bf16Bits
  typedef int8_t I8 __attribute__((vector_size(kLanes)));
  typedef int16_t I16 __attribute__((vector_size(2 * kLanes)));
  typedef int32_t I32 __attribute__((vector_size(4 * kLanes)));
};

template <typename V>
ORT_LORA_INLINE V Load(const int8_t* p) {
  using Bits = Int8Bits<sizeof(V) / sizeof(float)>;
  typename Bits::I32 wide;
  if constexpr (sizeof(V) >= 32) {
    // As for bfloat16 rows above: only in the AVX2 / AVX-512 clones, through a register operand.
    asm("vpmovsxbd (%1), %0" : "=v"(wide) : "r"(p));
  } else {
    typename Bits::I8 q;
    __builtin_memcpy(&q, p, sizeof(q));
    wide =
        __builtin_convertvector(__builtin_convertvector(q, typename Bits::I16), typename Bits::I32);
  }
  return __builtin_convertvector(wide, V);
}

ORT_LORA_INLINE float ToFloat(float f) { return f; }
ORT_LORA_INLINE float ToFloat(int8_t q) { return static_cast<float>(q); }
ORT_LORA_INLINE float ToFloat(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &w, sizeof(f));
  return f;
}

// A row pointer's values and scale by row type R: an int8 row is its float32 scale, then its
// values (value = scale * q); float32 and bfloat16 rows are their values (scale 1).
template <typename R>
ORT_LORA_INLINE const R* Values(const void* row) {
  if constexpr (sizeof(R) == 1) return static_cast<const R*>(row) + sizeof(float);
  return static_cast<const R*>(row);
}
template <typename R>
ORT_LORA_INLINE float Scale(const void* row) {
  if constexpr (sizeof(R) != 1) return 1.0f;
  float scale;
  __builtin_memcpy(&scale, row, sizeof(scale));
  return scale;
}

// Rows are read ahead of their use by this many bytes (software prefetch, a line of a row at a
// time): a decode segment's rows are short (int8: 576 to 1536 bytes) and start anywhere, so
// the hardware prefetchers follow them late, and the expand reads a segment's B^T rows, packed
// back to back in the adapter's pages, across (a column tile of every row), which they do not
// follow at all. Further ahead was slower (lines prefetched past a row's end are wasted).
constexpr int64_t kReadAhead = 256;

ORT_LORA_INLINE void ReadAhead(const void* p) {
  __builtin_prefetch(static_cast<const char*>(p) + kReadAhead, 0, 3);
}

// The first `bytes` of each of `count` rows (what ReadAhead does not cover: their starts),
// asked for one group of rows before their use, so that a group's first loads do not all miss.
ORT_LORA_INLINE void ReadRowStarts(const void* const* rows, int64_t count, int64_t bytes) {
  for (int64_t j = 0; j < count; ++j)
    for (int64_t off = 0; off < bytes; off += 64)
      __builtin_prefetch(static_cast<const char*>(rows[j]) + off, 0, 3);
}

template <typename V>
ORT_LORA_INLINE void Store(float* p, V v) {
  __builtin_memcpy(p, &v, sizeof(V));
}

ORT_LORA_INLINE float HSum(V4 a) { return (a[0] + a[2]) + (a[1] + a[3]); }
ORT_LORA_INLINE float HSum(V8 a) {
  return HSum(V4{a[0], a[1], a[2], a[3]} + V4{a[4], a[5], a[6], a[7]});
}
ORT_LORA_INLINE float HSum(V16 a) {
  return HSum(__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
              __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15));
}

// One step of a tile reads kBytes of adapter rows: asks `ahead` (a decode group's read-ahead,
// else null) for as many lines further on, a line every 64 / kBytes steps when a step reads
// less. Interleaved with the tile's loads: asked for a group's lines at a time before each
// group, the requests filled the load queue and held up the tile's own loads (a decode step's
// LoraSGMV calls with float32 rows 1.05-1.07x on a Zen 4 EPYC; float16 1.00-1.03x).
template <int64_t kBytes>
ORT_LORA_INLINE void IssueStep(RowReadAhead* ahead, int64_t step) {
  if (ahead == nullptr) return;
  if constexpr (kBytes >= 64) {
    ahead->Issue(kBytes / 64);
  } else if (step % (64 / kBytes) == 0) {
    ahead->Issue(1);
  }
}

// Shrink tile: v[i * ldv + j] += scale_j * (x_i[k0:k1] . A_j[k0:k1]) for MR rows of x and
// NR rows of A (elements of type R), scale_j = scales[j] (its adapter's scale * weight) times,
// for int8 rows, A_j's and B^T_j's row scales: applied here, on the small [n, r] result. Reading
// B^T_j's scale also starts the load of its first line ahead of the expand. `ahead`: IssueStep.
template <typename V, typename R, int MR, int NR>
ORT_LORA_INLINE void ShrinkTile(const float* x, int64_t ldx, const void* const* a_rows,
                                const void* const* bt_rows, int64_t k0, int64_t k1,
                                const float* scales, float* v, int64_t ldv,
                                RowReadAhead* ahead = nullptr) {
  constexpr int64_t kLanes = sizeof(V) / sizeof(float);
  constexpr int64_t kLineElems = 64 / sizeof(R);
  const R* a[NR];
  for (int j = 0; j < NR; ++j) a[j] = Values<R>(a_rows[j]);
  constexpr int64_t kStepBytes = NR * kLanes * static_cast<int64_t>(sizeof(R));
  V acc[MR][NR] = {};
  int64_t kk = k0;
  for (; kk + kLanes <= k1; kk += kLanes) {
    IssueStep<kStepBytes>(ahead, (kk - k0) / kLanes);
    V xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = Load<V>(x + i * ldx + kk);
    for (int j = 0; j < NR; ++j) {
      if (kLanes >= kLineElems || kk % kLineElems == 0) ReadAhead(a[j] + kk);
      const V av = Load<V>(a[j] + kk);
      for (int i = 0; i < MR; ++i) acc[i][j] += xv[i] * av;
    }
  }
  for (int j = 0; j < NR; ++j) {
    const float scale = scales[j] * Scale<R>(a_rows[j]) * Scale<R>(bt_rows[j]);
    for (int i = 0; i < MR; ++i) {
      float s = HSum(acc[i][j]);
      for (int64_t q = kk; q < k1; ++q) s += x[i * ldx + q] * ToFloat(a[j][q]);
      v[i * ldv + j] += scale * s;
    }
  }
}

// Expand tile: y_out_i[c:c+NQ*lanes] = y_i[...] + sum_j v[i * ldv + j] * Bt_j[...], then
// times 1 + dora_scale * D[...] with a DoRA row (dora: its values, or null; dora_scale: an int8
// row's scale, else 1). The accumulators start from y, so its loads overlap the multiply-adds.
template <typename V, typename R, int MR, int NQ>
ORT_LORA_INLINE void ExpandTile(const float* v, int64_t ldv, const void* const* bt, int64_t r,
                                const R* dora, float dora_scale, int64_t c, const float* y,
                                float* y_out, int64_t ldy, RowReadAhead* ahead = nullptr) {
  constexpr int64_t kLanes = sizeof(V) / sizeof(float);
  constexpr int64_t kStepBytes = NQ * kLanes * static_cast<int64_t>(sizeof(R));
  V acc[MR][NQ];
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < NQ; ++q) acc[i][q] = Load<V>(y + i * ldy + c + q * kLanes);
  for (int64_t j = 0; j < r; ++j) {
    IssueStep<kStepBytes>(ahead, j);
    V b[NQ];
    const R* bt_j = Values<R>(bt[j]);
    for (int64_t off = 0; off < NQ * kLanes; off += 64 / sizeof(R)) ReadAhead(bt_j + c + off);
    for (int q = 0; q < NQ; ++q) b[q] = Load<V>(bt_j + c + q * kLanes);
    for (int i = 0; i < MR; ++i) {
      const float vij = v[i * ldv + j];
      for (int q = 0; q < NQ; ++q) acc[i][q] += vij * b[q];
    }
  }
  if (dora != nullptr) {
    for (int q = 0; q < NQ; ++q) {
      const V d = Load<V>(dora + c + q * kLanes) * dora_scale;
      for (int i = 0; i < MR; ++i) acc[i][q] += acc[i][q] * d;
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int q = 0; q < NQ; ++q) Store<V>(y_out + i * ldy + c + q * kLanes, acc[i][q]);
  }
}

// Columns [c, c_end) of one row, fewer than one vector: plain scalar code.
template <typename R>
ORT_LORA_INLINE void ExpandScalar(const float* v, const void* const* bt, int64_t r, const R* dora,
                                  float dora_scale, int64_t c, int64_t c_end, const float* y,
                                  float* y_out) {
  for (; c < c_end; ++c) {
    float s = y[c];
    for (int64_t j = 0; j < r; ++j) s += v[j] * ToFloat(Values<R>(bt[j])[c]);
    if (dora != nullptr) s += s * (dora_scale * ToFloat(dora[c]));
    y_out[c] = s;
  }
}

// Rows [0, n) x A rows [j0, j1) over columns [k0, k1): A rows outer, x rows inner, so a group
// of A rows stays in L1 while the x rows stream by.
template <typename V, typename R, int NR>
ORT_LORA_INLINE void ShrinkGroup(const float* x, int64_t n, int64_t ldx, const void* const* a,
                                 const void* const* bt, int64_t k0, int64_t k1, const float* scales,
                                 float* v, int64_t ldv, RowReadAhead* ahead = nullptr) {
  int64_t t = 0;
  if constexpr (NR <= 4)  // 4 x 8 accumulators would not fit in registers
    for (; t + 4 <= n; t += 4, ahead = nullptr)
      ShrinkTile<V, R, 4, NR>(x + t * ldx, ldx, a, bt, k0, k1, scales, v + t * ldv, ldv, ahead);
  for (; t + 2 <= n; t += 2, ahead = nullptr)  // 2 rows share each load (and widening) of A
    ShrinkTile<V, R, 2, NR>(x + t * ldx, ldx, a, bt, k0, k1, scales, v + t * ldv, ldv, ahead);
  if (t < n)
    ShrinkTile<V, R, 1, NR>(x + t * ldx, ldx, a, bt, k0, k1, scales, v + t * ldv, ldv, ahead);
}

// Columns of x and A per pass: a 4-row group of A and a 4-row tile of x then fit in L1.
constexpr int64_t kShrinkKBlock = 1024;

// dst[0:len] = the row src (bfloat16 or float16 bits, or an int8 row's scale and values)
// widened to float32.
template <typename V, typename R>
ORT_LORA_INLINE void WidenRow(const R* src, int64_t len, float* dst) {
  constexpr int64_t kLanes = sizeof(V) / sizeof(float);
  int64_t c = 0;
  for (; c + kLanes <= len; c += kLanes) Store<V>(dst + c, Load<V>(src + c));
  for (; c < len; ++c) dst[c] = ToFloat(src[c]);
}
template <typename V>
ORT_LORA_INLINE void WidenRow(const int8_t* src, int64_t len, float* dst) {
  constexpr int64_t kLanes = sizeof(V) / sizeof(float);
  float scale;
  __builtin_memcpy(&scale, src, sizeof(scale));
  const int8_t* q = src + sizeof(float);
  const V sv = V{} + scale;
  int64_t c = 0;
  for (; c + kLanes <= len; c += kLanes) Store<V>(dst + c, sv * Load<V>(q + c));
  for (; c < len; ++c) dst[c] = scale * ToFloat(q[c]);
}

// Widens every row of one segment (rows of type R) into its place in wide_values (where
// plan.segs' rows of the segment point).
template <typename V, typename R>
ORT_LORA_INLINE void WidenItemBody(SgmvCpuPlan& plan, size_t index) {
  const int64_t seg = plan.widen[index];
  const SgmvProblem& p = *plan.p;
  const SgmvSegment& from = p.segments[seg];
  const SgmvSegment& to = plan.segs[seg];
  auto src = [](const void* r) { return static_cast<const R*>(r); };
  auto dst = [](const void* r) { return static_cast<float*>(const_cast<void*>(r)); };
  for (int64_t j = 0; j < from.rank; ++j)
    WidenRow<V>(src(from.a_rows[j]), p.in_features, dst(to.a_rows[j]));
  for (int m = 0; m < p.num_outputs; ++m) {
    const int64_t out = p.outputs[m].features;
    for (int64_t j = from.first[m]; j < from.first[m + 1]; ++j)
      WidenRow<V>(src(from.bt_rows[j]), out, dst(to.bt_rows[j]));
    if (from.dora[m] != nullptr) WidenRow<V>(src(from.dora[m]), out, dst(to.dora[m]));
  }
}

// A rows [j, hi) of a segment in groups of NR over columns [k0, k1); returns the first row
// left (fewer than NR). While a group of A rows is read: the next group's starts, and the starts
// of this group's B^T rows (the expand's, next). Measured on int8 decode rows: 1.2x. In a
// decode group, `ahead` (else null) asks for as many lines further on as the group reads, step
// by step in its first tile (IssueStep).
template <typename V, typename R, int NR>
ORT_LORA_INLINE int64_t ShrinkGroups(const SgmvSegment& s, const float* x, int64_t n, int64_t k,
                                     int64_t k0, int64_t k1, int64_t j, int64_t hi, float* v,
                                     int64_t r, RowReadAhead* ahead) {
  for (; j < hi; j += NR) {
    ReadRowStarts(s.a_rows + j + NR, std::min<int64_t>(NR, hi - j - NR), 2 * kReadAhead);
    ReadRowStarts(s.bt_rows + j, std::min<int64_t>(NR, hi - j), kReadAhead);
    if (j + NR > hi) break;
    ShrinkGroup<V, R, NR>(x, n, k, s.a_rows + j, s.bt_rows + j, k0, k1, s.scales + j, v + j, r,
                          ahead);
  }
  return j;
}

template <typename V, typename R>
ORT_LORA_INLINE void ShrinkItemBody(SgmvCpuPlan& plan, size_t index, RowReadAhead* ahead) {
  const SgmvCpuItem& it = plan.shrink[index];
  const SgmvProblem& p = *plan.p;
  const SgmvSegment& s = plan.segs[it.seg];
  const int64_t k = p.in_features, r = s.rank;
  float* v = plan.v.data() + plan.v_base[it.seg] + (it.row0 - s.row_begin) * r;
  const float* x = p.x + it.row0 * k;
  const int64_t n = it.row1 - it.row0;
  for (int64_t t = 0; t < n; ++t) std::fill(v + t * r + it.lo, v + t * r + it.hi, 0.0f);
  for (int64_t k0 = 0; k0 < k; k0 += kShrinkKBlock) {
    const int64_t k1 = std::min(k, k0 + kShrinkKBlock);
    int64_t j = it.lo;
    // A decode segment's one or two rows of x with 8 rows of A at a time where 32 vector
    // registers hold their 16 accumulators: twice the rows of A in flight (a decode step's
    // LoraSGMV calls 1.04-1.07x on a Zen 4 EPYC with float32, float16 and bfloat16 rows;
    // int8 rows 0.98-0.99x, so they keep groups of 4).
    if constexpr (sizeof(V) == 64 && !std::is_same_v<R, int8_t>) {
      if (n <= 2) j = ShrinkGroups<V, R, 8>(s, x, n, k, k0, k1, it.lo, it.hi, v, r, ahead);
    }
    j = ShrinkGroups<V, R, 4>(s, x, n, k, k0, k1, j, it.hi, v, r, ahead);
    for (; j < it.hi; ++j)
      ShrinkGroup<V, R, 1>(x, n, k, s.a_rows + j, s.bt_rows + j, k0, k1, s.scales + j, v + j, r);
  }
}

// One module's part of a segment's expand: v's columns [j0, j0 + r) of rows [row, ...) (row
// stride ldv = the segment's R), its r B^T rows, and its DoRA row's values and scale.
struct ExpandRowsOf {
  const float* v;
  int64_t ldv;
  const void* const* bt;
  int64_t r;
  const void* dora;
  float dora_scale;
  RowReadAhead* ahead;  // in a decode group (else null): lines asked for as the tiles read
};

// Columns [c0, c1) of MR rows: 4-vector strips, then 1-vector strips, then a scalar tail.
template <typename V, typename R, int MR>
ORT_LORA_INLINE void ExpandRows(const ExpandRowsOf& e, const float* v, int64_t c0, int64_t c1,
                                const float* y, float* y_out, int64_t ldy) {
  constexpr int64_t kLanes = sizeof(V) / sizeof(float);
  const R* dora = static_cast<const R*>(e.dora);
  int64_t c = c0;
  for (; c + 4 * kLanes <= c1; c += 4 * kLanes) {
    ExpandTile<V, R, MR, 4>(v, e.ldv, e.bt, e.r, dora, e.dora_scale, c, y, y_out, ldy, e.ahead);
  }
  for (; c + kLanes <= c1; c += kLanes)
    ExpandTile<V, R, MR, 1>(v, e.ldv, e.bt, e.r, dora, e.dora_scale, c, y, y_out, ldy);
  for (int i = 0; i < MR && c < c1; ++i)
    ExpandScalar<R>(v + i * e.ldv, e.bt, e.r, dora, e.dora_scale, c, c1, y + i * ldy,
                    y_out + i * ldy);
}

// Bytes of B^T rows kept hot while the rows of y stream by (most of a 48 KiB L1).
constexpr int64_t kExpandPanelBytes = 32 << 10;

// Columns [c0, c1) of the item's n rows (e.v, y and y_out at the item's first row).
template <typename V, typename R>
ORT_LORA_INLINE void ExpandPanel(const ExpandRowsOf& e, int64_t n, int64_t c0, int64_t c1,
                                 const float* y, float* y_out, int64_t ldy) {
  const int64_t ldv = e.ldv;
  int64_t t = 0;
  for (; t + 4 <= n; t += 4)
    ExpandRows<V, R, 4>(e, e.v + t * ldv, c0, c1, y + t * ldy, y_out + t * ldy, ldy);
  if (t + 2 <= n) {  // 2 rows share each load (and widening) of B^T
    ExpandRows<V, R, 2>(e, e.v + t * ldv, c0, c1, y + t * ldy, y_out + t * ldy, ldy);
    t += 2;
  }
  if (t < n) ExpandRows<V, R, 1>(e, e.v + t * ldv, c0, c1, y + t * ldy, y_out + t * ldy, ldy);
}

template <typename V, typename R>
ORT_LORA_INLINE void ExpandItemBody(SgmvCpuPlan& plan, size_t index, RowReadAhead* ahead) {
  constexpr int64_t kLanes = sizeof(V) / sizeof(float);
  const SgmvCpuItem& it = plan.expand[index];
  const SgmvOutput& o = plan.p->outputs[it.module];
  const int64_t ldy = o.features;
  const float* y = o.y + it.row0 * ldy;
  float* y_out = o.y_out + it.row0 * ldy;
  const int64_t n = it.row1 - it.row0;
  if (it.seg < 0) {
    if (y != y_out) std::copy(y, y + n * ldy, y_out);  // a caller may update y in place
    return;
  }
  const SgmvSegment& s = plan.segs[it.seg];
  const int64_t j0 = s.first[it.module];
  const void* dora = s.dora[it.module];
  const ExpandRowsOf e{plan.v.data() + plan.v_base[it.seg] + (it.row0 - s.row_begin) * s.rank + j0,
                       s.rank,
                       s.bt_rows + j0,
                       s.first[it.module + 1] - j0,
                       dora == nullptr ? nullptr : Values<R>(dora),
                       dora == nullptr ? 1.0f : Scale<R>(dora),
                       ahead};
  // Rows stream through y / y_out in order (prefetch-friendly) while a panel of B^T columns,
  // sized to stay in L1, is reused by every row of the item.
  const int64_t panel_cols = kExpandPanelBytes / (sizeof(R) * e.r);
  const int64_t panel = std::max<int64_t>(4 * kLanes, panel_cols / (4 * kLanes) * 4 * kLanes);
  for (int64_t c0 = it.lo; c0 < it.hi; c0 += panel) {
    const int64_t c1 = std::min(c0 + panel, it.hi);
    ExpandPanel<V, R>(e, n, c0, c1, y, y_out, ldy);
  }
}

// Items of widened segments read float32 rows whatever the call's row type.
template <typename V, typename R>
ORT_LORA_INLINE void ShrinkItem(SgmvCpuPlan& plan, size_t index, RowReadAhead* ahead) {
  if (sizeof(R) != sizeof(float) && plan.wide_base[plan.shrink[index].seg] >= 0) {
    ShrinkItemBody<V, float>(plan, index, ahead);
  } else {
    ShrinkItemBody<V, R>(plan, index, ahead);
  }
}

template <typename V, typename R>
ORT_LORA_INLINE void ExpandItem(SgmvCpuPlan& plan, size_t index, RowReadAhead* ahead) {
  const int64_t seg = plan.expand[index].seg;
  if (sizeof(R) != sizeof(float) && seg >= 0 && plan.wide_base[seg] >= 0) {
    ExpandItemBody<V, float>(plan, index, ahead);
  } else {
    ExpandItemBody<V, R>(plan, index, ahead);
  }
}

// One clone per instruction set and row type; the vector width follows the widest registers
// available. R = float (float32 rows), uint16_t (bfloat16 rows), Half (float16 rows) or int8_t
// (int8 rows).
template <typename R>
__attribute__((target("avx512f,avx512vl,avx2,fma"))) void ShrinkAvx512(SgmvCpuPlan& p, size_t i,
                                                                       RowReadAhead* ahead) {
  ShrinkItem<V16, R>(p, i, ahead);
}
template <typename R>
__attribute__((target("avx2,fma"))) void ShrinkAvx2(SgmvCpuPlan& p, size_t i, RowReadAhead* ahead) {
  ShrinkItem<V8, R>(p, i, ahead);
}
template <typename R>
void ShrinkBase(SgmvCpuPlan& p, size_t i, RowReadAhead* ahead) {
  ShrinkItem<V4, R>(p, i, ahead);
}
template <typename R>
__attribute__((target("avx512f,avx512vl,avx2,fma"))) void ExpandAvx512(SgmvCpuPlan& p, size_t i,
                                                                       RowReadAhead* ahead) {
  ExpandItem<V16, R>(p, i, ahead);
}
template <typename R>
__attribute__((target("avx2,fma"))) void ExpandAvx2(SgmvCpuPlan& p, size_t i, RowReadAhead* ahead) {
  ExpandItem<V8, R>(p, i, ahead);
}
template <typename R>
void ExpandBase(SgmvCpuPlan& p, size_t i, RowReadAhead* ahead) {
  ExpandItem<V4, R>(p, i, ahead);
}
template <typename R>
void WidenBase(SgmvCpuPlan& p, size_t i, RowReadAhead*) {
  WidenItemBody<V4, R>(p, i);
}

// An item of a pass; the read-ahead of its decode group, or null (widen: always null).
using ItemFn = void (*)(SgmvCpuPlan&, size_t, RowReadAhead*);
struct PassFns {
  ItemFn widen;  // baseline bfloat16, float16 and int8 rows only (lora_sgmv_plan.h)
  ItemFn shrink;
  ItemFn expand;
};
struct Kernels {
  PassFns f32;   // float32 rows
  PassFns bf16;  // bfloat16 rows
  PassFns f16;   // float16 rows
  PassFns i8;    // int8 rows
};

// The widest ISA the CPU has, capped by ORT_LORA_SGMV_ISA (avx512 | avx2 | baseline) so that
// tests can run the narrower clones on a machine that has AVX-512.
Kernels SelectKernels() {
  __builtin_cpu_init();
  const char* cap = std::getenv("ORT_LORA_SGMV_ISA");
  const bool allow512 = cap == nullptr || std::strcmp(cap, "avx512") == 0;
  const bool allow2 = allow512 || std::strcmp(cap, "avx2") == 0;
  if (allow512 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl"))
    return {{nullptr, ShrinkAvx512<float>, ExpandAvx512<float>},
            {nullptr, ShrinkAvx512<uint16_t>, ExpandAvx512<uint16_t>},
            {nullptr, ShrinkAvx512<Half>, ExpandAvx512<Half>},
            {nullptr, ShrinkAvx512<int8_t>, ExpandAvx512<int8_t>}};
  if (allow2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return {{nullptr, ShrinkAvx2<float>, ExpandAvx2<float>},
            {nullptr, ShrinkAvx2<uint16_t>, ExpandAvx2<uint16_t>},
            {nullptr, ShrinkAvx2<Half>, ExpandAvx2<Half>},
            {nullptr, ShrinkAvx2<int8_t>, ExpandAvx2<int8_t>}};
  return {{nullptr, ShrinkBase<float>, ExpandBase<float>},
          {WidenBase<uint16_t>, ShrinkBase<uint16_t>, ExpandBase<uint16_t>},
          {WidenBase<Half>, ShrinkBase<Half>, ExpandBase<Half>},
          {WidenBase<int8_t>, ShrinkBase<int8_t>, ExpandBase<int8_t>}};
}

constexpr int64_t kSerialCost = 1 << 18;  // a pass this small runs on the calling thread

// Runs item(i) for every item of a pass: inline when it is too small to be worth waking the
// thread pool (on a busy machine a woken thread can be descheduled mid-item and stall the call).
template <typename Item>
void RunPass(size_t items, int64_t cost, const ParallelFor& parallel_for, const Item& item) {
  if (items <= 1 || cost < kSerialCost) {
    for (size_t i = 0; i < items; ++i) item(i);
  } else {
    parallel_for(items, item);
  }
}

// The calling thread's plan, reused call after call: its vectors keep their capacity, so a
// decode step's calls allocate nothing. Pool threads run items of it (by reference) while the
// calling thread waits.
SgmvCpuPlan& CallerPlan() {
  thread_local SgmvCpuPlan plan;
  return plan;
}

}  // namespace

void LoraSgmvCpu(const SgmvProblem& problem, const ParallelFor& parallel_for) {
  static const Kernels kernels = SelectKernels();
  SgmvCpuPlan& plan = CallerPlan();
  const PassFns& fns = problem.row_type == SgmvRowLayout::kBFloat16Pairs  ? kernels.bf16
                       : problem.row_type == SgmvRowLayout::kFloat16Pairs ? kernels.f16
                       : problem.row_type == SgmvRowLayout::kInt8Scaled   ? kernels.i8
                                                                          : kernels.f32;
  PlanSgmvCpu(problem, plan, fns.widen != nullptr);
  auto pass = [&plan](ItemFn fn) { return [&plan, fn](size_t i) { fn(plan, i, nullptr); }; };
  RunPass(plan.widen.size(), plan.widen_cost, parallel_for, pass(fns.widen));
  if (plan.fused.empty()) {
    RunPass(plan.shrink.size(), plan.shrink_cost, parallel_for, pass(fns.shrink));
    RunPass(plan.expand.size(), plan.expand_cost, parallel_for, pass(fns.expand));
  } else {
    RunPass(plan.fused.size(), plan.shrink_cost + plan.expand_cost, parallel_for,
            [&plan, &fns](size_t i) {
              const SgmvCpuGroup& g = plan.fused[i];
              RowReadAhead ahead(plan, i);
              for (int64_t k = g.shrink_begin; k < g.shrink_end; ++k) fns.shrink(plan, k, &ahead);
              for (int64_t e = g.expand_begin; e < g.expand_end; ++e) fns.expand(plan, e, &ahead);
            });
  }
  plan.wide_storage.reset();  // prefill's scratch is not kept between calls
}

}  // namespace ort_lora
