#include "paged_attention/paged_attention_op.h"

#include <cmath>

namespace ort_lora {

namespace {
template <typename T>
T AttrOr(const Ort::ConstKernelInfo& ki, const char* name, T fallback) {
  try {
    return ki.GetAttribute<T>(name);
  } catch (const Ort::Exception&) {
    return fallback;
  }
}
}  // namespace

PagedAttentionKernel::PagedAttentionKernel(const OrtApi&, const OrtKernelInfo* info) {
  Ort::ConstKernelInfo ki(info);
  num_heads_ = ki.GetAttribute<int64_t>("num_heads");
  kv_num_heads_ = ki.GetAttribute<int64_t>("kv_num_heads");
  scale_ = AttrOr<float>(ki, "scale", 0.0f);
  do_rotary_ = AttrOr<int64_t>(ki, "do_rotary", 0);
  rotary_interleaved_ = AttrOr<int64_t>(ki, "rotary_interleaved", 0);
  local_window_size_ = AttrOr<int64_t>(ki, "local_window_size", -1);
  softcap_ = AttrOr<float>(ki, "softcap", 0.0f);
  if (num_heads_ <= 0 || kv_num_heads_ <= 0 || num_heads_ % kv_num_heads_ != 0)
    Fail("num_heads (", num_heads_, ") must be a positive multiple of kv_num_heads (",
         kv_num_heads_, ")");
}

OrtStatusPtr PagedAttentionKernel::ComputeV2(OrtKernelContext* context) {
  return GuardCompute("PagedAttention", [&] { Compute(context); });
}

void PagedAttentionKernel::Compute(OrtKernelContext*) { Fail("not implemented yet"); }

OrtStatusPtr PagedAttentionOp::CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info,
                                              void** kernel) const {
  return GuardCompute("PagedAttention", [&] { *kernel = new PagedAttentionKernel(api, info); });
}

ONNXTensorElementDataType PagedAttentionOp::GetInputType(size_t index) const {
  return (index >= 5 && index <= 7) || index == 10 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32
                                                   : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}

OrtCustomOpInputOutputCharacteristic PagedAttentionOp::GetInputCharacteristic(size_t index) const {
  return index >= 8 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
}

}  // namespace ort_lora
