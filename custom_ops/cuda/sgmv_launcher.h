// LoraSGMV CUDA launcher (float16 / bfloat16, float32 accumulation). No ONNX Runtime types:
// the op (lora_sgmv_cuda_op.cc) and the C entries (cuda_runtime_c.cc, emu/) build an SgmvPlan on
// the host (sgmv_plan.h), upload it, and call LaunchLoraSgmv on a stream (RunLoraSgmv).
//
// The plan on the device is the same for every layer of one module in one step: row tiles (a
// segment's terms: adapter slots and weights, no rank or pointer) and the step's tables
// (a/b_offsets, dora_offsets, ranks, scales). A launch adds the layer: the kernels read rank and
// scale at [layer, slot] and resolve a row's pool offset o to key_cache + o (o < half) or
// value_cache + (o - half) of that layer.
//
// Punica-style split in two passes over row tiles (<= kTileRows rows of ONE segment each). A
// tile's v columns are its terms' ranks at the layer back to back (column c: term i, row j of
// that term's A, when c = the ranks of terms < i, plus j):
//   shrink  v[t, c]  = w_i scale_i x[t] . A_j         float32 scratch [num_rows, v_stride]
//             SGMV tiles (> kBgmvMaxRows rows): one block per (tile, 16 columns), x and A
//               staged through shared memory in chunks of kChunk columns;
//             BGMV tiles (decode rows): one warp per (tile, column c), a gathered dot product.
//   expand  y_out[t] += sum_c v[t, c] Bt_c            one block per (tile, 256 outputs); each
//             thread owns one output column and all rows of the tile, so every Bt element is
//             read once per tile (for a one-row tile this is a gather matrix-vector product).
//             A DoRA tile (one term, whose slot has dora_offsets >= 0) then scales:
//             y_out[t] = (y[t] + delta[t]) * (1 + D), D the slot's DoRA row.
// y_out must already hold y (RunLoraSgmv copies it first unless y_out is y). A tile whose terms
// have rank 0 at the layer does nothing; ranks may differ between tiles and terms.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace ort_lora {

constexpr int kTileRows = 16;      // rows per tile
constexpr int kBgmvMaxRows = 4;    // tiles of at most this many rows take the BGMV shrink
constexpr int kMaxCudaRank = 512;  // expand keeps v[kTileRows, a tile's rank] in shared memory

enum class SgmvDtype : int { kFloat16 = 0, kBFloat16 = 1 };

// One adapter of a segment: rank and scale at [layer, slot] of the plan's tables.
struct SgmvTerm {
  int32_t slot;  // 0..num_slots-1
  float weight;  // 1 for the segment's seg_slots adapter, else its comp_weights entry
};

// One tile: rows [row_begin, row_begin + num_rows) of one segment, and the segment's terms.
struct SgmvTile {
  int32_t row_begin;
  int32_t num_rows;    // 1..kTileRows
  int32_t term_begin;  // its terms: [term_begin, term_begin + num_terms) of the plan's terms
  int32_t num_terms;   // >= 1
};

// One launch: device pointers, the layer's pool share, and the dims of the plan's tables.
// tiles[0, num_sgmv_tiles) take the SGMV shrink, the rest (num_bgmv_tiles) the BGMV shrink;
// the expand covers all of them.
struct SgmvArgs {
  const void* x;            // T [num_rows, in]
  void* y_out;              // T [num_rows, out], holds y on entry
  float* v;                 // float [num_rows, v_stride] scratch
  const void* key_cache;    // T: pool elements [0, half) of the layer
  const void* value_cache;  // T: pool elements [half, 2 half)
  int64_t half;
  const SgmvTile* tiles;        // [num_sgmv_tiles + num_bgmv_tiles]          (the plan)
  const SgmvTerm* terms;        // the tiles' terms
  const int64_t* a_offsets;     // [num_slots, max_rank] pool element of A row j
  const int64_t* b_offsets;     // [num_slots, max_rank] pool element of B^T row j
  const int64_t* dora_offsets;  // [num_slots] pool element of the DoRA row (-1: none), or null
  const int32_t* ranks;         // [num_layers, num_slots]
  const float* scales;          // [num_layers, num_slots]
  int64_t in_features;
  int64_t out_features;
  int32_t layer;
  int32_t num_slots;
  int32_t max_rank;  // a_offsets.shape[1]
  int32_t v_stride;  // >= every tile's rank at `layer`: its terms' (sizes the shrink grids)
  int32_t num_sgmv_tiles;
  int32_t num_bgmv_tiles;
};

// Enqueues the shrink and expand kernels on `stream`; returns the first launch error.
cudaError_t LaunchLoraSgmv(SgmvDtype dtype, const SgmvArgs& args, cudaStream_t stream);

}  // namespace ort_lora
