// QuantMatMul's 8-bit tile kernels (layout: quant_matmul_cpu.h). Each block's integer dot
// product is taken against the codes less 128, the default zero point, so that a weight
// without zero points needs no float correction; a zeros input adds (128 - zero) * scale times
// the block's x sum afterwards, as the offsets add theirs.
#include <algorithm>
#include <cstring>
#include <vector>

#include "quant_matmul/quant_matmul_kernels.h"

namespace ort_lora::quant_matmul {

namespace {

constexpr int32_t kMid = 128;  // the default zero point

// Column c's code at k = b * block_size + i, block b's codes at w.
inline uint8_t Code(const uint8_t* w, int64_t c, int64_t i) {
  return w[i / 4 * kChunkBytes + 4 * c + i % 4];
}

// The 4 int8 values of x that meet chunk j, as one int32 to broadcast. always_inline: GCC
// inlines nothing of the default arch into the kernels' target functions otherwise.
inline __attribute__((always_inline)) int32_t XQuad(const int8_t* xb, int64_t j) {
  int32_t quad;
  std::memcpy(&quad, xb + 4 * j, 4);
  return quad;
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
        const uint8_t* w = t.codes + b * p.chunks * kChunkBytes;
        const int8_t* xb = p.xq + row * a.k + b * bs;
        int32_t dot = 0;
        for (int64_t i = 0; i < bs; ++i) dot += xb[i] * (Code(w, c, i) - kMid);
        const int64_t at = b * kQuantTile + c, xt = row * p.blocks + b;
        const float s = t.scales[at];
        acc += static_cast<float>(dot) * (s * p.xscale[xt]);
        if (t.zeros) acc += (s * static_cast<float>(kMid - t.zeros[at])) * p.xqsum[xt];
        if (t.offsets) acc += t.offsets[at] * p.xsum[xt];
      }
      t.y[r * t.ldy + c] = acc;
    }
  }
}

#ifdef ORT_LORA_QUANT_X86
// MR rows x NT adjacent strips: MR * NT independent chains of dot products. vpdpbusd takes the
// codes as they are (u8) and x (s8); the zero point 128 enters as the dot product's start,
// -128 * sum(x codes) of the row's block, so the loop is loads and vpdpbusd only.
template <int MR, int NT>
__attribute__((target("arch=x86-64-v4,avx512vnni"))) void TileAvx512(const Problem& p,
                                                                     const TileArgs& t) {
  const QuantMatMulArgs& a = *p.a;
  const int64_t chunks = p.chunks, k = a.k, blocks = p.blocks;
  const int8_t* xq = p.xq + t.row * k;
  const float* xscale = p.xscale + t.row * blocks;
  const float* xqsum = p.xqsum + t.row * blocks;
  const int32_t* xisum = p.xisum + t.row * blocks;
  const float* xsum = t.offsets ? p.xsum + t.row * blocks : nullptr;
  const uint8_t* w = t.codes;
  __m512 acc[MR][NT];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NT; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dot[MR][NT];
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < NT; ++c) dot[r][c] = _mm512_set1_epi32(-kMid * xisum[r * blocks + b]);
    const int8_t* xb = xq + b * a.block_size;
    for (int64_t j = 0; j < chunks; ++j, w += kChunkBytes) {
      if (t.next)
        for (int c = 0; c < NT; ++c)
          _mm_prefetch(reinterpret_cast<const char*>(t.next + (w - t.codes) + c * 64), _MM_HINT_T1);
      __m512i x[MR];  // each row's 4 values of x for chunk j, in every lane
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) x[r] = _mm512_set1_epi32(XQuad(xb + r * k, j));
#pragma GCC unroll 4
      for (int c = 0; c < NT; ++c) {
        const __m512i codes = _mm512_loadu_si512(w + c * 64);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) dot[r][c] = Dpbusd(dot[r][c], codes, x[r]);
      }
    }
