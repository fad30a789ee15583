// The int8 multiply-add roof of one core, for bench_ops.py's QuantMatMul table: how many
// int8 multiply-adds per second the instructions QuantMatMul is built on can retire when
// nothing else is in the way (independent accumulators in registers, no loads).
//   avx2    vpmaddubsw (u8 x s8 pairs into int16) + vpaddw into int16 accumulators: what
//           QuantMatMul's AVX2 kernel does per 32 products
//   avx512  vpdpbusd (AVX-512 VNNI: u8 x s8 quads into int32): its AVX-512 kernel's step
// Prints one JSON object: {"avx2_gops": ..., "avx512_vnni_gops": ... or null}, GOPS counting
// a multiply-add as 2 operations, per second of this thread's CPU time. Built and run by
// bench_ops.py (c++ -O2).
#include <immintrin.h>
#include <time.h>

#include <algorithm>
#include <cstdio>

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
double Gops(Body body, double ops_per_iter) {
  int sink = body(kIters / 10);
  double best = 1e30;
  for (int i = 0; i < 3; ++i) {
    const double t0 = ThreadSeconds();
    sink ^= body(kIters);
    best = std::min(best, ThreadSeconds() - t0);
  }
  return ops_per_iter * kIters / best / 1e9 + (sink == 12345 ? 1e-12 : 0.0);
}

// 8 accumulators, 8 distinct products (4 left x 2 right operands): 14 of the 16 ymm registers.
__attribute__((target("avx2"))) int Avx2(long iters) {
  constexpr int kAcc2 = 8;
  __m256i acc[kAcc2], a[4];
  for (int i = 0; i < kAcc2; ++i) acc[i] = _mm256_set1_epi16(static_cast<short>(i));
  for (int i = 0; i < 4; ++i) a[i] = _mm256_set1_epi8(static_cast<char>(3 + i));
  __m256i b0 = _mm256_set1_epi8(-2), b1 = _mm256_set1_epi8(1);
  for (long n = 0; n < iters; ++n) {
    // opaque operands: the products are computed again every iteration
    __asm__ volatile("" : "+x"(a[0]), "+x"(a[1]), "+x"(a[2]), "+x"(a[3]), "+x"(b0), "+x"(b1));
#pragma GCC unroll 8
    for (int i = 0; i < kAcc2; ++i)
      acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(a[i % 4], i < 4 ? b0 : b1));
  }
  __m256i sum = acc[0];
  for (int i = 1; i < kAcc2; ++i) sum = _mm256_xor_si256(sum, acc[i]);
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

}  // namespace

int main() {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2");
  const bool vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
  // 32 multiply-adds per vpmaddubsw (ymm), 64 per vpdpbusd (zmm); 2 operations each
  const double avx2_gops = avx2 ? Gops(Avx2, 8 * 32 * 2.0) : -1.0;
  const double vnni_gops = vnni ? Gops(Avx512Vnni, kAcc * 64 * 2.0) : -1.0;
  std::printf("{\"avx2_gops\": ");
  avx2 ? std::printf("%.1f", avx2_gops) : std::printf("null");
  std::printf(", \"avx512_vnni_gops\": ");
  vnni ? std::printf("%.1f", vnni_gops) : std::printf("null");
  std::printf("}\n");
  return 0;
}
