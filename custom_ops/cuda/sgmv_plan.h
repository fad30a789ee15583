// Host side of the CUDA LoraSGMV: validates the (host-resident) LoRA metadata
// (lora_sgmv/lora_sgmv_checks.h, the checks the CPU op runs too) and turns it into a compact
// launch plan (row tiles + pool row pointers), then uploads and launches it (RunLoraSgmv, in
// sgmv_run.cc: the only part that calls the CUDA runtime).
// No ONNX Runtime types: used by the op (lora_sgmv_cuda_op.cc) and the C test entry
// (cuda_runtime_c.cc). Bad metadata throws InputError (common/errors.h) naming the input.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cuda/sgmv_launcher.h"
#include "lora_sgmv/lora_sgmv_checks.h"

namespace ort_lora {

// A launch plan: tiles (SGMV tiles first, then BGMV tiles) and the pool row pointers.
struct SgmvPlan {
  std::vector<SgmvTile> tiles;
  std::vector<const void*> row_ptrs;
  int32_t num_sgmv_tiles = 0;
  int32_t max_rank = 0;

  // One buffer to upload: tiles, then (8-aligned) row pointers.
  std::vector<uint8_t> Serialize() const;
  size_t RowPtrsOffset() const;
  // Device scratch: the serialized plan (256-aligned), then v float [num_rows, max_rank].
  size_t ScratchBytes(int64_t num_rows) const;
};

// Validates the metadata (the layer, x's rows < 2^31, then CheckSgmvSegments with the rank limit
// kMaxCudaRank) and builds the plan. `pool` holds device addresses, elem_size 2, rows of the
// pool's own element type. Throws InputError naming the bad input.
SgmvPlan BuildSgmvPlan(const SgmvMetadata& meta, const SgmvPool& pool);

// The C entries ort_lora_cuda_sgmv (cuda_runtime_c.cc) and ort_lora_emu_sgmv (emu/) share
// their arguments (the CUDA one adds a stream after them; one Python helper builds both):
// dtype (0 float16, 1 bfloat16), x, y, y_out, the layer's key_cache / value_cache (`half`
// elements each), then the metadata laid out as in the op.
#define ORT_LORA_SGMV_C_PARAMS                                                                     \
  int dtype, const void *x, const void *y, void *y_out, const void *key_cache,                     \
      const void *value_cache, int64_t half, const int32_t *seg_starts, const int32_t *seg_slots,  \
      int64_t num_segments, const int64_t *a_offsets, const int64_t *b_offsets, int64_t num_slots, \
      int64_t max_rank, const int32_t *ranks, const float *scales, int64_t num_layers,             \
      int64_t layer, int64_t num_rows, int64_t in_features, int64_t out_features
// The C entries' arguments as the metadata and the pool share (float16 / bfloat16 elements).
#define ORT_LORA_SGMV_C_METADATA                                                          \
  (ort_lora::SgmvMetadata{seg_starts, seg_slots, a_offsets, b_offsets, ranks, scales,     \
                          num_segments, num_slots, max_rank, num_layers, layer, num_rows, \
                          in_features, out_features})
#define ORT_LORA_SGMV_C_POOL (ort_lora::SgmvPool{key_cache, value_cache, half, 2, false})

// The C entries' front half: checks dtype and builds the plan. Returns "" or the message.
std::string PlanForCEntry(int dtype, const SgmvMetadata& meta, const SgmvPool& pool,
                          SgmvPlan& plan);

// The launch arguments for a plan serialized at the start of `scratch` (ScratchBytes bytes):
// tiles, row pointers, then v. scratch is a device address (or host memory in the emulator).
SgmvArgs PlanArgs(const SgmvPlan& plan, void* scratch, const void* x, void* y_out,
                  int64_t in_features, int64_t out_features);

// sgmv_run.cc (CUDA runtime): copies y to y_out, uploads the plan into scratch (device,
// ScratchBytes(num_rows) bytes) from a pinned staging ring (a slot is reused only after the event
// behind its last copy fired), and launches the kernels, all on `stream`. Returns the first CUDA
// error.
cudaError_t RunLoraSgmv(SgmvDtype dtype, const SgmvPlan& plan, const void* x, const void* y,
                        void* y_out, int64_t num_rows, int64_t in_features, int64_t out_features,
                        void* scratch, cudaStream_t stream);

}  // namespace ort_lora
