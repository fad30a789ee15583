// The inputs of LoraSGMV, read and checked once for every provider (CPU float32, CUDA
// float16/bfloat16): rank, element type and the dims the inputs share; then seen as the
// ORT-free metadata and pool that lora_sgmv_checks.h checks. The contract is in lora_sgmv_op.h.
#pragma once

#include "common/ort_common.h"
#include "lora_sgmv/lora_sgmv_checks.h"

namespace ort_lora {

enum LoraSgmvInput : size_t {
  kY,
  kX,
  kKeyCache,
  kValueCache,
  kSegStarts,
  kSegSlots,
  kAOffsets,
  kBOffsets,
  kRanks,
  kScales,
  kCompSegs,  // optional from here on (a node of 10 inputs: no composition, no DoRA)
  kCompSlots,
  kCompWeights,
  kDoraOffsets,
  kNumLoraSgmvInputs
};

// The element type of each input (lora_sgmv_op.h), for every provider's op: `t` is the type of
// y, x and the caches (float32 on CPU, float16/bfloat16 on CUDA); the metadata types are fixed.
inline ONNXTensorElementDataType LoraSgmvInputType(size_t index, ONNXTensorElementDataType t) {
  switch (index) {
    case kSegStarts:
    case kSegSlots:
    case kRanks:
    case kCompSegs:
    case kCompSlots:
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    case kAOffsets:
    case kBOffsets:
    case kDoraOffsets:
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    case kScales:
    case kCompWeights:
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    default:
      return t;
  }
}

// Inputs from comp_segs on are optional (a node of 10 inputs: no composition, no DoRA).
inline OrtCustomOpInputOutputCharacteristic LoraSgmvInputCharacteristic(size_t index) {
  return index >= kCompSegs ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
}

struct LoraSgmvInputs {
  InputView y, x, key_cache, value_cache, seg_starts, seg_slots, a_offsets, b_offsets, ranks,
      scales, comp_segs, comp_slots, comp_weights, dora_offsets;
};

// Present inputs of an optional input's index, absent ones an empty view.
inline InputView GetOptionalInput(const Ort::KernelContext& ctx, size_t index) {
  if (index >= ctx.GetInputCount()) return InputView{Ort::ConstValue{nullptr}, {}, {}, false};
  return GetInput(ctx, index);
}

// The optional inputs: the composition entries (all three or none, each [E]) and dora_offsets
// ([num_slots], or [0]: no slot has a DoRA row).
inline void ExpectOptionalInputs(const LoraSgmvInputs& in) {
  constexpr auto kFloat = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  constexpr auto kInt32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
  constexpr auto kInt64 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
  const int present = in.comp_segs.present + in.comp_slots.present + in.comp_weights.present;
  if (present != 0 && present != 3)
    Fail("inputs 'comp_segs', 'comp_slots' and 'comp_weights' go together: give all three or none");
  if (present == 3) {
    Expect(in.comp_segs, "comp_segs", 1, kInt32);
    Expect(in.comp_slots, "comp_slots", 1, kInt32);
    Expect(in.comp_weights, "comp_weights", 1, kFloat);
    ExpectDim(in.comp_slots, "comp_slots", 0, in.comp_segs.shape[0], "E, as comp_segs");
    ExpectDim(in.comp_weights, "comp_weights", 0, in.comp_segs.shape[0], "E, as comp_segs");
  }
  if (in.dora_offsets.present) {
    Expect(in.dora_offsets, "dora_offsets", 1, kInt64);
    if (in.dora_offsets.shape[0] != 0)
      ExpectDim(in.dora_offsets, "dora_offsets", 0, in.a_offsets.shape[0],
                "num_slots, as a_offsets, or 0: no DoRA rows");
  }
}

// `t` is the element type of y, x and the caches (float32 on CPU, float16/bfloat16 on CUDA).
inline LoraSgmvInputs ReadLoraSgmvInputs(const Ort::KernelContext& ctx,
                                         ONNXTensorElementDataType t) {
  constexpr auto kFloat = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  constexpr auto kInt32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
  constexpr auto kInt64 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
  LoraSgmvInputs in{GetInput(ctx, kY),
                    GetInput(ctx, kX),
                    GetInput(ctx, kKeyCache),
                    GetInput(ctx, kValueCache),
                    GetInput(ctx, kSegStarts),
                    GetInput(ctx, kSegSlots),
                    GetInput(ctx, kAOffsets),
                    GetInput(ctx, kBOffsets),
                    GetInput(ctx, kRanks),
                    GetInput(ctx, kScales),
                    GetOptionalInput(ctx, kCompSegs),
                    GetOptionalInput(ctx, kCompSlots),
                    GetOptionalInput(ctx, kCompWeights),
                    GetOptionalInput(ctx, kDoraOffsets)};
  Expect(in.y, "y", 2, t);
  Expect(in.x, "x", 2, t);
  Expect(in.key_cache, "key_cache", 4, t);
  Expect(in.value_cache, "value_cache", 4, t);
  Expect(in.seg_starts, "seg_starts", 1, kInt32);
  Expect(in.seg_slots, "seg_slots", 1, kInt32);
  Expect(in.a_offsets, "a_offsets", 2, kInt64);
  Expect(in.b_offsets, "b_offsets", 2, kInt64);
  Expect(in.ranks, "ranks", 2, kInt32);
  Expect(in.scales, "scales", 2, kFloat);
  ExpectDim(in.x, "x", 0, in.y.shape[0], "T, the rows of y");
  for (size_t d = 0; d < 4; ++d)
    ExpectDim(in.value_cache, "value_cache", d, in.key_cache.shape[d], "the shape of key_cache");
  ExpectDim(in.seg_starts, "seg_starts", 0, in.seg_slots.shape[0] + 1, "S + 1, S = len(seg_slots)");
  ExpectDim(in.b_offsets, "b_offsets", 0, in.a_offsets.shape[0], "num_slots, as a_offsets");
  ExpectDim(in.b_offsets, "b_offsets", 1, in.a_offsets.shape[1], "max_rank, as a_offsets");
  ExpectDim(in.ranks, "ranks", 1, in.a_offsets.shape[0], "num_slots, as a_offsets");
  ExpectDim(in.scales, "scales", 0, in.ranks.shape[0], "num_layers, as ranks");
  ExpectDim(in.scales, "scales", 1, in.ranks.shape[1], "num_slots, as ranks");
  ExpectOptionalInputs(in);
  return in;
}

// LoraSGMV with attribute modules = M > 1 (the CPU op): one call for M modules that read the
// same x. Inputs 0..13 above are module 0's and the shared ones; module m = 1 .. M-1 adds
// y_m, a_offsets_m, b_offsets_m, ranks_m, scales_m and dora_offsets_m (optional) at
// kNumLoraSgmvInputs + kNumModuleInputs (m - 1) + LoraSgmvModuleInput, and writes output m.
enum LoraSgmvModuleInput : size_t {
  kModuleY,
  kModuleAOffsets,
  kModuleBOffsets,
  kModuleRanks,
  kModuleScales,
  kModuleDoraOffsets,
  kNumModuleInputs
};

inline size_t LoraSgmvModuleInputIndex(size_t module, LoraSgmvModuleInput k) {
  return kNumLoraSgmvInputs + (module - 1) * kNumModuleInputs + k;
}

// The inputs every provider's LoraSGMV declares: modules 1 .. kSgmvMaxModules - 1's too (ORT
// refuses two ops of one name with different input counts), all of them optional.
constexpr size_t kNumLoraSgmvModulesInputs =
    kNumLoraSgmvInputs + (kSgmvMaxModules - 1) * kNumModuleInputs;

// After every module's inputs, the CPU op's optional row_types: int32 [num_slots] or [0], per
// slot the element type of its rows in place of the attribute adapter_dtype (lora_sgmv_op.h).
constexpr size_t kRowTypes = kNumLoraSgmvModulesInputs;
// The inputs every provider's LoraSGMV declares (the CUDA op never reads row_types).
constexpr size_t kNumLoraSgmvOpInputs = kRowTypes + 1;

// Whether input `index` is a module's y (module 0's or a further module's).
inline bool IsLoraSgmvY(size_t index) {
  return index == kY || (index >= kNumLoraSgmvInputs && index < kNumLoraSgmvModulesInputs &&
                         (index - kNumLoraSgmvInputs) % kNumModuleInputs == kModuleY);
}

// The element type of input `index` of the op with modules (`t` as in LoraSgmvInputType).
inline ONNXTensorElementDataType LoraSgmvModulesInputType(size_t index,
                                                          ONNXTensorElementDataType t) {
  if (index < kNumLoraSgmvInputs) return LoraSgmvInputType(index, t);
  if (index == kRowTypes) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
  switch ((index - kNumLoraSgmvInputs) % kNumModuleInputs) {
    case kModuleY:
      return t;
    case kModuleAOffsets:
    case kModuleBOffsets:
    case kModuleDoraOffsets:
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    case kModuleRanks:
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    default:
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
}

// `in` with module 0's inputs (y, a_offsets, b_offsets, ranks, scales, dora_offsets) replaced
// by module m's (m >= 1), checked as ReadLoraSgmvInputs checks module 0's; errors name them
// <name>_m. `in` must come from ReadLoraSgmvInputs.
inline LoraSgmvInputs ReadLoraSgmvModuleInputs(const Ort::KernelContext& ctx,
                                               const LoraSgmvInputs& in, size_t m,
                                               ONNXTensorElementDataType t) {
  constexpr auto kFloat = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  constexpr auto kInt32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
  constexpr auto kInt64 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
  auto input = [&](LoraSgmvModuleInput k) {
    return GetOptionalInput(ctx, LoraSgmvModuleInputIndex(m, k));
  };
  // The inputs' names in errors, by module (no string is built per call).
  static constexpr const char* kNames[kSgmvMaxModules][kNumModuleInputs] = {
      {},
      {"y_1", "a_offsets_1", "b_offsets_1", "ranks_1", "scales_1", "dora_offsets_1"},
      {"y_2", "a_offsets_2", "b_offsets_2", "ranks_2", "scales_2", "dora_offsets_2"}};
  static_assert(kSgmvMaxModules == 3, "kNames lists modules 1 and 2");
  const char* const* names = kNames[m];
  const char *y = names[kModuleY], *a = names[kModuleAOffsets], *b = names[kModuleBOffsets],
             *ranks = names[kModuleRanks], *scales = names[kModuleScales],
             *dora = names[kModuleDoraOffsets];
  LoraSgmvInputs out = in;
  out.y = input(kModuleY), out.a_offsets = input(kModuleAOffsets);
  out.b_offsets = input(kModuleBOffsets), out.ranks = input(kModuleRanks);
  out.scales = input(kModuleScales), out.dora_offsets = input(kModuleDoraOffsets);
  Expect(out.y, y, 2, t);
  Expect(out.a_offsets, a, 2, kInt64);
  Expect(out.b_offsets, b, 2, kInt64);
  Expect(out.ranks, ranks, 2, kInt32);
  Expect(out.scales, scales, 2, kFloat);
  ExpectDim(out.y, y, 0, in.x.shape[0], "T, the rows of x");
  ExpectDim(out.a_offsets, a, 0, in.a_offsets.shape[0], "num_slots, as a_offsets");
  ExpectDim(out.b_offsets, b, 0, out.a_offsets.shape[0], "num_slots, as a_offsets");
  ExpectDim(out.b_offsets, b, 1, out.a_offsets.shape[1], "max_rank, as its a_offsets");
  ExpectDim(out.ranks, ranks, 1, in.a_offsets.shape[0], "num_slots, as a_offsets");
  ExpectDim(out.scales, scales, 0, out.ranks.shape[0], "num_layers, as its ranks");
  ExpectDim(out.scales, scales, 1, out.ranks.shape[1], "num_slots, as its ranks");
  if (out.dora_offsets.present) {
    Expect(out.dora_offsets, dora, 1, kInt64);
    if (out.dora_offsets.shape[0] != 0)
      ExpectDim(out.dora_offsets, dora, 0, in.a_offsets.shape[0],
                "num_slots, as a_offsets, or 0: no DoRA rows");
  }
  return out;
}

template <typename T>
const T* DataOrNull(const InputView& v) {
  return v.present && v.shape[0] > 0 ? v.value.GetTensorData<T>() : nullptr;
}

// The LoRA metadata of a call whose shapes ReadLoraSgmvInputs checked, for layer `layer`.
inline SgmvMetadata ReadSgmvMetadata(const LoraSgmvInputs& in, int64_t layer) {
  return {in.seg_starts.value.GetTensorData<int32_t>(),
          in.seg_slots.value.GetTensorData<int32_t>(),
          in.a_offsets.value.GetTensorData<int64_t>(),
          in.b_offsets.value.GetTensorData<int64_t>(),
          in.ranks.value.GetTensorData<int32_t>(),
          in.scales.value.GetTensorData<float>(),
          in.seg_slots.shape[0],
          in.a_offsets.shape[0],
          in.a_offsets.shape[1],
          in.ranks.shape[0],
          layer,
          in.y.shape[0],
          in.x.shape[1],
          in.y.shape[1],
          DataOrNull<int32_t>(in.comp_segs),
          DataOrNull<int32_t>(in.comp_slots),
          DataOrNull<float>(in.comp_weights),
          in.comp_segs.present ? in.comp_segs.shape[0] : 0,
          DataOrNull<int64_t>(in.dora_offsets)};
}

// The pool share (key_cache, value_cache, whose shapes ReadLoraSgmvInputs checked) of a call;
// elem_size is the caches' element size.
inline SgmvPool ReadSgmvPool(const LoraSgmvInputs& in, int64_t elem_size, SgmvRowLayout rows) {
  int64_t half = 1;
  for (int64_t d : in.key_cache.shape) half *= d;
  return {in.key_cache.value.GetTensorRawData(), in.value_cache.value.GetTensorRawData(), half,
          elem_size, rows};
}

template <typename T>
bool HasAttribute(const Ort::ConstKernelInfo& ki, const char* name) {
  try {
    ki.GetAttribute<T>(name);
    return true;
  } catch (const Ort::Exception&) {
    return false;
  }
}

// The optional int attribute adapter_dtype (an ONNX TensorProto element type: the type of the
// adapter rows in the pool), or `absent` when the node has none. Each op checks the value.
inline int64_t ReadAdapterDtype(const Ort::ConstKernelInfo& ki, int64_t absent) {
  constexpr const char* kName = "adapter_dtype";
  if (HasAttribute<int64_t>(ki, kName)) return ki.GetAttribute<int64_t>(kName);
  if (HasAttribute<float>(ki, kName) || HasAttribute<std::string>(ki, kName))
    Fail("attribute '", kName, "' must be an int (an ONNX TensorProto element type)");
  return absent;
}

}  // namespace ort_lora
