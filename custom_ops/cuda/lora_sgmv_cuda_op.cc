#include "cuda/lora_sgmv_cuda_op.h"

#include <cuda_runtime_api.h>

#include "cuda/sgmv_plan.h"
#include "lora_sgmv/lora_sgmv_inputs.h"

namespace ort_lora {

namespace {

ONNXTensorElementDataType ToOnnx(SgmvDtype dtype) {
  return dtype == SgmvDtype::kFloat16 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16
                                      : ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
}

}  // namespace

LoraSgmvCudaKernel::LoraSgmvCudaKernel(const OrtKernelInfo* info, SgmvDtype dtype) : dtype_(dtype) {
  Ort::ConstKernelInfo ki(info);
  layer_ = ki.GetAttribute<int64_t>("layer");
  if (layer_ < 0) Fail("attribute 'layer' must be >= 0, got ", layer_);
  const int64_t modules = AttrOr<int64_t>(ki, "modules", 1);
  if (modules != 1)
    Fail("attribute 'modules' = ", modules,
         " is not supported by the CUDA op: it takes one module (1 or absent)");
  // Rows are always the pool's own element type here (no packed bfloat16 in a float pool).
  const int64_t adapter_dtype = ReadAdapterDtype(ki, ToOnnx(dtype));
  if (adapter_dtype != ToOnnx(dtype))
    Fail("attribute 'adapter_dtype' = ", adapter_dtype, " is not supported by the CUDA op for ",
         TypeName(ToOnnx(dtype)), ": it must be ", static_cast<int>(ToOnnx(dtype)),
         " (the pool's element type) or absent");
}

OrtStatusPtr LoraSgmvCudaKernel::ComputeV2(OrtKernelContext* context) {
  return GuardCompute("LoraSGMV(CUDA)", [&] { Compute(context); });
}

void LoraSgmvCudaKernel::Compute(OrtKernelContext* context) {
  Ort::KernelContext ctx(context);
  if (ctx.GetInputCount() > kNumLoraSgmvInputs || ctx.GetOutputCount() != 1)
    Fail("the node has ", ctx.GetInputCount(), " inputs and ", ctx.GetOutputCount(),
         " outputs; the CUDA op takes one module: at most ", kNumLoraSgmvInputs,
         " inputs and 1 output");
  const LoraSgmvInputs in = ReadLoraSgmvInputs(ctx, ToOnnx(dtype_));
  const SgmvPool pool = ReadSgmvPool(in, 2, SgmvRowLayout::kPoolType);
  const SgmvPlan plan = BuildSgmvPlan(ReadSgmvMetadata(in, layer_), pool);
  auto y_out = ctx.GetOutput(0, in.y.shape.data(), in.y.shape.size());
  // RunLoraSgmv refuses a null stream (InputError naming it).
  auto stream = static_cast<cudaStream_t>(ctx.GetGPUComputeStream());
  try {
    RunLoraSgmv(dtype_, plan, pool, in.x.value.GetTensorRawData(), in.y.value.GetTensorRawData(),
                y_out.GetTensorMutableRawData(), stream);
  } catch (const CudaCallError& e) {
    throw Ort::Exception(e.what(), ORT_EP_FAIL);
  }
}

LoraSgmvCudaOp::LoraSgmvCudaOp(SgmvDtype dtype) : dtype_(dtype) {
  // y_out may reuse y's buffer (the MatMul output, read by nothing else); ORT decides.
  MayWriteOutputOverInput<kY>(*this);
}

OrtStatusPtr LoraSgmvCudaOp::CreateKernelV2(const OrtApi&, const OrtKernelInfo* info,
                                            void** kernel) const {
  return GuardCompute("LoraSGMV(CUDA)", [&] { *kernel = new LoraSgmvCudaKernel(info, dtype_); });
}

ONNXTensorElementDataType LoraSgmvCudaOp::ElementType() const { return ToOnnx(dtype_); }

OrtMemType LoraSgmvCudaOp::GetInputMemoryType(size_t index) const {
  return index >= kSegStarts && !IsLoraSgmvY(index) ? OrtMemTypeCPUInput : OrtMemTypeDefault;
}

}  // namespace ort_lora
