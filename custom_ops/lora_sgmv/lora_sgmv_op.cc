#include "lora_sgmv/lora_sgmv_op.h"

#include "lora_sgmv/lora_sgmv_cpu.h"
#include "lora_sgmv/lora_sgmv_inputs.h"

namespace ort_lora {

namespace {

constexpr int64_t kMaxRank = 512;
constexpr SgmvRankLimit kRankLimit{kMaxRank, "a rank over the limit"};

// The kernel's segments: the active ones of a checked call. A segment's A and B^T row pointers
// are its terms' rows back to back (rank = the sum of its terms' ranks), each A row with its
// term's scale * weight; `rows` and `scales` hold them and must outlive the problem.
void AddSegments(const SgmvCheckedCall& call, std::vector<const void*>& rows,
                 std::vector<float>& scales, SgmvProblem& problem) {
  size_t total = 0;
  for (const SgmvActiveSegment& a : call.segments) total += a.rank;
  rows.resize(2 * total), scales.resize(total);
  size_t at = 0;
  for (const SgmvActiveSegment& a : call.segments) {
    const void** a_rows = rows.data() + 2 * at;
    const void** bt_rows = a_rows + a.rank;
    float* row_scales = scales.data() + at;
    for (int64_t i = a.first_term, j = 0; i < a.first_term + a.num_terms; ++i) {
      const SgmvActiveTerm& t = call.terms[i];
      const void* const* slot_rows = call.rows.data() + t.rows;
      for (int64_t k = 0; k < t.rank; ++k, ++j) {
        a_rows[j] = slot_rows[k], bt_rows[j] = slot_rows[t.rank + k], row_scales[j] = t.scale;
      }
    }
    problem.segments.push_back(
        {a.row_begin, a.row_end, a.rank, row_scales, a_rows, bt_rows, a.dora});
    at += a.rank;
  }
}

}  // namespace

LoraSgmvKernel::LoraSgmvKernel(const OrtApi&, const OrtKernelInfo* info) {
  Ort::ConstKernelInfo ki(info);
  layer_ = ki.GetAttribute<int64_t>("layer");
  if (layer_ < 0) Fail("attribute 'layer' must be >= 0, got ", layer_);
  const int64_t dtype = ReadAdapterDtype(ki, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
  switch (dtype) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT:
      rows_ = SgmvRowLayout::kPoolType;
      break;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16:
      rows_ = SgmvRowLayout::kBFloat16Pairs;
      break;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8:
      rows_ = SgmvRowLayout::kInt8Scaled;
      break;
    default:
      Fail("attribute 'adapter_dtype' = ", dtype,
           " is not supported by the CPU op: it must be 1 (FLOAT, float32 rows), 16 (BFLOAT16, "
           "bfloat16 rows in the float32 pool) or 3 (INT8, int8 rows with a float32 scale each)");
  }
}

OrtStatusPtr LoraSgmvKernel::ComputeV2(OrtKernelContext* context) {
  return GuardCompute("LoraSGMV", [&] { Compute(context); });
}

void LoraSgmvKernel::Compute(OrtKernelContext* context) {
  Ort::KernelContext ctx(context);
  const LoraSgmvInputs in = ReadLoraSgmvInputs(ctx, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
  const SgmvMetadata meta = ReadSgmvMetadata(in, layer_);
  CheckSgmvLayer(meta);
  const SgmvCheckedCall call = CheckSgmvSegments(
      meta, ListSgmvTerms(meta), ReadSgmvPool(in, sizeof(float), rows_), kRankLimit);
  SgmvProblem problem{in.x.value.GetTensorData<float>(),
                      in.y.value.GetTensorData<float>(),
                      nullptr,
                      meta.num_rows,
                      meta.in_features,
                      meta.out_features,
                      rows_,
                      {}};
  std::vector<const void*> rows;  // problem.segments point into rows and scales
  std::vector<float> scales;
  AddSegments(call, rows, scales, problem);
  problem.y_out = ctx.GetOutput(0, in.y.shape).GetTensorMutableData<float>();
  LoraSgmvCpu(problem, OrtParallelFor(ctx));
}

OrtStatusPtr LoraSgmvOp::CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info,
                                        void** kernel) const {
  return GuardCompute("LoraSGMV", [&] { *kernel = new LoraSgmvKernel(api, info); });
}

}  // namespace ort_lora
