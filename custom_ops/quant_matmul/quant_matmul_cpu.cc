#include "quant_matmul/quant_matmul_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "quant_matmul/quant_matmul_kernels.h"

namespace ort_lora {

namespace {

using namespace quant_matmul;  // NOLINT: this file's own internals

constexpr int64_t kChunkRows = 64;       // rows of x per work item (their int8 copy stays in L2)
constexpr int64_t kTargetItems = 16;     // work items a call aims for (2-16 threads)
constexpr int64_t kQuantizeSerial = 64;  // up to this many rows, x is quantized inline
constexpr int64_t kL2Codes = 1 << 20;    // bytes of codes a work item keeps in L2

// ---- quantizing x: per block, scale amax / 127, codes rint(x * (127 / amax)) ----

void QuantizeRowBase(const Problem& p, int64_t row) {
  const QuantMatMulArgs& a = *p.a;
  const float* x = a.x + row * a.k;
  int8_t* q = p.xq + row * a.k;
  for (int64_t b = 0; b < p.blocks; ++b) {
    const float* xb = x + b * a.block_size;
    float amax = 0.0f, fsum = 0.0f;
    for (int64_t i = 0; i < a.block_size; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float inv = amax == 0.0f ? 0.0f : 127.0f / amax;
    int32_t qsum = 0;
    for (int64_t i = 0; i < a.block_size; ++i) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(xb[i] * inv));
      q[b * a.block_size + i] = static_cast<int8_t>(v);
      qsum += v;
      fsum += xb[i];
    }
    const float scale = amax / 127.0f;
    p.xscale[row * p.blocks + b] = scale;
    p.xqsum[row * p.blocks + b] = scale * static_cast<float>(qsum);
    p.xisum[row * p.blocks + b] = qsum;
    p.xbias[row * p.blocks + b] = -8 * qsum;
    if (p.xsum) p.xsum[row * p.blocks + b] = fsum;
  }
}

#ifdef ORT_LORA_QUANT_X86
__attribute__((target("arch=x86-64-v4"))) void QuantizeRowAvx512(const Problem& p, int64_t row) {
  const QuantMatMulArgs& a = *p.a;
  const float* x = a.x + row * a.k;
  int8_t* q = p.xq + row * a.k;
  const int64_t bs = a.block_size;  // a multiple of 16
  for (int64_t b = 0; b < p.blocks; ++b) {
    const float* xb = x + b * bs;
    __m512 vmax = _mm512_setzero_ps(), vsum = _mm512_setzero_ps();
    for (int64_t i = 0; i < bs; i += 16) {
      const __m512 v = _mm512_loadu_ps(xb + i);
      vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
      vsum = _mm512_add_ps(vsum, v);
    }
    const float amax = _mm512_reduce_max_ps(vmax);
    const __m512 inv = _mm512_set1_ps(amax == 0.0f ? 0.0f : 127.0f / amax);
    __m512i isum = _mm512_setzero_si512();
    for (int64_t i = 0; i < bs; i += 16) {
      const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + i), inv));
      isum = _mm512_add_epi32(isum, v);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * bs + i), _mm512_cvtsepi32_epi8(v));
    }
    const float scale = amax / 127.0f;
    p.xscale[row * p.blocks + b] = scale;
    const int32_t qsum = _mm512_reduce_add_epi32(isum);
    p.xqsum[row * p.blocks + b] = scale * static_cast<float>(qsum);
    p.xisum[row * p.blocks + b] = qsum;
    p.xbias[row * p.blocks + b] = -8 * qsum;
    if (p.xsum) p.xsum[row * p.blocks + b] = _mm512_reduce_add_ps(vsum);
  }
}

__attribute__((target("arch=x86-64-v3"))) void QuantizeRowAvx2(const Problem& p, int64_t row) {
  const QuantMatMulArgs& a = *p.a;
  const float* x = a.x + row * a.k;
  int8_t* q = p.xq + row * a.k;
  const int64_t bs = a.block_size;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < p.blocks; ++b) {
    const float* xb = x + b * bs;
    __m256 vmax = _mm256_setzero_ps(), vsum = _mm256_setzero_ps();
    for (int64_t i = 0; i < bs; i += 8) {
      const __m256 v = _mm256_loadu_ps(xb + i);
      vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, v));
      vsum = _mm256_add_ps(vsum, v);
    }
    float lanes[8], sums[8];
    _mm256_storeu_ps(lanes, vmax);
    _mm256_storeu_ps(sums, vsum);
    const float amax = *std::max_element(lanes, lanes + 8);
    const __m256 inv = _mm256_set1_ps(amax == 0.0f ? 0.0f : 127.0f / amax);
    __m256i isum = _mm256_setzero_si256();
    for (int64_t i = 0; i < bs; i += 8) {
      const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i), inv));
      isum = _mm256_add_epi32(isum, v);
      const __m128i w16 =
          _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(q + b * bs + i), _mm_packs_epi16(w16, w16));
    }
    int32_t ints[8];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(ints), isum);
    int32_t qsum = 0;
    float fsum = 0.0f;
    for (int i = 0; i < 8; ++i) qsum += ints[i], fsum += sums[i];
    const float scale = amax / 127.0f;
    p.xscale[row * p.blocks + b] = scale;
    p.xqsum[row * p.blocks + b] = scale * static_cast<float>(qsum);
    p.xisum[row * p.blocks + b] = qsum;
    p.xbias[row * p.blocks + b] = -8 * qsum;
    if (p.xsum) p.xsum[row * p.blocks + b] = fsum;
  }
}
#endif

