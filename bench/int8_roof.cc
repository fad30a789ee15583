// The int8 multiply-add roof of one core, for bench_ops.py's QuantMatMul table: how many
// int8 multiply-adds per second the instructions QuantMatMul is built on can retire when
// nothing else is in the way (independent accumulators in registers, no loads).
//   avx2    vpmaddubsw (u8 x s8 pairs into int16) + vpaddw into int16 accumulators: what
//           QuantMatMul's AVX2 kernel does per 32 products
//   avx512  vpdpbusd (AVX-512 VNNI: u8 x s8 quads into int32): its AVX-512 kernel's step
// and, beside them, the float32 roof of the same core that the float32 MatMul it is compared
// with is built on: vfmadd231ps on ymm (FMA3, MLAS's AVX2 kernels) and on zmm (AVX-512F, MLAS's
// kernels where the CPU has it). The int8 roof over the float32 one bounds how much faster than
// a float32 MatMul an int8 kernel can be when both run at the same share of their roofs.
// And one ceiling below the AVX2 roof: avx2_q4_loop, the inner loop of QuantMatMul's 4-bit
// AVX2 kernel for 4 rows (custom_ops/quant_matmul/quant_matmul_cpu.cc, TileAvx2Rows<4>: a
// chunk's codes split into nibbles once, then per row two broadcasts of x, two vpmaddubsw,
// vpaddw, vpmaddwd and vpaddd), over codes and x that stay in L1, with no per-block float
// scaling: what the kernel's instructions allow before memory, scales and the op around it.
// Prints one JSON object: {"avx2_gops", "avx512_vnni_gops", "fma_ymm_gflops",
// "fma_zmm_gflops", "avx2_q4_loop_gops"} (null where the CPU lacks the instructions), counting
// a multiply-add as 2 operations, per second of this thread's CPU time. Built and run by
// bench_ops.py (c++ -O2).
#include <immintrin.h>
#include <time.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace {

constexpr int kAcc = 10;  // independent accumulators: more than latency x throughput
constexpr long kIters = 20'000'000;

double ThreadSeconds() {  // this thread's CPU time: a shared machine's other jobs excluded
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// The best of 3 timed runs after a warm-up.
template <typename Body>
double Gops(Body body, double ops_per_iter, long iters = kIters) {
  int sink = body(iters / 10);
  double best = 1e30;
  for (int i = 0; i < 3; ++i) {
    const double t0 = ThreadSeconds();
    sink ^= body(iters);
    best = std::min(best, ThreadSeconds() - t0);
  }
  return ops_per_iter * iters / best / 1e9 + (sink == 12345 ? 1e-12 : 0.0);
}

// 8 accumulators, each fed by a product of its own, in inline assembly: written in C, GCC
// either computes a product once for the accumulators that share its operands or, with 8
// distinct operand pairs, keeps accumulators on the stack (their store-to-load chains held an
// earlier version of this loop to under half the rate).
__attribute__((target("avx2"))) int Avx2(long iters) {
  // named accumulators, not an array: GCC stores an array's elements every iteration
  __m256i c0 = _mm256_set1_epi16(0), c1 = _mm256_set1_epi16(1), c2 = _mm256_set1_epi16(2),
          c3 = _mm256_set1_epi16(3), c4 = _mm256_set1_epi16(4), c5 = _mm256_set1_epi16(5),
          c6 = _mm256_set1_epi16(6), c7 = _mm256_set1_epi16(7);
  const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2);
  for (long n = 0; n < iters; ++n) {
    __asm__ volatile(
        "vpmaddubsw %[b], %[a], %%ymm12\n\t"
        "vpmaddubsw %[b], %[a], %%ymm13\n\t"
        "vpmaddubsw %[b], %[a], %%ymm14\n\t"
        "vpmaddubsw %[b], %[a], %%ymm15\n\t"
        "vpaddw %%ymm12, %[c0], %[c0]\n\t"
        "vpaddw %%ymm13, %[c1], %[c1]\n\t"
        "vpaddw %%ymm14, %[c2], %[c2]\n\t"
        "vpaddw %%ymm15, %[c3], %[c3]\n\t"
        "vpmaddubsw %[b], %[a], %%ymm12\n\t"
        "vpmaddubsw %[b], %[a], %%ymm13\n\t"
        "vpmaddubsw %[b], %[a], %%ymm14\n\t"
        "vpmaddubsw %[b], %[a], %%ymm15\n\t"
        "vpaddw %%ymm12, %[c4], %[c4]\n\t"
        "vpaddw %%ymm13, %[c5], %[c5]\n\t"
        "vpaddw %%ymm14, %[c6], %[c6]\n\t"
        "vpaddw %%ymm15, %[c7], %[c7]"
        : [c0] "+x"(c0), [c1] "+x"(c1), [c2] "+x"(c2), [c3] "+x"(c3), [c4] "+x"(c4), [c5] "+x"(c5),
          [c6] "+x"(c6), [c7] "+x"(c7)
        : [a] "x"(a), [b] "x"(b)
        : "xmm12", "xmm13", "xmm14", "xmm15");
  }
  const __m256i sum = (c0 ^ c1) ^ (c2 ^ c3) ^ (c4 ^ c5) ^ (c6 ^ c7);
  return _mm256_extract_epi32(sum, 0);
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) int Avx512Vnni(long iters) {
  __m512i acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_set1_epi32(i);
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
  for (long n = 0; n < iters; ++n) {
#pragma GCC unroll 10
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
    __asm__ volatile("" : "+v"(a), "+v"(b));
  }
  __m512i sum = acc[0];
  for (int i = 1; i < kAcc; ++i) sum = _mm512_xor_si512(sum, acc[i]);
  return _mm_cvtsi128_si32(_mm512_castsi512_si128(sum));
}