#pragma GCC unroll 4
    for (int c = 0; c < NT; ++c) {
      const int64_t at = b * kQuantTile + c * kLanes;
      const __m512 s = _mm512_loadu_ps(t.scales + at);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512 sx = _mm512_mul_ps(s, _mm512_set1_ps(xscale[r * blocks + b]));
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][c]), sx, acc[r][c]);
      }
      if (t.zeros) {
        const __m512 zero = _mm512_cvtepi32_ps(
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t.zeros + at))));
        const __m512 wz = _mm512_mul_ps(s, _mm512_sub_ps(_mm512_set1_ps(kMid), zero));
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r)
          acc[r][c] = _mm512_fmadd_ps(wz, _mm512_set1_ps(xqsum[r * blocks + b]), acc[r][c]);
      }
      if (xsum) {
        const __m512 off = _mm512_loadu_ps(t.offsets + at);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r)
          acc[r][c] = _mm512_fmadd_ps(off, _mm512_set1_ps(xsum[r * blocks + b]), acc[r][c]);
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

// AVX2 has no int8 dot product into int32, and vpmaddubsw (u8 x s8, pairs summed in int16)
// saturates on codes up to 255 times x up to 127. So the codes less 128 (s8, xor 0x80) give
// their magnitude as the u8 operand (at most 128) and their sign to x (s8, |x| <= 127): a pair
// sums to at most 2 * 128 * 127 = 32,512, exact; vpmaddwd with ones widens each pair sum.
// One register is 8 columns (a half strip); MR rows x NH halves side by side.
template <int MR, int NH>
__attribute__((target("arch=x86-64-v3"))) void HalvesAvx2(const Problem& p, const TileArgs& t,
                                                          int64_t half) {
  const QuantMatMulArgs& a = *p.a;
  const int64_t chunks = p.chunks, k = a.k, blocks = p.blocks;
  const int8_t* xq = p.xq + t.row * k;
  const float* xscale = p.xscale + t.row * blocks;
  const float* xqsum = p.xqsum + t.row * blocks;
  const float* xsum = t.offsets ? p.xsum + t.row * blocks : nullptr;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  const uint8_t* w = t.codes + 32 * half;
  __m256 acc[MR][NH];
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < NH; ++h) acc[r][h] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i dot[MR][NH];
    for (int r = 0; r < MR; ++r)
      for (int h = 0; h < NH; ++h) dot[r][h] = _mm256_setzero_si256();
    const int8_t* xb = xq + b * a.block_size;
    for (int64_t j = 0; j < chunks; ++j, w += kChunkBytes) {
      if (t.next)
        for (int l = 0; l < (32 * NH + 63) / 64; ++l)
          _mm_prefetch(reinterpret_cast<const char*>(t.next + (w - t.codes) + 64 * l), _MM_HINT_T1);
#pragma GCC unroll 4
      for (int h = 0; h < NH; ++h) {
        const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * h));
        const __m256i centered = _mm256_xor_si256(codes, flip);  // code - 128 as s8
        const __m256i magnitude = _mm256_abs_epi8(centered);     // u8, at most 128
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(XQuad(xb + r * k, j)), centered);
          const __m256i pairs = _mm256_maddubs_epi16(magnitude, xs);
          dot[r][h] = _mm256_add_epi32(dot[r][h], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h) {
      const int64_t at = b * kQuantTile + 8 * (half + h);
      const __m256 s = _mm256_loadu_ps(t.scales + at);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        const __m256 sx = _mm256_mul_ps(s, _mm256_set1_ps(xscale[r * blocks + b]));
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), sx, acc[r][h]);
      }
      if (t.zeros) {
        const __m256 zero = _mm256_cvtepi32_ps(
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(t.zeros + at))));
        const __m256 wz = _mm256_mul_ps(s, _mm256_sub_ps(_mm256_set1_ps(kMid), zero));
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r)
          acc[r][h] = _mm256_fmadd_ps(wz, _mm256_set1_ps(xqsum[r * blocks + b]), acc[r][h]);
      }
      if (xsum) {
        const __m256 off = _mm256_loadu_ps(t.offsets + at);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r)
          acc[r][h] = _mm256_fmadd_ps(off, _mm256_set1_ps(xsum[r * blocks + b]), acc[r][h]);
      }
    }
  }
  for (int h = 0; h < NH; ++h) {
    const int64_t columns = std::clamp<int64_t>(t.columns - 8 * (half + h), 0, 8);
    if (columns == 0) break;
    for (int r = 0; r < MR; ++r)
      StoreColumnsAvx2(t.y + r * t.ldy + 8 * (half + h), acc[r][h], columns);
  }
}