// ---- the products: one tile of 16 columns x up to MR rows over all of K ----

// The 4 int8 values of x that meet chunk j's low nibbles, and the 4 that meet its high ones,
// each as one int32 to broadcast. always_inline: GCC inlines nothing of the default arch into
// the kernels' target functions otherwise.
inline __attribute__((always_inline)) std::pair<int32_t, int32_t> XQuads(const int8_t* xb,
                                                                         int64_t j) {
  int32_t low, high;
  std::memcpy(&low, xb + 8 * j, 4);
  std::memcpy(&high, xb + 8 * j + 4, 4);
  return {low, high};
}

TileArgs Strip(const Problem& p, int64_t row, int64_t strip) {
  const QuantMatMulArgs& a = *p.a;
  const int64_t tile = strip / kStrips;
  int64_t column = strip * kLanes, o = 0;
  for (; o + 1 < a.outputs && column >= a.columns[o]; ++o) column -= a.columns[o];
  const int64_t at = tile * p.blocks * kQuantTile + strip % kStrips * kLanes;
  return {a.codes + (tile * p.blocks * p.chunks) * kChunkBytes + strip % kStrips * 64,
          a.scales ? a.scales + at : nullptr,
          a.zeros ? a.zeros + at : nullptr,
          a.offsets ? a.offsets + at : nullptr,
          a.half_scales ? a.half_scales + at : nullptr,
          a.minimums ? a.minimums + at : nullptr,
          row,
          a.columns[o] - column,
          a.y[o] + row * a.columns[o] + column,
          a.columns[o],
          nullptr};
}

template <int MR>
void TileBase(const Problem& p, const TileArgs& t) {
  const QuantMatMulArgs& a = *p.a;
  const int64_t bs = a.block_size;
  for (int r = 0; r < MR; ++r) {
    const int64_t row = t.row + r;
    for (int64_t c = 0; c < std::min(kLanes, t.columns); ++c) {
      float acc = 0.0f;
      for (int64_t b = 0; b < p.blocks; ++b) {
        const uint8_t* w = t.codes + b * bs / 8 * kChunkBytes + 4 * c;
        const int8_t* xb = p.xq + row * a.k + b * bs;
        const int64_t xt = row * p.blocks + b;
        int32_t dot = t.zeros ? 0 : p.xbias[xt];  // the zero point 8 in integers
        for (int64_t j = 0; j < bs / 8; ++j)
          for (int i = 0; i < 4; ++i) {
            const uint8_t byte = w[j * kChunkBytes + i];
            dot += xb[8 * j + i] * (byte & 0x0F) + xb[8 * j + 4 + i] * (byte >> 4);
          }
        const int64_t at = b * kQuantTile + c;
        const float s = ScaleAt(t, at);
        acc += static_cast<float>(dot) * (s * p.xscale[xt]);
        if (t.zeros) acc += -(s * static_cast<float>(t.zeros[at])) * p.xqsum[xt];
        if (HasOffsets(t)) acc += OffsetAt(t, at, s) * p.xsum[xt];
      }
      t.y[r * t.ldy + c] = acc;
    }
  }
}

// Float x (float_x): each block of the strip's weights dequantized, then float dot products.
void StripFloatX(const Problem& p, const TileArgs& t, int64_t rows) {
  const QuantMatMulArgs& a = *p.a;
  const int64_t bs = a.block_size, columns = std::min(kLanes, t.columns);
  std::vector<float> w(bs);
  for (int64_t r = 0; r < rows; ++r) std::fill(t.y + r * t.ldy, t.y + r * t.ldy + columns, 0.0f);
  for (int64_t b = 0; b < p.blocks; ++b)
    for (int64_t c = 0; c < columns; ++c) {
      const int64_t at = b * kQuantTile + c;
      const float s = ScaleAt(t, at), zero = t.zeros ? float(t.zeros[at]) : 8.0f;
      const float off = OffsetAt(t, at, s);
      for (int64_t j = 0; j < bs / 8; ++j)
        for (int i = 0; i < 4; ++i) {
          const uint8_t byte = t.codes[b * bs / 8 * kChunkBytes + j * kChunkBytes + 4 * c + i];
          w[8 * j + i] = (float(byte & 0x0F) - zero) * s + off;
          w[8 * j + 4 + i] = (float(byte >> 4) - zero) * s + off;
        }
      for (int64_t r = 0; r < rows; ++r) {
        const float* x = a.x + (t.row + r) * a.k + b * bs;
        float acc = 0.0f;
        for (int64_t i = 0; i < bs; ++i) acc += x[i] * w[i];
        t.y[r * t.ldy + c] += acc;
      }
    }
}

