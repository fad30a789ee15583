// LoraSGMV for CUDAExecutionProvider (float16 and bfloat16): the same inputs, output and
// semantics as the CPU op (lora_sgmv/lora_sgmv_op.h), with T = float16 or bfloat16:
//   0 y T [T, out]   1 x T [T, in]   2 key_cache T [...]   3 value_cache T [...]   (device)
//   4 seg_starts int32 [S + 1]  5 seg_slots int32 [S]  6 a_offsets int64 [num_slots, max_rank]
//   7 b_offsets int64 [num_slots, max_rank]  8 ranks int32 [L, num_slots]
//   9 scales float [L, num_slots]  10 comp_segs int32 [E]  11 comp_slots int32 [E]
//  12 comp_weights float [E]  13 dora_offsets int64 [num_slots] or [0]    (host, see below)
//   (10..13 optional: composition entries and DoRA rows, as the CPU op defines them)
//   output 0 y_out T [T, out] (device); attribute layer.
// One module a node: the op declares the CPU op's inputs and outputs of further modules
// (attribute modules, lora_sgmv_op.h; ORT requires one input count for an op name, whatever the
// provider), and fails at kernel creation for modules != 1 and at run time for a node that
// has any of them (CUDA exports keep a node per module).
// Attribute adapter_dtype (optional int): adapter rows are always T here, so if present it must
// be T's ONNX element type (10 float16, 16 bfloat16); any other value fails at kernel creation.
// (Packed bfloat16 rows in a float32 pool are the CPU op's alone; the exporter never sets the
// attribute on CUDA graphs.) This check has no test without a GPU.
// Metadata choice: inputs 4..13 are declared OrtMemTypeCPUInput, so ORT hands them over in host
// memory (graph inputs bound on the CPU are used as they are). The kernel validates them on the
// host exactly like the CPU op (a bad offset is an error, never an out-of-bounds read), builds
// a plan of row tiles plus the step's tables (cuda/sgmv_plan.h) and runs it on ORT's compute
// stream (RunLoraSgmv): the plan is uploaded once per step and module and reused by every layer,
// and the v scratch is the stream's own, grown stream-ordered (cudaMallocAsync on that stream),
// so no ORT allocator is involved. A null compute stream is an error, never the legacy default
// stream. Output 0 may reuse input 0's buffer (MayInplace): ORT then skips the y -> y_out copy.
// Limits: rank <= 512 (also a composed segment's ranks summed), T < 2^31.
#pragma once

#include "common/ort_common.h"
#include "cuda/sgmv_launcher.h"
#include "lora_sgmv/lora_sgmv_inputs.h"

namespace ort_lora {

struct LoraSgmvCudaKernel {
  LoraSgmvCudaKernel(const OrtKernelInfo* info, SgmvDtype dtype);
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

 private:
  void Compute(OrtKernelContext* context);
  int64_t layer_;
  SgmvDtype dtype_;
};

struct LoraSgmvCudaOp : Ort::CustomOpBase<LoraSgmvCudaOp, LoraSgmvCudaKernel, true> {
  explicit LoraSgmvCudaOp(SgmvDtype dtype);
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const;
  const char* GetName() const { return "LoraSGMV"; }
  const char* GetExecutionProviderType() const { return "CUDAExecutionProvider"; }
  // Inputs and output as lora_sgmv_inputs.h describes them for every provider, T = dtype.
  size_t GetInputTypeCount() const { return kNumLoraSgmvOpInputs; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return LoraSgmvModulesInputType(index, ElementType());
  }
  OrtMemType GetInputMemoryType(size_t index) const;
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return LoraSgmvInputCharacteristic(index);
  }
  size_t GetOutputTypeCount() const { return kSgmvMaxModules; }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t index) const {
    return index == 0 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ElementType(); }

 private:
  ONNXTensorElementDataType ElementType() const;
  SgmvDtype dtype_;
};

}  // namespace ort_lora
