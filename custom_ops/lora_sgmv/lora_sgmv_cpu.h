// LoraSGMV CPU kernel launcher (float32 x and y; adapter rows float32, bfloat16, float16 or
// int8). No ONNX Runtime types: the op (lora_sgmv_op.cc) validates the inputs, resolves pool
// offsets to row pointers and calls LoraSgmvCpu.
//
// Punica-style split in two passes over balanced work items:
//   shrink  v[t, j]    = scale_j * x[t] . A_j              [n, R] per segment
//   expand  y_out_m[t] = y_m[t] + sum_{j of m} v[t, j] Bt_j   per module m (rows a module
//                                                         leaves as y: copied, if y_out_m is
//                                                         another buffer)
//           DoRA:  y_out_m[t] *= 1 + D_m                  (D_m: the segment's DoRA row in m)
// A call may serve several modules that read the same x (q/k/v): a segment's A rows are all
// of its modules' rows, so the shrink reads x once for all of them. A composed segment is one
// segment whose rows are its adapters' rows back to back, each A row with its own adapter's
// scale * weight. Decode calls run shrink and expand as one pass of per-segment groups.
// The micro-kernels exist for AVX-512, AVX2+FMA and baseline x86-64, picked once per process
// from the CPU; the environment variable ORT_LORA_SGMV_ISA=avx2|baseline caps the choice
// (tests use it to run the narrower kernels). Each clone exists for float32, bfloat16, float16
// and int8 rows; 16-bit and int8 rows are widened to float32 as they are loaded (int8: the rows'
// scales folded into the shrink scale, v[t, j] = scale_j * sA_j * sB_j * x[t] . qA_j, and a
// DoRA row's scale applied as D is loaded); the baseline clone widens the rows of segments of
// 8+ rows (prefill) once per call into aligned scratch instead (lora_sgmv_plan.h).
// Accumulation: float32. A decode group asks for the rows it reads next a few lines at a time
// as it computes (lora_sgmv_read_ahead.h).
#pragma once

#include "common/parallel_for.h"
#include "lora_sgmv/lora_sgmv_types.h"

namespace ort_lora {

// SgmvProblem and SgmvSegment (the rows, segments and row pointers): lora_sgmv_types.h.

// Computes problem.y_out; the passes' items run on parallel_for (the op's: ORT's pool).
void LoraSgmvCpu(const SgmvProblem& problem, const ParallelFor& parallel_for);

}  // namespace ort_lora
