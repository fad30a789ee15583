// LoraSGMV CPU work plan: the passes of one call cut into items, so that a decode call (many
// short segments) and a prefill call (few long segments) both give the thread pool work of
// about equal cost. No ONNX Runtime types; used by lora_sgmv_cpu.cc only.
//
// Passes, in order: widen (baseline kernels only: 16-bit or int8 rows of long segments ->
// float32 scratch, one item per segment), shrink (v = scales * x A^T over every
// module's A rows), expand (per module: y_out = (y + v B^T) (1 + D), and copies of the rows
// left as y when y_out is another buffer). Decode calls (many short segments) run shrink and
// expand as one pass of per-segment groups (SgmvCpuGroup).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "lora_sgmv/lora_sgmv_types.h"

namespace ort_lora {

// A shrink item covers rows [row0, row1) x A rows [lo, hi) of one segment; an expand item
// rows [row0, row1) x columns [lo, hi) of one module's output, for one segment (seg < 0: a copy
// of y's rows to y_out).
struct SgmvCpuItem {
  int64_t seg;
  int64_t module;  // expand: the output it writes
  int64_t row0, row1;
  int64_t lo, hi;  // shrink: A rows [lo, hi); expand: columns [lo, hi)
};

// A group of the decode pass: a segment's shrink items, then its expand items (every module),
// or copies of rows left as y. One thread-pool pass instead of two, and a segment's v is
// still in cache for its expand.
struct SgmvCpuGroup {
  int64_t shrink_begin, shrink_end;  // its shrink items (none for copies)
  int64_t expand_begin, expand_end;  // its expand items
};

struct SgmvCpuPlan {
  const SgmvProblem* p = nullptr;
  std::vector<SgmvSegment> segs;   // p->segments; widened ones point at wide_values' rows
  std::vector<int64_t> v_base;     // per segment: offset of its v [n, R] in v
  std::vector<float> v;            // shrink results of every segment
  std::vector<int64_t> wide_base;  // per segment: offset of its widened rows, -1 = not widened
  std::vector<int64_t> widen;      // the segments to widen (items of the widen pass)
  std::unique_ptr<float[]> wide_storage;  // holds wide_values (null when nothing is widened)
  float* wide_values = nullptr;  // 64-byte aligned; per widened segment A [R, lda], then each
                                 // B^T row (its module's features rounded up to 16), then each
                                 // module's D (DoRA)
  int64_t lda = 0;               // widened A row stride: in rounded up to 16 (cache lines)
  std::vector<const void*> wide_rows;  // per widened segment: R A, then R B^T row pointers
  std::vector<SgmvCpuItem> shrink;
  std::vector<SgmvCpuItem> expand;
  std::vector<SgmvCpuGroup> fused;  // empty: run the shrink pass, then the expand pass
  int64_t widen_cost = 0;           // floats of wide_values
  int64_t shrink_cost = 0;          // multiply-adds of each pass
  int64_t expand_cost = 0;
};

// With the baseline clone's kernels (SSE2: float16 converted lane by lane, bfloat16 and int8
// through unpacks), long bfloat16, float16 and int8 segments (prefill) are widened to
// float32 once per call and run the float32 tiles: a value is converted once, not once per
// tile of x rows. The AVX2 and AVX-512 kernels convert 8 or 16 lanes as they load at every
// length: widening made them 1.1-2.5x slower from 8 to 128 rows (the pass runs a segment on
// one thread and writes twice the bytes it reads) and gained nothing at 512-2,048 (Zen 4).
constexpr int64_t kWidenMinRows = 8;
constexpr int64_t kWidenMaxValues = int64_t{16} << 20;  // 64 MiB of widened rows per call
// Shrink and expand run as one pass of per-segment groups when there are at least this many
// segments and none costs more than 1 / kFuseMinSegments of the call (groups enough, and even
// enough, for the threads to share).
constexpr int64_t kFuseMinSegments = 4;

// The plan of one call into `plan`, whose vectors keep their capacity from the call before (a
// decode step's calls then allocate nothing); `problem` must outlive it. widen: the kernels
// want long segments' rows widened (kWidenMinRows).
void PlanSgmvCpu(const SgmvProblem& problem, SgmvCpuPlan& plan, bool widen);

}  // namespace ort_lora