#ifdef ORT_LORA_QUANT_X86
// -scale * zero point of the 16 columns at `at` (t has zero points): what a block's xqsum (x's
// scale times the sum of its codes) is multiplied by. Without zero points (8) the kernels start
// a block's int32 dot products from -8 * sum(x codes) instead (xbias): exact, and no float work.
__attribute__((target("arch=x86-64-v4"), always_inline)) inline __m512 ZeroTermAvx512(
    const TileArgs& t, int64_t at, __m512 s) {
  const __m512 zero = _mm512_cvtepi32_ps(
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t.zeros + at))));
  return _mm512_mul_ps(s, _mm512_sub_ps(_mm512_setzero_ps(), zero));
}

// MR rows x NT adjacent strips: MR * NT independent chains of dot products (one row alone
// would wait on each dpbusd's latency). A chunk's codes are split into nibbles once for all
// MR rows, and each row's x broadcast once for all NT strips (in registers: vpdpbusd reads
// neither well from memory). Past the 32 zmm registers (3 rows x 4 strips, 7-8 rows x 2),
// GCC spills some float sums, which a block touches once. With t.next, the same strips of the
// next tile are fetched into L2 as these are read. kHalf: t's float16 scales and minimums.
// kZeros: t has zero points (ZeroTermAvx512); without them the dot products start from xbias.
template <int MR, int NT, bool kHalf, bool kZeros>
__attribute__((target("arch=x86-64-v4,avx512vnni"), always_inline)) inline void TileAvx512Of(
    const Problem& p, const TileArgs& t) {
  const QuantMatMulArgs& a = *p.a;
  const int64_t chunks = a.block_size / 8, k = a.k, blocks = p.blocks;
  const int8_t* xq = p.xq + t.row * k;
  const float* xscale = p.xscale + t.row * blocks;
  const float* xqsum = p.xqsum + t.row * blocks;
  const int32_t* xbias = p.xbias + t.row * blocks;
  const float* xsum = HasOffsets(t) ? p.xsum + t.row * blocks : nullptr;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const uint8_t* w = t.codes;
  __m512 acc[MR][NT];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NT; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dot[MR][NT];
    for (int r = 0; r < MR; ++r) {
      const __m512i start =
          kZeros ? _mm512_setzero_si512() : _mm512_set1_epi32(xbias[r * blocks + b]);
      for (int c = 0; c < NT; ++c) dot[r][c] = start;
    }
    const int8_t* xb = xq + b * a.block_size;
    for (int64_t j = 0; j < chunks; ++j, w += kChunkBytes) {
      if (t.next)
        for (int c = 0; c < NT; ++c)
          _mm_prefetch(reinterpret_cast<const char*>(t.next + (w - t.codes) + c * 64), _MM_HINT_T1);
      __m512i lo[NT], hi[NT];
#pragma GCC unroll 4
      for (int c = 0; c < NT; ++c) {
        const __m512i packed = _mm512_loadu_si512(w + c * 64);
        lo[c] = _mm512_and_si512(packed, nibble);
        hi[c] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
      }
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const auto [q0, q1] = XQuads(xb + r * k, j);
        const __m512i x0 = _mm512_set1_epi32(q0), x1 = _mm512_set1_epi32(q1);
#pragma GCC unroll 4
        for (int c = 0; c < NT; ++c) {
          dot[r][c] = Dpbusd(dot[r][c], lo[c], x0);
          dot[r][c] = Dpbusd(dot[r][c], hi[c], x1);
        }
      }
    }
    // acc += dot * (scale * xscale) - scale * zero * xqsum (+ offset * xsum)
    __m512 s[NT], wz[NT], off[NT];
