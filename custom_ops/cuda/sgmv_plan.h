// Host side of the CUDA LoraSGMV: validates the (host-resident) LoRA metadata
// (lora_sgmv/lora_sgmv_checks.h, the checks the CPU op runs too) and turns it into a launch plan
// (row tiles + the step's tables), then uploads and launches it (RunLoraSgmv, in sgmv_run.cc:
// the only part that calls the CUDA runtime).
// No ONNX Runtime types: used by the op (lora_sgmv_cuda_op.cc) and the C entries
// (cuda_runtime_c.cc, emu/emu_sgmv_c.cc). Bad metadata throws InputError (common/errors.h)
// naming the input.
//
// The uploaded part of a plan (Serialize) depends on the metadata inputs alone, never on the
// layer or the pool, so every layer of one module in one step uploads the same bytes:
// RunLoraSgmv uploads them once and the other layers reuse the copy on the device.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/sgmv_launcher.h"
#include "lora_sgmv/lora_sgmv_checks.h"

namespace ort_lora {

// A launch plan for one call (one layer).
struct SgmvPlan {
  SgmvMetadata meta;            // the host tables the plan points into (valid for the call)
  std::vector<SgmvTerm> terms;  // every segment's terms (ListSgmvTerms), segment by segment
  std::vector<SgmvTile> tiles;  // every segment with a term and rows: SGMV tiles, then BGMV
  int32_t num_sgmv_tiles = 0;
  int32_t layer_max_rank = 0;  // the largest rank at meta.layer of any tile; 0: nothing to add

