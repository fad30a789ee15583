#include "lora_sgmv/lora_sgmv_op.h"

#include "lora_sgmv/lora_sgmv_cpu.h"
#include "lora_sgmv/lora_sgmv_inputs.h"

namespace ort_lora {

namespace {

constexpr int64_t kMaxRank = 512;
constexpr SgmvRankLimit kRankLimit{kMaxRank, "a rank over the limit"};

// The kernel's segments: the active ones of a checked call, pointing into its `rows`.
void AddSegments(const std::vector<SgmvActiveSegment>& active, const std::vector<const void*>& rows,
                 SgmvProblem& problem) {
  for (const SgmvActiveSegment& a : active) {
    const void* const* base = rows.data() + a.rows;
    problem.segments.push_back({a.row_begin, a.row_end, a.rank, a.scale, base, base + a.rank});
  }
}

}  // namespace

LoraSgmvKernel::LoraSgmvKernel(const OrtApi&, const OrtKernelInfo* info) {
  Ort::ConstKernelInfo ki(info);
  layer_ = ki.GetAttribute<int64_t>("layer");
  if (layer_ < 0) Fail("attribute 'layer' must be >= 0, got ", layer_);
  const int64_t dtype = ReadAdapterDtype(ki, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
  if (dtype != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT &&
      dtype != ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16)
    Fail("attribute 'adapter_dtype' = ", dtype,
         " is not supported by the CPU op: it must be 1 (FLOAT, float32 rows) or 16 (BFLOAT16, "
         "bfloat16 rows in the float32 pool)");
  bf16_rows_ = dtype == ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
}

OrtStatusPtr LoraSgmvKernel::ComputeV2(OrtKernelContext* context) {
  return GuardCompute("LoraSGMV", [&] { Compute(context); });
}

void LoraSgmvKernel::Compute(OrtKernelContext* context) {
  Ort::KernelContext ctx(context);
  const LoraSgmvInputs in = ReadLoraSgmvInputs(ctx, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
  const SgmvMetadata meta = ReadSgmvMetadata(in, layer_);
  CheckSgmvLayer(meta);
  std::vector<const void*> rows;  // the used slots' row pointers; problem.segments point here
  const std::vector<SgmvActiveSegment> active =
      CheckSgmvSegments(meta, ReadSgmvPool(in, sizeof(float), bf16_rows_), kRankLimit, rows);
  SgmvProblem problem{in.x.value.GetTensorData<float>(),
                      in.y.value.GetTensorData<float>(),
                      nullptr,
                      meta.num_rows,
                      meta.in_features,
                      meta.out_features,
                      bf16_rows_ ? SgmvRowType::kBFloat16 : SgmvRowType::kFloat32,
                      {}};
  AddSegments(active, rows, problem);
  problem.y_out = ctx.GetOutput(0, in.y.shape).GetTensorMutableData<float>();
  LoraSgmvCpu(problem, OrtParallelFor(ctx));
}

OrtStatusPtr LoraSgmvOp::CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info,
                                        void** kernel) const {
  return GuardCompute("LoraSGMV", [&] { *kernel = new LoraSgmvKernel(api, info); });
}

ONNXTensorElementDataType LoraSgmvOp::GetInputType(size_t index) const {
  switch (index) {
    case kSegStarts:
    case kSegSlots:
    case kRanks:
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    case kAOffsets:
    case kBOffsets:
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    default:
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
}

}  // namespace ort_lora
