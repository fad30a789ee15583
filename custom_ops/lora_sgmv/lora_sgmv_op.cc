#include "lora_sgmv/lora_sgmv_op.h"

namespace ort_lora {

LoraSgmvKernel::LoraSgmvKernel(const OrtApi&, const OrtKernelInfo* info) {
  Ort::ConstKernelInfo ki(info);
  layer_ = ki.GetAttribute<int64_t>("layer");
}

OrtStatusPtr LoraSgmvKernel::ComputeV2(OrtKernelContext* context) {
  return GuardCompute("LoraSGMV", [&] { Compute(context); });
}

void LoraSgmvKernel::Compute(OrtKernelContext*) { Fail("not implemented yet"); }

OrtStatusPtr LoraSgmvOp::CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info,
                                        void** kernel) const {
  return GuardCompute("LoraSGMV", [&] { *kernel = new LoraSgmvKernel(api, info); });
}

ONNXTensorElementDataType LoraSgmvOp::GetInputType(size_t index) const {
  switch (index) {
    case 4:
    case 5:
    case 8:
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    case 6:
    case 7:
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    default:
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
}

}  // namespace ort_lora
