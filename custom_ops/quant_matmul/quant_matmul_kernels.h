// What QuantMatMul's tile kernels share: x quantized per block, one call's view of a strip of
// the weight, and the kernel tables the ISA dispatch picks from. The 4-bit kernels and the
// dispatch live in quant_matmul_cpu.cc, the 8-bit kernels in quant_matmul_int8.cc. No ONNX
// Runtime types.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/float16.h"
#include "quant_matmul/quant_matmul_cpu.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define ORT_LORA_QUANT_X86 1
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*() and warn of it (GCC bug 105593)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace ort_lora::quant_matmul {

constexpr int64_t kLanes = 16;                    // columns of one AVX-512 register: a strip
constexpr int64_t kStrips = kQuantTile / kLanes;  // strips per tile
constexpr int64_t kChunkBytes = kQuantTile * 4;   // a tile's codes of one chunk (8 k or 4 k)

// x quantized per block, and what the kernels multiply by.
struct Problem {
  const QuantMatMulArgs* a;
  int64_t blocks, tiles, row_chunks, tiles_per_item;  // row chunks: of kChunkRows rows
  int8_t* xq;                                         // [m, k]
  float* xscale;                                      // [m, blocks] amax / 127
  float* xqsum;    // [m, blocks] xscale * sum(codes): what the zero points multiply
  float* xsum;     // [m, blocks] float sums of x: what the offsets multiply (with offsets)
  int32_t* xisum;  // [m, blocks] sum(codes) as an integer (8 bits: the zero point 128's term)
  int32_t* xbias;  // [m, blocks] -8 * sum(codes): the zero point 8's term (4 bits, no zeros;
                   // stored, not -8 * xisum in the kernels: the AVX2 ones ran 0.95-0.99x of
                   // this with the product formed per row and block)
  int64_t chunks;  // chunks (of kChunkBytes) per block: block_size * bits / 32
};

// One call of a tile kernel: MR rows x some strips of one tile, over all of K.
struct TileArgs {
  const uint8_t* codes;  // the strip's codes, block 0 (a chunk of the tile later: the next)
  const float* scales;   // the strip's, block 0 (a block's 64 columns later: the next)
  const uint8_t* zeros;
  const float* offsets;
  const uint16_t* half_scales;  // float16 scales and minimums instead (4 bits)
  const uint16_t* minimums;
  int64_t row, columns;  // first row; columns of its output from the strip's first on
  float* y;              // the output at [row, the strip's first column]
  int64_t ldy;           // the output's row stride
  const uint8_t* next;   // the same strips' codes in the next tile, to prefetch; or nullptr
                         // (the 8-bit kernels read it: the memory stream of a large weight
                         // overlaps the products of many rows)
};

using TileFn = void (*)(const Problem&, const TileArgs&);

// The scale at `at` of the strip's scales (block b's columns from b * 64).
inline float ScaleAt(const TileArgs& t, int64_t at) {
  return t.half_scales ? HalfToFloat(t.half_scales[at]) : t.scales[at];
}

// The offset there (s: the scale there): as stored, or minimum + 8 * scale; 0 without either.
inline float OffsetAt(const TileArgs& t, int64_t at, float s) {
  if (t.minimums) return std::fma(8.0f, s, HalfToFloat(t.minimums[at]));
  return t.offsets ? t.offsets[at] : 0.0f;
}

inline bool HasOffsets(const TileArgs& t) { return t.offsets || t.minimums; }

// The kernels of one weight width on one ISA.
struct TileKernels {
  const TileFn* tiles;  // tiles[r - 1]: r rows x strips[r - 1] strips of a tile
  const int* strips;    // each divides kStrips
  int rows;             // rows of a full row group
};

enum class Isa { kBaseline, kAvx2, kAvx512 };

#ifdef ORT_LORA_QUANT_X86
// acc + codes . x (vpdpbusd: u8 codes x s8 x, quads summed into int32), in asm: GCC 12 copies
// the accumulators of the intrinsic twice per product in the tile loops (not coalesced), which
// costs as much as the products. x is a register: vpdpbusd with an embedded broadcast from
// memory ({1to16}) runs at under half the rate here.
__attribute__((target("arch=x86-64-v4,avx512vnni"), always_inline)) inline __m512i Dpbusd(
    __m512i acc, __m512i codes, __m512i x) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(codes), "v"(x));
  return acc;
}

// ScaleAt and OffsetAt for the 8 columns from `at`, kHalf: t's float16 numbers (a template
// argument: a branch per block made the 2-4-row AVX2 kernel about 6 % slower on Zen 3).
template <bool kHalf>
__attribute__((target("arch=x86-64-v3"), always_inline)) inline __m256 ScalesAvx2(const TileArgs& t,
                                                                                  int64_t at) {
  if (kHalf)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t.half_scales + at)));
  return _mm256_loadu_ps(t.scales + at);
}

template <bool kHalf>
__attribute__((target("arch=x86-64-v3"), always_inline)) inline __m256 OffsetsAvx2(
    const TileArgs& t, int64_t at, __m256 s) {
  if (kHalf)
    return _mm256_fmadd_ps(
        _mm256_set1_ps(8.0f), s,
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t.minimums + at))));
  return _mm256_loadu_ps(t.offsets + at);
}

// ... and for the 16 columns from `at`.
template <bool kHalf>
__attribute__((target("arch=x86-64-v4"), always_inline)) inline __m512 ScalesAvx512(
    const TileArgs& t, int64_t at) {
  if (kHalf)
    return _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.half_scales + at)));
  return _mm512_loadu_ps(t.scales + at);
}

template <bool kHalf>
__attribute__((target("arch=x86-64-v4"), always_inline)) inline __m512 OffsetsAvx512(
    const TileArgs& t, int64_t at, __m512 s) {
  if (kHalf)
    return _mm512_fmadd_ps(
        _mm512_set1_ps(8.0f), s,
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.minimums + at))));
  return _mm512_loadu_ps(t.offsets + at);
}

// The first `columns` (1 to 8) of v at out: a whole register, or the tile's last columns.
__attribute__((target("arch=x86-64-v3"), always_inline)) inline void StoreColumnsAvx2(
    float* out, __m256 v, int64_t columns) {
  if (columns == 8) {
    _mm256_storeu_ps(out, v);
    return;
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, v);
  std::memcpy(out, lanes, columns * sizeof(float));
}
#endif

// 8-bit weights (quant_matmul_int8.cc): the kernels for `isa`.
TileKernels Int8Kernels(Isa isa);

// 8-bit weights, float x (accuracy_level 0 / 1): the strip's `rows` rows.
void StripFloatX8(const Problem& p, const TileArgs& t, int64_t rows);

}  // namespace ort_lora::quant_matmul
