// PagedAttention (domain ort_lora, CPU, float32): the contract of ONNX Runtime's
// com.microsoft.PagedAttention (which ships for CUDA only), so one graph serves both providers.
//
// Inputs
//    0 query        float [T, num_heads * head_size]
//    1 key          float [T, kv_num_heads * head_size]
//    2 value        float [T, kv_num_heads * head_size]
//    3 key_cache    float [num_blocks, block_size, kv_num_heads, head_size]  written in place
//    4 value_cache  float [num_blocks, block_size, kv_num_heads, head_size]  written in place
//    5 cumulative_sequence_length int32 [B + 1]
//    6 past_seqlens int32 [B]
//    7 block_table  int32 [B, max_blocks_per_sequence]
//    8 cos_cache    float [max_seqlen, rotary_dim / 2]  optional; required with do_rotary
//    9 sin_cache    float [max_seqlen, rotary_dim / 2]  optional; required with do_rotary
//   10 slot_mapping int32 [T]  optional; -1 skips the write
// Outputs
//    0 output          float [T, num_heads * head_size]
//    1 key_cache_out   optional in the schema; this kernel updates the cache in place and
//    2 value_cache_out fails if the node asks for these
// Attributes: num_heads, kv_num_heads, scale, do_rotary, rotary_interleaved,
//             local_window_size, softcap.
// Semantics: ort_lora/ops/paged_attention_ref.py. Kernel: paged_attention_cpu.h.
#pragma once

#include <vector>

#include "common/ort_common.h"
#include "paged_attention/paged_attention_cpu.h"

namespace ort_lora {

struct PagedAttentionKernel {
  PagedAttentionKernel(const OrtApi& api, const OrtKernelInfo* info);
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

 private:
  void Compute(OrtKernelContext* context);
  PagedAttentionArgs CheckShapes(const InputView* in) const;  // in: kNumInputs of them
  void CheckRotaryShapes(const InputView* in, PagedAttentionArgs& a) const;
  int64_t num_heads_;
  int64_t kv_num_heads_;
  float scale_;
  int64_t do_rotary_;
  int64_t rotary_interleaved_;
  int64_t local_window_size_;
  float softcap_;
};

struct PagedAttentionOp : Ort::CustomOpBase<PagedAttentionOp, PagedAttentionKernel, true> {
  // output is like query: known shapes downstream let ORT run LoraSGMV in place
  PagedAttentionOp() { OutputLikeInput<0>(*this); }
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const;
  const char* GetName() const { return "PagedAttention"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 11; }
  ONNXTensorElementDataType GetInputType(size_t index) const;
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const;
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t) const {
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t index) const {
    return index == 0 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }
};

}  // namespace ort_lora
