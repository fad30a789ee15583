// LoraSGMV CPU work plan: the passes of one call cut into items of about equal cost, so that a
// decode call (many one-row segments) and a prefill call (few long segments) both give the
// thread pool many similar items. No ONNX Runtime types; used by lora_sgmv_cpu.cc only.
//
// Passes, in order: widen (bfloat16 or int8 rows of long segments, and int8 rows of DoRA
// segments -> float32 scratch, one item per segment), shrink (v = scales * x A^T), expand (y_out =
// (y + v B^T) (1 + D), and copies of base rows); in decode calls shrink and expand run as one
// pass of per-segment groups (SgmvCpuGroup).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "lora_sgmv/lora_sgmv_types.h"

namespace ort_lora {

// Work items. A shrink item covers rows [row0, row1) x A rows [j0, j1) of one segment; an
// expand item covers rows [row0, row1) x columns [c0, c1) of one segment (seg < 0: copy y).

struct SgmvCpuItem {
  int64_t seg;
  int64_t row0, row1;
  int64_t lo, hi;  // shrink: A rows [lo, hi); expand: columns [lo, hi)
};

// Decode calls (every segment one shrink item) run shrink and expand as one pass of groups:
// a segment's shrink item then its expand items, or a run of expand items copying base rows.
// One thread-pool pass instead of two, and a segment's v is still in cache for its expand.
struct SgmvCpuGroup {
  int64_t shrink;                    // its shrink item, -1 = none (base rows)
  int64_t expand_begin, expand_end;  // its expand items
};

struct SgmvCpuPlan {
  const SgmvProblem* p;
  std::vector<SgmvSegment> segs;   // p->segments; widened ones point at wide_values' rows
  std::vector<int64_t> v_base;     // per segment: offset of its v [n, r] in v
  std::vector<float> v;            // shrink results of every segment
  std::vector<int64_t> wide_base;  // per segment: offset of its widened rows, -1 = not widened
  std::vector<int64_t> widen;      // the segments to widen (items of the widen pass)
  std::unique_ptr<float[]> wide_storage;  // holds wide_values
  float* wide_values = nullptr;  // 64-byte aligned; per widened segment A [r, lda], B^T [r, ldb],
                                 // D [ldb] (DoRA)
  int64_t lda = 0, ldb = 0;      // widened row strides: in, out rounded up to 16 (cache lines)
  std::vector<const void*> wide_rows;  // per widened segment: r A, then r B^T row pointers
  // int8 rows of segments not widened: per segment r A, then r B^T pointers to the values
  // (past each row's scale), and r shrink scales with both rows' scales folded in
  std::vector<const void*> int8_rows;
  std::vector<float> int8_scales;
  std::vector<SgmvCpuItem> shrink;
  std::vector<SgmvCpuItem> expand;
  std::vector<SgmvCpuGroup> fused;  // empty: run the shrink pass, then the expand pass
  int64_t widen_cost = 0;           // floats of wide_values
  int64_t shrink_cost = 0;          // multiply-adds of each pass
  int64_t expand_cost = 0;
};

// Long bfloat16 and int8 segments (prefill) are widened to float32 once per call and run the
// float32 tiles: a value is converted once, not once per tile of x rows. Short ones (decode)
// convert as they load, reading a half or a quarter of the bytes. int8 DoRA segments are always
// widened (the DoRA row's scale applies per element, which the direct tiles do not do).
constexpr int64_t kWidenMinRows = 8;
constexpr int64_t kWidenMaxValues = int64_t{16} << 20;  // 64 MiB of widened rows per call
// Shrink and expand fuse into groups when each segment has one shrink item and there are at
// least this many segments (enough groups to share between threads).
constexpr int64_t kFuseMinSegments = 4;

// The plan of one call; `problem` must outlive it.
SgmvCpuPlan PlanSgmvCpu(const SgmvProblem& problem);

}  // namespace ort_lora