#pragma GCC unroll 4
    for (int c = 0; c < NT; ++c) {
      const int64_t at = b * kQuantTile + c * kLanes;
      s[c] = ScalesAvx512<kHalf>(t, at);
      if (kZeros) wz[c] = ZeroTermAvx512(t, at, s[c]);
      off[c] = xsum ? OffsetsAvx512<kHalf>(t, at, s[c]) : _mm512_setzero_ps();
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512 xs = _mm512_set1_ps(xscale[r * blocks + b]);
      const __m512 xz = kZeros ? _mm512_set1_ps(xqsum[r * blocks + b]) : _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int c = 0; c < NT; ++c) {
        acc[r][c] =
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][c]), _mm512_mul_ps(s[c], xs), acc[r][c]);
        if (kZeros) acc[r][c] = _mm512_fmadd_ps(wz[c], xz, acc[r][c]);
      }
      if (xsum) {
        const __m512 xf = _mm512_set1_ps(xsum[r * blocks + b]);
#pragma GCC unroll 4
        for (int c = 0; c < NT; ++c) acc[r][c] = _mm512_fmadd_ps(off[c], xf, acc[r][c]);
      }
    }
  }
  for (int c = 0; c < NT; ++c) {
    const int64_t columns = std::clamp<int64_t>(t.columns - c * kLanes, 0, kLanes);
    const __mmask16 mask = static_cast<__mmask16>((1u << columns) - 1);
    for (int r = 0; r < MR; ++r)
      _mm512_mask_storeu_ps(t.y + r * t.ldy + c * kLanes, mask, acc[r][c]);
  }
}

template <int MR, int NT>
__attribute__((target("arch=x86-64-v4,avx512vnni"))) void TileAvx512(const Problem& p,
                                                                     const TileArgs& t) {
  if (t.half_scales) {
    TileAvx512Of<MR, NT, true, false>(p, t);
  } else if (t.zeros) {
    TileAvx512Of<MR, NT, false, true>(p, t);
  } else {
    TileAvx512Of<MR, NT, false, false>(p, t);
  }
}

// AVX2 has no int8 dot product into int32: maddubs multiplies u8 x s8 pairs into int16 (a
// 4-bit code times |x| <= 127, twice: at most 3,810, so no saturation), and int16 sums of up
// to 8 of those (32 k: at most 30,480) still fit, so madd with ones widens to int32 once per
// 32 k instead of once per 8. One register is 8 columns (a half strip); NH halves side by side
// read a tile's codes in order and share each broadcast of x (one row: the whole tile).
constexpr int64_t kAvx2Flush = 4;  // chunks (of 8 k) summed in int16 before widening

// ZeroTermAvx512's 8 columns (without zero points the kernels add xbias to a block's int32
// dot products).
__attribute__((target("arch=x86-64-v3"), always_inline)) inline __m256 ZeroTermAvx2(
    const TileArgs& t, int64_t at, __m256 s) {
  const __m256 zero = _mm256_cvtepi32_ps(
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(t.zeros + at))));
  return _mm256_mul_ps(s, _mm256_sub_ps(_mm256_setzero_ps(), zero));
}

template <int MR, int NH, bool kHalf, bool kZeros>
__attribute__((target("arch=x86-64-v3"), always_inline)) inline void HalvesAvx2(const Problem& p,
                                                                                const TileArgs& t) {
  const QuantMatMulArgs& a = *p.a;
  const int64_t chunks = a.block_size / 8, k = a.k, blocks = p.blocks;
  const int8_t* xq = p.xq + t.row * k;
  const float* xscale = p.xscale + t.row * blocks;
  const float* xqsum = p.xqsum + t.row * blocks;
  const int32_t* xbias = p.xbias + t.row * blocks;
  const float* xsum = HasOffsets(t) ? p.xsum + t.row * blocks : nullptr;
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const uint8_t* w = t.codes;
  __m256 acc[MR][NH];
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < NH; ++h) acc[r][h] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* xb = xq + b * a.block_size;
    for (int64_t j0 = 0; j0 < chunks; j0 += kAvx2Flush) {
      __m256i sum16[MR][NH];
      for (int r = 0; r < MR; ++r)
        for (int h = 0; h < NH; ++h) sum16[r][h] = _mm256_setzero_si256();
      const int64_t j1 = std::min(chunks, j0 + kAvx2Flush);
      for (int64_t j = j0; j < j1; ++j, w += kChunkBytes) {
        if (t.next)
          for (int h = 0; h < NH; h += 2)
            _mm_prefetch(reinterpret_cast<const char*>(t.next + (w - t.codes) + 32 * h),
                         _MM_HINT_T1);
#pragma GCC unroll 8
        for (int h = 0; h < NH; ++h) {
          const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * h));
          const __m256i lo = _mm256_and_si256(packed, nibble);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
#pragma GCC unroll 8
          for (int r = 0; r < MR; ++r) {
            const auto [x0, x1] = XQuads(xb + r * k, j);
            const __m256i p0 = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(x0));
            const __m256i p1 = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x1));
            sum16[r][h] = _mm256_add_epi16(sum16[r][h], _mm256_add_epi16(p0, p1));
          }
        }
      }
      // widen, scale by the block's scales and fold in: acc += int32(sum) * s * xscale
