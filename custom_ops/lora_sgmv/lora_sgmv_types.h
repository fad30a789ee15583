// The LoraSGMV CPU kernel's problem: one call's rows and active segments, with adapter rows
// already resolved to pointers. Shared by the kernel launcher (lora_sgmv_cpu.h), its work plan
// (lora_sgmv_plan.h) and the op that fills it (lora_sgmv_op.cc). No ONNX Runtime types.
#pragma once

#include <cstdint>
#include <vector>

#include "lora_sgmv/lora_sgmv_checks.h"

namespace ort_lora {

// What a row pointer (A, B^T, D) points at, by the call's SgmvRowLayout:
//   kPoolType       const float*: `len` floats (the CPU pool is float32)
//   kBFloat16Pairs  const uint16_t*: `len` bfloat16 bit patterns, little-endian, any alignment
//   kInt8Scaled     const float*: the row's scale, then `len` int8 values q from the next byte
//                   (value = scale * q); the plan folds the scales of A and B^T rows into the
//                   shrink scale and widens the rows of long segments and of DoRA segments

// One segment that has adapters (rank > 0) and at least one row.
struct SgmvSegment {
  int64_t row_begin;           // first row of x / y
  int64_t row_end;             // one past the last row
  int64_t rank;                // r, 1..kMaxRank: the rows of all its adapters
  const float* scales;         // [r] scale of each A row: its adapter's scale * weight
  const void* const* a_rows;   // [r] pointers to rows of A, each `in` elements of row_type
  const void* const* bt_rows;  // [r] pointers to rows of B^T, each `out` elements of row_type
  const void* dora;            // null, or the DoRA row D: `out` elements of row_type
};

struct SgmvProblem {
  const float* x;  // [num_rows, in]
  const float* y;  // [num_rows, out]
  float* y_out;    // [num_rows, out]; may equal y (each element is read before it is written)
  int64_t num_rows;
  int64_t in_features;
  int64_t out_features;
  SgmvRowLayout row_type;             // of every segment's a_rows and bt_rows
  std::vector<SgmvSegment> segments;  // active segments, disjoint row ranges, any order
};

}  // namespace ort_lora
