// LoraSGMV CPU kernel launcher (float32 x and y; adapter rows float32 or bfloat16). No ONNX
// Runtime types: the op (lora_sgmv_op.cc) validates the inputs, resolves pool offsets to row
// pointers and calls LoraSgmvCpu.
//
// Punica-style split in two passes over balanced work items:
//   shrink  v[t, j]    = scale_j * x[t] . A_j              [n, r] per segment
//   expand  y_out[t]   = y[t] + sum_j v[t, j] Bt_j          (rows of inactive segments: copy)
//           DoRA:  y_out[t] *= 1 + D                        (D: the segment's DoRA row)
// A composed segment is one segment whose rows are its adapters' rows back to back, each A row
// with its own adapter's scale * weight.
// The micro-kernels exist for AVX-512, AVX2+FMA and baseline x86-64, picked once per process
// from the CPU; the environment variable ORT_LORA_SGMV_ISA=avx2|baseline caps the choice
// (tests use it to run the narrower kernels). Each clone exists for float32, bfloat16 and int8
// rows; bfloat16 and int8 rows are widened to float32 as they are loaded (int8: the rows'
// scales folded into the shrink scale, v[t, j] = scale_j * sA_j * sB_j * x[t] . qA_j), or, for
// segments of 8+ rows (prefill), once per call into aligned scratch (lora_sgmv_plan.h).
// Accumulation: float32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/parallel_for.h"
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

// Computes problem.y_out; the passes' items run on parallel_for (the op's: ORT's pool).
void LoraSgmvCpu(const SgmvProblem& problem, const ParallelFor& parallel_for);

}  // namespace ort_lora