#pragma GCC unroll 8
      for (int h = 0; h < NH; ++h) {
        const __m256 s = ScalesAvx2<kHalf>(t, b * kQuantTile + 8 * h);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const __m256 sx = _mm256_mul_ps(s, _mm256_set1_ps(xscale[r * blocks + b]));
          __m256i dot = _mm256_madd_epi16(sum16[r][h], ones);
          if (!kZeros && j0 == 0)  // the block's zero point, once
            dot = _mm256_add_epi32(dot, _mm256_set1_epi32(xbias[r * blocks + b]));
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sx, acc[r][h]);
        }
      }
    }
#pragma GCC unroll 8
    for (int h = 0; h < NH; ++h) {
      const int64_t at = b * kQuantTile + 8 * h;
      const __m256 s = ScalesAvx2<kHalf>(t, at);
      const __m256 wz = kZeros ? ZeroTermAvx2(t, at, s) : _mm256_setzero_ps();
      const __m256 off = xsum ? OffsetsAvx2<kHalf>(t, at, s) : _mm256_setzero_ps();
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        if (kZeros)
          acc[r][h] = _mm256_fmadd_ps(wz, _mm256_set1_ps(xqsum[r * blocks + b]), acc[r][h]);
        if (xsum) acc[r][h] = _mm256_fmadd_ps(off, _mm256_set1_ps(xsum[r * blocks + b]), acc[r][h]);
      }
    }
  }
  for (int h = 0; h < NH; ++h) {
    const int64_t columns = std::clamp<int64_t>(t.columns - 8 * h, 0, 8);
    if (columns == 0) break;
    for (int r = 0; r < MR; ++r) StoreColumnsAvx2(t.y + r * t.ldy + 8 * h, acc[r][h], columns);
  }
}

// One row: the whole tile (4 strips, 8 halves) in one pass.
__attribute__((target("arch=x86-64-v3"))) void TileAvx2Row(const Problem& p, const TileArgs& t) {
  if (t.half_scales) {
    HalvesAvx2<1, 8, true, false>(p, t);
  } else if (t.zeros) {
    HalvesAvx2<1, 8, false, true>(p, t);
  } else {
    HalvesAvx2<1, 8, false, false>(p, t);
  }
}

// sum += v in int16, in place: GCC reassociates a row's chain of int16 sums over a block's
// unrolled chunks and spills the products it hoists (16 ymm registers); in asm the chain stays
// in its register.
__attribute__((target("arch=x86-64-v3"), always_inline)) inline void AddEpi16(__m256i& sum,
                                                                              __m256i v) {
  asm("vpaddw %1, %0, %0" : "+x"(sum) : "x"(v));
}

// Several rows: MR rows x eight columns (one half of a strip) over all of K. Each group of
// kAvx2Flush chunks (32 k) is unrolled and summed in int16, then widened once. kBlockChunks:
// a block's chunks when the block is one group or less (2 or 4), else 0 (groups of 4). With
// kPrefetch, t.next's line of the strip is fetched into L2 as each chunk is read.
template <int MR, int kBlockChunks, bool kPrefetch, bool kHalf, bool kZeros>
__attribute__((target("arch=x86-64-v3"), always_inline)) inline void HalfAvx2Rows(const Problem& p,
                                                                                  const TileArgs& t,
                                                                                  int64_t half) {
  const QuantMatMulArgs& a = *p.a;
  constexpr int kGroup = kBlockChunks ? kBlockChunks : kAvx2Flush;  // chunks of a group
  const int64_t k = a.k, blocks = p.blocks;
  const int64_t groups = kBlockChunks ? 1 : a.block_size / 8 / kAvx2Flush;
  const int8_t* xq = p.xq + t.row * k;
  const float* xscale = p.xscale + t.row * blocks;
  const float* xqsum = p.xqsum + t.row * blocks;
  const int32_t* xbias = p.xbias + t.row * blocks;
  const float* xsum = HasOffsets(t) ? p.xsum + t.row * blocks : nullptr;
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t columns = std::min<int64_t>(8, t.columns - 8 * half);
  const uint8_t* w = t.codes + 32 * half;
  const ptrdiff_t ahead = kPrefetch ? t.next - t.codes : 0;
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i dot[MR];
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* xg = xq + b * a.block_size + g * kGroup * 8;
      __m256i sum[MR];
#pragma GCC unroll 4
      for (int j = 0; j < kGroup; ++j) {
        const uint8_t* wj = w + j * kChunkBytes;
        if (kPrefetch) _mm_prefetch(reinterpret_cast<const char*>(wj + ahead), _MM_HINT_T1);
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wj));
        const __m256i lo = _mm256_and_si256(packed, nibble);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const auto [x0, x1] = XQuads(xg + r * k, j);
          const __m256i p0 = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(x0));
          const __m256i p1 = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x1));
          if (j == 0) {
            sum[r] = _mm256_add_epi16(p0, p1);
          } else {
            AddEpi16(sum[r], p0);
            AddEpi16(sum[r], p1);
          }
        }
      }
      w += kGroup * kChunkBytes;
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        const __m256i wide = _mm256_madd_epi16(sum[r], ones);
        if (kBlockChunks || g == 0) {  // the block's zero point (8) as -8 * sum(x codes)
          dot[r] = kZeros ? wide : _mm256_add_epi32(wide, _mm256_set1_epi32(xbias[r * blocks + b]));
        } else {
          dot[r] = _mm256_add_epi32(dot[r], wide);
        }
      }
    }
    const int64_t at = b * kQuantTile + 8 * half;
    const __m256 s = ScalesAvx2<kHalf>(t, at);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const __m256 sx = _mm256_mul_ps(s, _mm256_set1_ps(xscale[r * blocks + b]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), sx, acc[r]);
    }
    if (kZeros) {
      const __m256 wz = ZeroTermAvx2(t, at, s);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r)
        acc[r] = _mm256_fmadd_ps(wz, _mm256_set1_ps(xqsum[r * blocks + b]), acc[r]);
    }
    if (xsum) {
      const __m256 off = OffsetsAvx2<kHalf>(t, at, s);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r)
        acc[r] = _mm256_fmadd_ps(off, _mm256_set1_ps(xsum[r * blocks + b]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) StoreColumnsAvx2(t.y + r * t.ldy + 8 * half, acc[r], columns);
}

