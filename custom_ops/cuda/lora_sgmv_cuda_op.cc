#include "cuda/lora_sgmv_cuda_op.h"

#include <cuda_runtime_api.h>

#include <memory>

#include "cuda/sgmv_plan.h"
#include "lora_sgmv/lora_sgmv_inputs.h"

namespace ort_lora {

namespace {

constexpr auto kFloat = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto kInt32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
constexpr auto kInt64 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;

ONNXTensorElementDataType ToOnnx(SgmvDtype dtype) {
  return dtype == SgmvDtype::kFloat16 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16
                                      : ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
}

// Device scratch from the session's CUDA allocator, returned to it when Compute ends. The
// allocator handle KernelContext_GetAllocator gives out is a new wrapper object owned by the
// caller (ORT's C API: release it with ReleaseAllocator), so it is released here too.
struct Scratch {
  OrtAllocator* allocator = nullptr;
  void* ptr = nullptr;
  ~Scratch() {
    if (ptr != nullptr) allocator->Free(allocator, ptr);
    if (allocator != nullptr) Ort::GetApi().ReleaseAllocator(allocator);
  }
};

void AllocScratch(const Ort::KernelContext& ctx, int device, size_t bytes, Scratch& s) {
  Ort::MemoryInfo info("Cuda", OrtDeviceAllocator, device, OrtMemTypeDefault);
  s.allocator = ctx.GetAllocator(*info);
  if (s.allocator == nullptr) Fail("no CUDA allocator for device ", device, " in this session");
  s.ptr = s.allocator->Alloc(s.allocator, bytes);
  if (s.ptr == nullptr) Fail("could not allocate ", bytes, " bytes of CUDA scratch");
}

}  // namespace

LoraSgmvCudaKernel::LoraSgmvCudaKernel(const OrtKernelInfo* info, SgmvDtype dtype) : dtype_(dtype) {
  Ort::ConstKernelInfo ki(info);
  layer_ = ki.GetAttribute<int64_t>("layer");
  if (layer_ < 0) Fail("attribute 'layer' must be >= 0, got ", layer_);
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
  const LoraSgmvInputs in = ReadLoraSgmvInputs(ctx, ToOnnx(dtype_));
  const SgmvPlan plan =
      BuildSgmvPlan(ReadSgmvMetadata(in, layer_), ReadSgmvPool(in, 2, /*bf16_rows=*/false));
  auto y_out = ctx.GetOutput(0, in.y.shape);
  const int64_t num_rows = in.y.shape[0];
  auto stream = static_cast<cudaStream_t>(ctx.GetGPUComputeStream());
  Scratch scratch;
  if (!plan.tiles.empty()) {
    const int device = in.x.value.GetTensorMemoryInfo().GetDeviceId();
    AllocScratch(ctx, device, plan.ScratchBytes(num_rows), scratch);
  }
  const cudaError_t err = RunLoraSgmv(
      dtype_, plan, in.x.value.GetTensorRawData(), in.y.value.GetTensorRawData(),
      y_out.GetTensorMutableRawData(), num_rows, in.x.shape[1], in.y.shape[1], scratch.ptr, stream);
  if (err != cudaSuccess)
    throw Ort::Exception(
        std::string("CUDA error ") + cudaGetErrorName(err) + ": " + cudaGetErrorString(err),
        ORT_EP_FAIL);
}

OrtStatusPtr LoraSgmvCudaOp::CreateKernelV2(const OrtApi&, const OrtKernelInfo* info,
                                            void** kernel) const {
  return GuardCompute("LoraSGMV(CUDA)", [&] { *kernel = new LoraSgmvCudaKernel(info, dtype_); });
}

ONNXTensorElementDataType LoraSgmvCudaOp::ElementType() const { return ToOnnx(dtype_); }

ONNXTensorElementDataType LoraSgmvCudaOp::GetInputType(size_t index) const {
  switch (index) {
    case kSegStarts:
    case kSegSlots:
    case kRanks:
      return kInt32;
    case kAOffsets:
    case kBOffsets:
      return kInt64;
    case kScales:
      return kFloat;
    default:
      return ElementType();
  }
}

OrtMemType LoraSgmvCudaOp::GetInputMemoryType(size_t index) const {
  return index >= kSegStarts ? OrtMemTypeCPUInput : OrtMemTypeDefault;
}

}  // namespace ort_lora