// kAcc independent float32 multiply-add chains on vectors V (GCC vector extensions: each
// acc * a + b is one vfmadd in the FMA3 and AVX-512 clones below), a product near 1 so that
// the sums stay finite.
template <typename V>
inline __attribute__((always_inline)) int FmaChains(long iters) {
  V acc[kAcc], a = V{} + 0.999f, b = V{} + 1e-3f;
  for (int i = 0; i < kAcc; ++i) acc[i] = b;
  for (long n = 0; n < iters; ++n) {
#pragma GCC unroll 10
    for (int i = 0; i < kAcc; ++i) acc[i] = acc[i] * a + b;
    __asm__ volatile("" : "+v"(a), "+v"(b));
  }
  float sum = 0.0f;
  for (int i = 0; i < kAcc; ++i) sum += acc[i][0];
  return static_cast<int>(sum);
}

// The 4-bit AVX2 kernel's loop, one pass = 4 rows x 16 columns (two halves of 8) x kQ4K, in
// the kernel's layout (a 256-byte chunk per 8 k of a 64-column tile; a half reads 32 bytes
// of it) and with its instructions; widened to float once per 32 k.
constexpr int kQ4Rows = 4, kQ4K = 256;
constexpr long kQ4Passes = 200'000;
constexpr double kQ4Ops = 2.0 * kQ4Rows * 16 * kQ4K;
alignas(64) uint8_t q4_codes[kQ4K / 8 * 256];
alignas(64) int8_t q4_x[kQ4Rows * kQ4K];

__attribute__((target("avx2"))) int Avx2Q4Loop(long passes) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[kQ4Rows];
  for (int r = 0; r < kQ4Rows; ++r) acc[r] = _mm256_setzero_ps();
  for (long n = 0; n < passes; ++n) {
    __asm__ volatile("" ::: "memory");  // the codes and x are read again every pass
    for (int half = 0; half < 2; ++half) {
      const uint8_t* w = q4_codes + 32 * half;
#pragma GCC unroll 1
      for (int j0 = 0; j0 < kQ4K / 8; j0 += 4) {
        __m256i dot[kQ4Rows];
#pragma GCC unroll 4
        for (int r = 0; r < kQ4Rows; ++r) dot[r] = _mm256_setzero_si256();
        for (int j = j0; j < j0 + 4; ++j, w += 256) {
          const __m256i packed = _mm256_load_si256(reinterpret_cast<const __m256i*>(w));
          const __m256i lo = _mm256_and_si256(packed, nibble);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
#pragma GCC unroll 4
          for (int r = 0; r < kQ4Rows; ++r) {
            int32_t x0, x1;
            std::memcpy(&x0, q4_x + r * kQ4K + 8 * j, 4);
            std::memcpy(&x1, q4_x + r * kQ4K + 8 * j + 4, 4);
            const __m256i p0 = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(x0));
            const __m256i p1 = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x1));
            dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones));
          }
        }
#pragma GCC unroll 4
        for (int r = 0; r < kQ4Rows; ++r)
          acc[r] = _mm256_add_ps(acc[r], _mm256_cvtepi32_ps(dot[r]));
      }
    }
  }
  float lanes[8];
  _mm256_storeu_ps(lanes,
                   _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
  return static_cast<int>(lanes[0]);
}

typedef float F32x8 __attribute__((vector_size(32)));
typedef float F32x16 __attribute__((vector_size(64)));
__attribute__((target("avx2,fma"))) int Fma3(long iters) { return FmaChains<F32x8>(iters); }
__attribute__((target("avx512f"))) int Fma512(long iters) { return FmaChains<F32x16>(iters); }

void PrintField(const char* name, bool has, double value, const char* after) {
  std::printf("\"%s\": ", name);
  has ? std::printf("%.1f", value) : std::printf("null");
  std::printf("%s", after);
}

}  // namespace

int main() {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2");
  const bool vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
  // 32 multiply-adds per vpmaddubsw (ymm), 64 per vpdpbusd (zmm); 2 operations each
  const double avx2_gops = avx2 ? Gops(Avx2, 8 * 32 * 2.0) : -1.0;
  const double vnni_gops = vnni ? Gops(Avx512Vnni, kAcc * 64 * 2.0) : -1.0;
  // 8 float32 multiply-adds per ymm vfmadd231ps, 16 per zmm
  const bool fma3 = avx2 && __builtin_cpu_supports("fma");
  const bool avx512 = __builtin_cpu_supports("avx512f");
  const double ymm_gflops = fma3 ? Gops(Fma3, kAcc * 8 * 2.0) : -1.0;
  const double zmm_gflops = avx512 ? Gops(Fma512, kAcc * 16 * 2.0) : -1.0;
  std::memset(q4_codes, 0x35, sizeof q4_codes);
  std::memset(q4_x, 3, sizeof q4_x);
  const double q4_gops = avx2 ? Gops(Avx2Q4Loop, kQ4Ops, kQ4Passes) : -1.0;
  std::printf("{");
  PrintField("avx2_gops", avx2, avx2_gops, ", ");
  PrintField("avx512_vnni_gops", vnni, vnni_gops, ", ");
  PrintField("fma_ymm_gflops", fma3, ymm_gflops, ", ");
  PrintField("fma_zmm_gflops", avx512, zmm_gflops, ", ");
  PrintField("avx2_q4_loop_gops", avx2, q4_gops, "}\n");
  return 0;
}