// MR rows x one strip, half by half (the first half fetches the next tile's line of the strip,
// which holds both halves).
template <int MR, int kBlockChunks, bool kHalf, bool kZeros>
__attribute__((target("arch=x86-64-v3"))) void StripAvx2Rows(const Problem& p, const TileArgs& t) {
  if (t.next) {
    HalfAvx2Rows<MR, kBlockChunks, true, kHalf, kZeros>(p, t, 0);
  } else {
    HalfAvx2Rows<MR, kBlockChunks, false, kHalf, kZeros>(p, t, 0);
  }
  if (t.columns > 8) HalfAvx2Rows<MR, kBlockChunks, false, kHalf, kZeros>(p, t, 1);
}

template <int MR, bool kHalf, bool kZeros>
__attribute__((target("arch=x86-64-v3"))) void TileAvx2RowsOf(const Problem& p, const TileArgs& t) {
  switch (p.a->block_size) {
    case 16:
      return StripAvx2Rows<MR, 2, kHalf, kZeros>(p, t);
    case 32:
      return StripAvx2Rows<MR, 4, kHalf, kZeros>(p, t);
    default:
      return StripAvx2Rows<MR, 0, kHalf, kZeros>(p, t);
  }
}

template <int MR>
__attribute__((target("arch=x86-64-v3"))) void TileAvx2Rows(const Problem& p, const TileArgs& t) {
  if (t.half_scales) {
    TileAvx2RowsOf<MR, true, false>(p, t);
  } else if (t.zeros) {
    TileAvx2RowsOf<MR, false, true>(p, t);
  } else {
    TileAvx2RowsOf<MR, false, false>(p, t);
  }
}
#endif

// ---- float16 scales and minimums widened once per work item ----

// A work item whose rows take several row groups widens its tiles' float16 scales and
// minimums once into float32 scales and offsets (m + 8 * scale, rounded once, as the kernels
// round it) and runs the float32 form: y is the same bit for bit, and the row groups do not
// each convert them again. AVX2 and baseline only: with the AVX2 kernels 1-5 % faster at 32
// and 512 rows (bench_ops --against-library, Zen 5 capped at AVX2), with the AVX-512 ones
// no faster (their conversions cost nothing measurable there).
// `half`: the float16 numbers of the item's first tile (its scales and minimums; n of them, a
// multiple of kQuantTile: whole tiles), widened through ScaleAt / OffsetAt or their vectors.
using WidenFn = void (*)(const TileArgs& half, int64_t n, float* scales, float* offsets);

void WidenBase(const TileArgs& half, int64_t n, float* scales, float* offsets) {
  for (int64_t i = 0; i < n; ++i) {
    scales[i] = ScaleAt(half, i);
    if (half.minimums) offsets[i] = OffsetAt(half, i, scales[i]);
  }
}