// One row: the whole tile (8 halves) in one pass, its codes read in order.
__attribute__((target("arch=x86-64-v3"))) void TileAvx2Row(const Problem& p, const TileArgs& t) {
  HalvesAvx2<1, 8>(p, t, 0);
}

// Several rows: one strip, half by half (16 ymm registers: MR accumulators and MR dot
// products of one half live).
template <int MR>
__attribute__((target("arch=x86-64-v3"))) void TileAvx2Rows(const Problem& p, const TileArgs& t) {
  HalvesAvx2<MR, 1>(p, t, 0);
  if (t.columns > 8) HalvesAvx2<MR, 1>(p, t, 1);
}
#endif

}  // namespace

TileKernels Int8Kernels(Isa isa) {
  static constexpr TileFn base[] = {TileBase<1>, TileBase<2>, TileBase<3>, TileBase<4>};
  static constexpr int one[] = {1, 1, 1, 1};
#ifdef ORT_LORA_QUANT_X86
  // Row groups and strips per call chosen by bench/bench_ops.py --only quant --cases lm_head8.
  // AVX-512: few rows take several strips at once (independent chains, codes read in order);
  // 5-row groups keep 10 accumulators, 10 dot products, 5 broadcasts of x and 2 lines of
  // codes in the 32 zmm registers (6 rows spill one a chunk and run 10-15 % slower).
  static constexpr TileFn avx512[] = {TileAvx512<1, 4>, TileAvx512<2, 4>, TileAvx512<3, 4>,
                                      TileAvx512<4, 2>, TileAvx512<5, 2>};
  static constexpr int avx512_strips[] = {4, 4, 4, 2, 2};
  // AVX2 (16 ymm registers): one row streams the whole tile; 2-4 rows one strip, half by half.
  static constexpr TileFn avx2[] = {TileAvx2Row, TileAvx2Rows<2>, TileAvx2Rows<3>, TileAvx2Rows<4>};
  static constexpr int avx2_strips[] = {4, 1, 1, 1};
  if (isa == Isa::kAvx512) return {avx512, avx512_strips, 5};
  if (isa == Isa::kAvx2) return {avx2, avx2_strips, 4};
#endif
  return {base, one, 4};
}

void StripFloatX8(const Problem& p, const TileArgs& t, int64_t rows) {
  const QuantMatMulArgs& a = *p.a;
  const int64_t bs = a.block_size, columns = std::min(kLanes, t.columns);
  std::vector<float> w(bs);
  for (int64_t r = 0; r < rows; ++r) std::fill(t.y + r * t.ldy, t.y + r * t.ldy + columns, 0.0f);
  for (int64_t b = 0; b < p.blocks; ++b)
    for (int64_t c = 0; c < columns; ++c) {
      const int64_t at = b * kQuantTile + c;
      const float s = t.scales[at], zero = t.zeros ? float(t.zeros[at]) : float(kMid);
      const float off = t.offsets ? t.offsets[at] : 0.0f;
      for (int64_t i = 0; i < bs; ++i)
        w[i] = (float(Code(t.codes + b * p.chunks * kChunkBytes, c, i)) - zero) * s + off;
      for (int64_t r = 0; r < rows; ++r) {
        const float* x = a.x + (t.row + r) * a.k + b * bs;
        float acc = 0.0f;
        for (int64_t i = 0; i < bs; ++i) acc += x[i] * w[i];
        t.y[r * t.ldy + c] += acc;
      }
    }
}

}  // namespace ort_lora::quant_matmul
