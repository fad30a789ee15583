// LoraSGMV (domain ort_lora, CPU, float32): the Punica SGMV operator over pool pages.
//
// Semantics (the numpy reference is ort_lora/ops/lora_sgmv_ref.py::lora_sgmv):
//   y_out = y; for each segment s with slot = seg_slots[s] >= 0 and r = ranks[layer, slot] > 0:
//     rows t in [seg_starts[s], seg_starts[s+1]):
//       v[t, j]  = sum_k x[t, k] * A_j[k]              j < r  (shrink)
//       y_out[t] += scales[layer, slot] * sum_j v[t, j] * Bt_j   (expand)
//   where A_j  = region[a_offsets[slot, j] : + in]   (row j of A, r x in)
//         Bt_j = region[b_offsets[slot, j] : + out]  (row j of B^T, r x out)
//   and region is this layer's pool share seen as one flat array: key_cache's elements
//   followed by value_cache's (offset o < numel(key_cache) reads key_cache, else value_cache).
//
// Inputs                                           Output
//   0 y           float [T, out]                      0 y_out float [T, out]
//   1 x           float [T, in]
//   2 key_cache   float [num_pages, block_size, kv_heads, head_dim]
//   3 value_cache float [num_pages, block_size, kv_heads, head_dim]
//   4 seg_starts  int32 [S + 1]   0 = s_0 <= s_1 <= ... <= s_S = T
//   5 seg_slots   int32 [S]       adapter slot of each segment, -1 = base only
//   6 a_offsets   int64 [num_slots, max_rank]
//   7 b_offsets   int64 [num_slots, max_rank]
//   8 ranks       int32 [num_layers, num_slots]   0 <= rank <= max_rank
//   9 scales      float [num_layers, num_slots]
// Attributes:
//   layer (int) selects the row of ranks and scales.
//   adapter_dtype (int, optional; an ONNX TensorProto element type) is the type of the rows:
//     absent or 1 (FLOAT): A_j and Bt_j are float32 pool elements, as above.
//     16 (BFLOAT16): rows are bfloat16 packed two per float32 pool element. The row at pool
//       element o is the region seen as uint16 (little-endian: an element's first bfloat16 is
//       its low 16 bits), bfloat16 elements [2 o, 2 o + len), widened exactly (bits << 16);
//       it spans ceil(len / 2) pool elements, all inside key_cache or inside value_cache (an
//       odd len leaves one padding bfloat16, never read). Accumulation stays float32.
//     Any other value fails at kernel creation, naming the attribute and the allowed values.
// Limits: rank <= 512 (kMaxRank). Bad inputs (shapes, non-monotonic seg_starts, slot or rank
// out of range, a used row outside key_cache / value_cache) fail with an error naming them
// (the checks, shared with the CUDA op: lora_sgmv_checks.h); offsets of rows j >= rank are never
// read. The kernel is lora_sgmv_cpu.h.
#pragma once

#include "common/ort_common.h"

namespace ort_lora {

struct LoraSgmvKernel {
  LoraSgmvKernel(const OrtApi& api, const OrtKernelInfo* info);
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

 private:
  void Compute(OrtKernelContext* context);
  int64_t layer_;
  bool bf16_rows_;  // attribute adapter_dtype = 16
};

struct LoraSgmvOp : Ort::CustomOpBase<LoraSgmvOp, LoraSgmvKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const;
  const char* GetName() const { return "LoraSGMV"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 10; }
  ONNXTensorElementDataType GetInputType(size_t index) const;
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const {
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
};

}  // namespace ort_lora