#ifdef ORT_LORA_QUANT_X86
__attribute__((target("arch=x86-64-v3"))) void WidenAvx2(const TileArgs& half, int64_t n,
                                                         float* scales, float* offsets) {
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 s = ScalesAvx2<true>(half, i);
    _mm256_storeu_ps(scales + i, s);
    if (half.minimums) _mm256_storeu_ps(offsets + i, OffsetsAvx2<true>(half, i, s));
  }
}
#endif

// The widest ISA the CPU has, capped by ORT_LORA_QUANT_ISA (avx512 | avx2 | baseline) so that
// tests can run the narrower copies on a machine that has AVX-512 VNNI.
Isa SelectIsa() {
#ifdef ORT_LORA_QUANT_X86
  __builtin_cpu_init();
  const char* cap = std::getenv("ORT_LORA_QUANT_ISA");
  const bool allow512 = cap == nullptr || std::strcmp(cap, "avx512") == 0;
  const bool allow2 = allow512 || std::strcmp(cap, "avx2") == 0;
  if (allow512 && __builtin_cpu_supports("x86-64-v4") && __builtin_cpu_supports("avx512vnni"))
    return Isa::kAvx512;
  if (allow2 && __builtin_cpu_supports("x86-64-v3")) return Isa::kAvx2;
#endif
  return Isa::kBaseline;
}

using QuantizeFn = void (*)(const Problem&, int64_t row);

QuantizeFn Quantizer(Isa isa) {
#ifdef ORT_LORA_QUANT_X86
  if (isa == Isa::kAvx512) return QuantizeRowAvx512;
  if (isa == Isa::kAvx2) return QuantizeRowAvx2;
#endif
  return QuantizeRowBase;
}

TileKernels Int4Kernels(Isa isa) {
  static constexpr TileFn base[] = {TileBase<1>, TileBase<2>, TileBase<3>, TileBase<4>};
  static constexpr int one[] = {1, 1, 1, 1};
#ifdef ORT_LORA_QUANT_X86
  // Row groups and strips per call chosen by bench/bench_ops.py --only quant (docs/
  // BENCHMARKS.md, "QuantMatMul per ISA"). AVX-512: few rows take several strips at once
  // (independent dot-product chains, codes read in order); 8-row groups keep 16 dot products,
  // 4 nibble registers and 2 broadcasts of x in the 32 zmm registers (the float sums of some
  // spill: a block touches them once), and 32 or 64 rows leave no small group behind (faster
  // than 6-row groups at 32 rows by 5-10 %; one strip at a time, 12 or 16 rows, was slower:
  // twice the broadcasts of x).
  static constexpr TileFn avx512[] = {TileAvx512<1, 4>, TileAvx512<2, 4>, TileAvx512<3, 4>,
                                      TileAvx512<4, 2>, TileAvx512<5, 2>, TileAvx512<6, 2>,
                                      TileAvx512<7, 2>, TileAvx512<8, 2>};
  static constexpr int avx512_strips[] = {4, 4, 4, 2, 2, 2, 2, 2};
  // AVX2 (16 ymm registers): one row streams the whole tile (8 halves, one broadcast of x for
  // all); 2-4 rows one strip, half by half.
  static constexpr TileFn avx2[] = {TileAvx2Row, TileAvx2Rows<2>, TileAvx2Rows<3>, TileAvx2Rows<4>};
  static constexpr int avx2_strips[] = {4, 1, 1, 1};
  if (isa == Isa::kAvx512) return {avx512, avx512_strips, 8};
  if (isa == Isa::kAvx2) return {avx2, avx2_strips, 4};
#endif
  return {base, one, 4};
}

WidenFn Widener(Isa isa) {
#ifdef ORT_LORA_QUANT_X86
  if (isa == Isa::kAvx512) return nullptr;
  if (isa == Isa::kAvx2) return WidenAvx2;
#endif
  return WidenBase;
}

struct Kernels {
  QuantizeFn quantize;
  TileKernels int4, int8;
  WidenFn widen;  // or nullptr: the kernels read float16 numbers as they are
};

Kernels SelectKernels() {
  const Isa isa = SelectIsa();
  return {Quantizer(isa), Int4Kernels(isa), Int8Kernels(isa), Widener(isa)};
}

}  // namespace

