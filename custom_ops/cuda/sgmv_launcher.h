// LoraSGMV CUDA launcher (float16 / bfloat16, float32 accumulation). No ONNX Runtime types:
// the op (lora_sgmv_cuda_op.cc) and the C test entry (cuda_runtime_c.cc) build an SgmvPlan on
// the host (sgmv_plan.h), upload it, and call LaunchLoraSgmv on a stream.
//
// Punica-style split in two passes over row tiles (<= kTileRows rows of ONE segment each):
//   shrink  v[t, j]  = x[t] . A_j                      float32 scratch [num_rows, v_stride]
//             SGMV tiles (> kBgmvMaxRows rows): one block per (tile, 16 ranks), x and A
//               staged through shared memory in chunks of kChunk columns;
//             BGMV tiles (decode rows): one warp per (tile, rank j), a gathered dot product.
//   expand  y_out[t] += scale * sum_j v[t, j] Bt_j   one block per (tile, 256 outputs); each
//             thread owns one output column and all rows of the tile, so every Bt element is
//             read once per tile (for a one-row tile this is a gather matrix-vector product).
// y_out must already hold y (RunLoraSgmv copies it first). Ranks may differ between tiles.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace ort_lora {

constexpr int kTileRows = 16;      // rows per tile
constexpr int kBgmvMaxRows = 4;    // tiles of at most this many rows take the BGMV shrink
constexpr int kMaxCudaRank = 512;  // the expand kernel keeps v[kTileRows, rank] in shared memory

enum class SgmvDtype : int { kFloat16 = 0, kBFloat16 = 1 };

// One tile: rows [row_begin, row_begin + num_rows) of one segment, and its adapter.
struct SgmvTile {
  int32_t row_begin;
  int32_t num_rows;    // 1..kTileRows
  int32_t rank;        // 1..kMaxCudaRank
  int32_t rows_index;  // A row pointers at row_ptrs[rows_index, + rank), B^T rows after them
  float scale;
};

// Device pointers of one launch. tiles[0, num_sgmv_tiles) take the SGMV shrink, the rest
// (num_bgmv_tiles) the BGMV shrink; the expand covers all of them.
struct SgmvArgs {
  const void* x;                // T [num_rows, in]
  void* y_out;                  // T [num_rows, out], holds y on entry
  float* v;                     // float [num_rows, v_stride] scratch
  const SgmvTile* tiles;        // [num_sgmv_tiles + num_bgmv_tiles]
  const void* const* row_ptrs;  // rows of A (in elements) and B^T (out elements) in the pool
  int64_t in_features;
  int64_t out_features;
  int32_t v_stride;  // >= the largest rank of any tile
  int32_t max_rank;  // the largest rank of any tile
  int32_t num_sgmv_tiles;
  int32_t num_bgmv_tiles;
};

// Enqueues the shrink and expand kernels on `stream`; returns the first launch error.
cudaError_t LaunchLoraSgmv(SgmvDtype dtype, const SgmvArgs& args, cudaStream_t stream);

}  // namespace ort_lora
