// The LoraSGMV CPU kernel's problem: one call's rows, its outputs (one per module, all reading
// the same x) and its active segments, with adapter rows already resolved to pointers. Shared
// by the kernel launcher (lora_sgmv_cpu.h), its work plan (lora_sgmv_plan.h) and the op that
// fills it (lora_sgmv_op.cc). No ONNX Runtime types.
#pragma once

#include <cstdint>
#include <vector>

#include "lora_sgmv/lora_sgmv_checks.h"

namespace ort_lora {

// What a row pointer (A, B^T, D) points at, by the call's SgmvRowLayout:
//   kPoolType       const float*: `len` floats (the CPU pool is float32)
//   kBFloat16Pairs  const uint16_t*: `len` bfloat16 bit patterns, little-endian, any alignment
//   kFloat16Pairs   the same with IEEE float16 bit patterns
//   kInt8Scaled     const float*: the row's scale, then `len` int8 values q from the next byte
//                   (value = scale * q); the shrink folds the scales of A and B^T rows into its
//                   result, the expand applies a DoRA row's as it loads D, and the plan widens
//                   the rows of long segments for the baseline kernels

// One module of the call: its projection's output y and the LoRA output written from it.
struct SgmvOutput {
  const float* y;    // [num_rows, features]
  float* y_out;      // [num_rows, features]; may equal y (each element is read before written)
  int64_t features;  // out: the length of the module's B^T rows (and DoRA row)
};

// One segment that has adapter rows (rank > 0) in at least one module and at least one row.
// Its A rows are every module's, module after module: the shrink multiplies x by all of them
// in one pass, and module m's expand reads v's columns [first[m], first[m + 1]).
struct SgmvSegment {
  int64_t row_begin;                   // first row of x / y
  int64_t row_end;                     // one past the last row
  int64_t rank;                        // R: the A rows of all modules (each <= kMaxRank)
  int64_t first[kSgmvMaxModules + 1];  // module m's rows: [first[m], first[m + 1]), first[0] 0
  const float* scales;                 // [R] scale of each A row: its adapter's scale * weight
  const void* const* a_rows;           // [R] pointers to rows of A, each `in` elements
  const void* const* bt_rows;          // [R] pointers to rows of B^T, its module's features
  const void* dora[kSgmvMaxModules];   // per module: null, or its DoRA row D (features)
};

struct SgmvProblem {
  const float* x;  // [num_rows, in]
  int64_t num_rows;
  int64_t in_features;
  int num_outputs;  // modules, 1..kSgmvMaxModules
  SgmvOutput outputs[kSgmvMaxModules];
  SgmvRowLayout row_type;             // of every segment's rows
  std::vector<SgmvSegment> segments;  // active segments, disjoint row ranges, in row order
};

}  // namespace ort_lora