void QuantMatMulCpu(const QuantMatMulArgs& a, const ParallelFor& parallel) {
  static const Kernels all = SelectKernels();
  const TileKernels& kernels = a.bits == 8 ? all.int8 : all.int4;
  if (a.m == 0 || a.n == 0) return;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> stats;
  thread_local std::vector<int32_t> isums;
  Problem p{};
  p.a = &a;
  p.blocks = a.k / a.block_size;
  p.tiles = (a.n + kQuantTile - 1) / kQuantTile;
  p.chunks = a.block_size * a.bits / 32;
  p.row_chunks = (a.m + kChunkRows - 1) / kChunkRows;
  const int64_t wanted = std::max<int64_t>(1, kTargetItems / p.row_chunks);
  p.tiles_per_item = std::max<int64_t>(1, (p.tiles + wanted - 1) / wanted);
  xq.resize(a.m * a.k);
  stats.resize(a.m * p.blocks * 3);
  p.xq = xq.data();
  p.xscale = stats.data();
  p.xqsum = p.xscale + a.m * p.blocks;
  p.xsum = a.offsets || a.minimums ? p.xqsum + a.m * p.blocks : nullptr;
  isums.resize(a.m * p.blocks * 2);
  p.xisum = isums.data();
  p.xbias = p.xisum + a.m * p.blocks;

  if (a.float_x) {
    parallel(static_cast<size_t>(p.tiles * kStrips), [&](size_t strip) {
      if (static_cast<int64_t>(strip) * kLanes >= a.n) return;
      if (a.bits == 8) {
        StripFloatX8(p, Strip(p, 0, strip), a.m);
      } else {
        StripFloatX(p, Strip(p, 0, strip), a.m);
      }
    });
    return;
  }
  if (a.m <= kQuantizeSerial) {
    for (int64_t r = 0; r < a.m; ++r) all.quantize(p, r);
  } else {
    parallel(static_cast<size_t>(p.row_chunks), [&](size_t c) {
      const int64_t end = std::min(a.m, static_cast<int64_t>(c + 1) * kChunkRows);
      for (int64_t r = static_cast<int64_t>(c) * kChunkRows; r < end; ++r) all.quantize(p, r);
    });
  }
  const int64_t groups = (p.tiles + p.tiles_per_item - 1) / p.tiles_per_item;
  // row group by row group over an item's tiles while those stay in L2; tile by tile (every
  // row group of it) past that, as an 8-bit LM head's are
  const bool tile_major = p.tiles_per_item * p.blocks * p.chunks * kChunkBytes > kL2Codes;
  parallel(static_cast<size_t>(p.row_chunks * groups), [&](size_t i) {
    const int64_t chunk = static_cast<int64_t>(i) / groups,
                  group = static_cast<int64_t>(i) % groups;
    const int64_t row_end = std::min(a.m, (chunk + 1) * kChunkRows);
    const int64_t first = group * p.tiles_per_item;
    const int64_t tile_end = std::min(p.tiles, (group + 1) * p.tiles_per_item);
    // float16 numbers and several row groups: widened once for the item (WidenFn)
    const int64_t half_at = first * p.blocks * kQuantTile;
    const int64_t half_n = (tile_end - first) * p.blocks * kQuantTile;
    const float* widened = nullptr;
    if (a.half_scales && all.widen && !tile_major && row_end - chunk * kChunkRows > kernels.rows) {
      thread_local std::vector<float> buffer;
      buffer.resize(2 * half_n);
      TileArgs half{};
      half.half_scales = a.half_scales + half_at;
      half.minimums = a.minimums ? a.minimums + half_at : nullptr;
      all.widen(half, half_n, buffer.data(), buffer.data() + half_n);
      widened = buffer.data();
    }
    const auto row_group = [&](int64_t row, int64_t tile, bool prefetch) {
      const int64_t rows = std::min<int64_t>(kernels.rows, row_end - row);
      const int64_t wide = kernels.strips[rows - 1];  // divides kStrips
      for (int64_t strip = tile * kStrips; strip < (tile + 1) * kStrips; strip += wide) {
        if (strip * kLanes >= a.n) break;
        TileArgs t = Strip(p, row, strip);
        if (prefetch) t.next = t.codes + p.blocks * p.chunks * kChunkBytes;
        if (widened) {  // the float32 form, from the item's widened numbers
          const int64_t at = t.half_scales - (a.half_scales + half_at);
          t.scales = widened + at;
          t.offsets = t.minimums ? widened + half_n + at : nullptr;
          t.half_scales = t.minimums = nullptr;
        }
        kernels.tiles[rows - 1](p, t);
      }
    };
    if (tile_major) {  // the first row group of a tile fetches the next tile's codes
      for (int64_t tile = first; tile < tile_end; ++tile)
        for (int64_t row = chunk * kChunkRows; row < row_end; row += kernels.rows)
          row_group(row, tile, row == chunk * kChunkRows && tile + 1 < tile_end);
    } else {  // 4 bits: the first row group fetches the next tile's codes, the item's or the
              // next item's (1 thread at 32 rows: 10-25 % faster with weights out of L2)
      for (int64_t row = chunk * kChunkRows; row < row_end; row += kernels.rows)
        for (int64_t tile = first; tile < tile_end; ++tile)
          row_group(row, tile, a.bits == 4 && row == chunk * kChunkRows && tile + 1 < p.tiles);
    }
  });
}

}  // namespace ort_lora
