// Host side of the CUDA LoraSGMV: validates the (host-resident) LoRA metadata and turns it into
// a compact launch plan (row tiles + pool row pointers), then uploads and launches it
// (RunLoraSgmv, in sgmv_run.cc: the only part that calls the CUDA runtime).
// No ONNX Runtime types: used by the op (lora_sgmv_cuda_op.cc) and the C test entry
// (cuda_runtime_c.cc). Bad metadata throws std::invalid_argument naming the input.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cuda/sgmv_launcher.h"

namespace ort_lora {

// The host-resident LoRA inputs of one call, as LoraSGMV defines them (lora_sgmv_op.h).
struct SgmvHostInputs {
  const int32_t* seg_starts;  // [S + 1]
  const int32_t* seg_slots;   // [S]
  const int64_t* a_offsets;   // [num_slots, max_rank]
  const int64_t* b_offsets;   // [num_slots, max_rank]
  const int32_t* ranks;       // [num_layers, num_slots]
  const float* scales;        // [num_layers, num_slots]
  int64_t num_segments, num_slots, max_rank, num_layers, layer;
  int64_t num_rows, in_features, out_features;
  // The layer's pool share: key_cache (elements [0, half)) then value_cache ([half, 2 half)).
  const void* key_cache;
  const void* value_cache;
  int64_t half;
  int64_t elem_size;  // bytes per element (2)
};

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

// Validates the inputs (seg_starts monotonic 0..T, slots, ranks, every used row inside one
// pool half) and builds the plan. Throws std::invalid_argument naming the bad input.
SgmvPlan BuildSgmvPlan(const SgmvHostInputs& in);

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
#define ORT_LORA_SGMV_C_INPUTS                                                                  \
  ort_lora::SgmvHostInputs{seg_starts,   seg_slots,    a_offsets, b_offsets,   ranks, scales,   \
                           num_segments, num_slots,    max_rank,  num_layers,  layer, num_rows, \
                           in_features,  out_features, key_cache, value_cache, half,  2}

// The C entries' front half: checks dtype and builds the plan. Returns "" or the message.
std::string PlanForCEntry(int dtype, const SgmvHostInputs& in, SgmvPlan& plan);

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