  // Where each part lies in the uploaded bytes (8-aligned, offsets first so that the plans of
  // different modules differ early). dora_offsets is empty when meta has none.
  struct Layout {
    size_t a_offsets, b_offsets, dora_offsets, ranks, scales, terms, tiles, bytes;
  };
  Layout GetLayout() const;
  // The bytes to upload: a_offsets, b_offsets, dora_offsets, ranks, scales, terms, tiles
  // (Layout). Reuses `out`.
  void Serialize(std::vector<uint8_t>& out) const;
  // Device scratch for v: float [num_rows, layer_max_rank].
  size_t VBytes() const;
};

// Validates the metadata (the layer, x's rows < 2^31, then CheckSgmvSegments at meta.layer with
// the rank limit kMaxCudaRank) and builds the plan. `pool` holds device addresses, elem_size 2,
// rows of the pool's own element type. Throws InputError naming the bad input.
SgmvPlan BuildSgmvPlan(const SgmvMetadata& meta, const SgmvPool& pool);

// The launch arguments of a plan whose bytes (Serialize) lie at `device_plan`.
SgmvArgs PlanArgs(const SgmvPlan& plan, const void* device_plan, float* v, const SgmvPool& pool,
                  const void* x, void* y_out);

// A failed CUDA runtime call inside RunLoraSgmv: what() names the call and CUDA's error.
struct CudaCallError : std::runtime_error {
  CudaCallError(const std::string& message, cudaError_t code)
      : std::runtime_error(message), code(code) {}
  cudaError_t code;
};

// sgmv_run.cc (CUDA runtime), all on `stream`: copies y to y_out (unless y_out is y: the op
// may run in place), uploads the plan's bytes unless this stream already holds an identical
// upload, and launches the kernels. Per stream it keeps the last uploads (pinned host copy,
// device copy, the event of the copy: a slot is rewritten only after that event fired, and
// only by work queued behind every kernel that read it) and the v scratch, grown stream-ordered
// (cudaMallocAsync / cudaFreeAsync on `stream`). A null stream is refused: the legacy default
// stream is not ordered with ORT's compute stream. Throws InputError (null stream) or
// CudaCallError.
void RunLoraSgmv(SgmvDtype dtype, const SgmvPlan& plan, const SgmvPool& pool, const void* x,
                 const void* y, void* y_out, cudaStream_t stream);

// RunLoraSgmv up to the launch: the y copy and the upload are queued on `stream`; returns the
// launch arguments (zeros when plan.layer_max_rank is 0: nothing to launch). For the kernel
// timing in cuda_runtime_c.cc, which launches them alone.
SgmvArgs PrepareLoraSgmv(const SgmvPlan& plan, const SgmvPool& pool, const void* x, const void* y,
                         void* y_out, cudaStream_t stream);

// Frees what RunLoraSgmv keeps for `stream` (after synchronizing it); call before destroying a
// stream that ran LoraSGMV. A stream never used is a no-op. Returns the first CUDA error.
cudaError_t ReleaseSgmvStream(cudaStream_t stream);

// Counters of RunLoraSgmv in this process (tests, bench/gpu_check.py): plans uploaded, plans
// found already on the device, uploads that had to wait for an earlier copy out of their
// pinned slot, y -> y_out copies (calls not run in place).
struct SgmvStats {
  uint64_t uploads, reused, host_waits, y_copies;
};
SgmvStats GetSgmvStats();

// The C entries ort_lora_cuda_sgmv (cuda_runtime_c.cc) and ort_lora_emu_sgmv (emu/) share
// their arguments (one Python helper builds both): dtype (0 float16, 1 bfloat16), x, y, y_out,
// the layer's key_cache / value_cache (`half` elements each), the metadata laid out as in the
// op (comp_* null when num_comp is 0; dora_offsets null: no DoRA rows), then the stream.
#define ORT_LORA_SGMV_C_PARAMS                                                                     \
  int dtype, const void *x, const void *y, void *y_out, const void *key_cache,                     \
      const void *value_cache, int64_t half, const int32_t *seg_starts, const int32_t *seg_slots,  \
      int64_t num_segments, const int64_t *a_offsets, const int64_t *b_offsets, int64_t num_slots, \
      int64_t max_rank, const int32_t *ranks, const float *scales, int64_t num_layers,             \
      int64_t layer, int64_t num_rows, int64_t in_features, int64_t out_features,                  \
      const int32_t *comp_segs, const int32_t *comp_slots, const float *comp_weights,              \
      int64_t num_comp, const int64_t *dora_offsets, void *stream
// Inside a C entry: its pool, its metadata, all its arguments as SgmvCEntry takes them, and
// all of them as ORT_LORA_SGMV_C_PARAMS declares them (to call another entry).
#define ORT_LORA_SGMV_C_POOL \
  (ort_lora::SgmvPool{key_cache, value_cache, half, 2, ort_lora::SgmvRowLayout::kPoolType})
#define ORT_LORA_SGMV_C_META                                                              \
  (ort_lora::SgmvMetadata{seg_starts, seg_slots, a_offsets, b_offsets, ranks, scales,     \
                          num_segments, num_slots, max_rank, num_layers, layer, num_rows, \
                          in_features, out_features, comp_segs, comp_slots, comp_weights, \
                          num_comp, dora_offsets})
#define ORT_LORA_SGMV_C_ARGS \
  dtype, x, y, y_out, ORT_LORA_SGMV_C_POOL, ORT_LORA_SGMV_C_META, static_cast<cudaStream_t>(stream)
#define ORT_LORA_SGMV_C_FORWARD                                                               \
  dtype, x, y, y_out, key_cache, value_cache, half, seg_starts, seg_slots, num_segments,      \
      a_offsets, b_offsets, num_slots, max_rank, ranks, scales, num_layers, layer, num_rows,  \
      in_features, out_features, comp_segs, comp_slots, comp_weights, num_comp, dora_offsets, \
      stream

// The C entries' body: checks dtype, plans, runs. Returns 0, -1 (invalid input: message) or
// the cudaError_t of a failed CUDA call (message names the call).
int SgmvCEntry(int dtype, const void* x, const void* y, void* y_out, const SgmvPool& pool,
               const SgmvMetadata& meta, cudaStream_t stream, std::string& message);

}  // namespace ort_lora
