// Shared pieces of every ort_lora custom op: the ORT C++ API (initialised by hand in
// RegisterCustomOps), the boundary that turns the error kernels throw (InputError,
// common/errors.h) into an ORT status, the validation helpers that turn a bad input into an
// error naming the input and the expected value, and the kernels' ParallelFor over ORT's pool.
#pragma once

#ifndef ORT_API_MANUAL_INIT
#define ORT_API_MANUAL_INIT
#endif
#include <onnxruntime_cxx_api.h>

#include <cstdint>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/parallel_for.h"

namespace ort_lora {

inline std::string ShapeStr(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

// Runs body() and turns any exception into an OrtStatus naming the op: an Ort::Exception keeps
// its code, anything else (InputError above all) is ORT_INVALID_ARGUMENT.
template <typename Body>
OrtStatusPtr GuardCompute(const char* op_name, Body&& body) {
  try {
    body();
    return nullptr;
  } catch (const Ort::Exception& e) {
    return Ort::Status((std::string(op_name) + ": " + e.what()).c_str(), e.GetOrtErrorCode())
        .release();
  } catch (const std::exception& e) {
    return Ort::Status((std::string(op_name) + ": " + e.what()).c_str(), ORT_INVALID_ARGUMENT)
        .release();
  }
}

// Shape inference helpers. ORT's planner lets an output take over an input's buffer
// (MayInplace) only when both shapes are known and equal (dims of the same value or name), and
// a custom op's outputs have no shape unless its InferOutputShapeFn gives one.
using InferredShape = Ort::ShapeInferContext::Shape;

// True when every dim is known: a value >= 0 or a name.
inline bool FullyKnown(const InferredShape& shape) {
  for (const auto& dim : shape)
    if (dim.IsInt() && dim.AsInt() < 0) return false;
  return !shape.empty();
}

// Gives output `index` `shape` (FullyKnown) and `type`, through the C API:
// Ort::ShapeInferContext::SetOutputShape marks named dims -2, which ORT refuses.
inline void SetInferredShape(OrtShapeInferContext* ctx, size_t index, const InferredShape& shape,
                             ONNXTensorElementDataType type) {
  const OrtApi& api = Ort::GetApi();
  std::vector<int64_t> dims;
  std::vector<const char*> names;
  for (const auto& dim : shape) {
    dims.push_back(dim.IsInt() ? dim.AsInt() : -1);
    names.push_back(dim.IsInt() ? "" : dim.AsSym());
  }
  OrtTensorTypeAndShapeInfo* info = nullptr;
  Ort::ThrowOnError(api.CreateTensorTypeAndShapeInfo(&info));
  std::unique_ptr<OrtTensorTypeAndShapeInfo, void (*)(OrtTensorTypeAndShapeInfo*)> owned(
      info, [](OrtTensorTypeAndShapeInfo* p) { Ort::GetApi().ReleaseTensorTypeAndShapeInfo(p); });
  Ort::ThrowOnError(api.SetTensorElementType(info, type));
  Ort::ThrowOnError(api.SetDimensions(info, dims.data(), dims.size()));
  Ort::ThrowOnError(api.SetSymbolicDimensions(info, names.data(), names.size()));
  Ort::ThrowOnError(api.ShapeInferContext_SetOutputTypeShape(ctx, index, info));
}

// Declares that op's output 0 has the type and shape of its input `kInput` (inferred when ORT
// knows each of that input's dims; otherwise the output stays unknown, never an error: the
// kernel's own checks report bad inputs at run time).
template <int kInput>
void OutputLikeInput(OrtCustomOp& op) {
  op.InferOutputShapeFn = [](const OrtCustomOp*, OrtShapeInferContext* c) -> OrtStatusPtr {
    try {
      Ort::ShapeInferContext ctx(&Ort::GetApi(), c);
      if (ctx.GetInputCount() <= kInput || !FullyKnown(ctx.GetInputShape(kInput))) return nullptr;
      OrtTensorTypeAndShapeInfo* input = nullptr;  // owned by ctx
      Ort::ThrowOnError(Ort::GetApi().ShapeInferContext_GetInputTypeShape(c, kInput, &input));
      ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
      Ort::ThrowOnError(Ort::GetApi().GetTensorElementType(input, &type));
      SetInferredShape(c, 0, ctx.GetInputShape(kInput), type);
    } catch (const std::exception&) {
    }
    return nullptr;
  };
}

// Declares that op's output 0 may reuse the buffer of its input `kInput`, which it is like
// (ORT decides: when nothing else reads that input and its shape is known, it skips allocating
// the output, and the kernel, which must tolerate the alias, updates the input in place).
template <int kInput>
void MayWriteOutputOverInput(OrtCustomOp& op) {
  op.GetMayInplace = [](int** input_index, int** output_index) -> size_t {
    *input_index = new int[1]{kInput};
    *output_index = new int[1]{0};
    return 1;
  };
  op.ReleaseMayInplace = [](int* input_index, int* output_index) {
    delete[] input_index;
    delete[] output_index;
  };
  OutputLikeInput<kInput>(op);
}

// The node's attribute `name`, or `fallback` when the node has none.
template <typename T>
T AttrOr(const Ort::ConstKernelInfo& ki, const char* name, T fallback) {
  try {
    return ki.GetAttribute<T>(name);
  } catch (const Ort::Exception&) {
    return fallback;
  }
}

// The node's int attribute `name`, or an InputError naming it when the node has none.
inline int64_t RequiredInt(const Ort::ConstKernelInfo& ki, const char* name) {
  try {
    return ki.GetAttribute<int64_t>(name);
  } catch (const Ort::Exception&) {
    Fail("attribute '", name, "' (int) is required");
  }
}

// A read-only view of one input with its shape, checked for rank and element type.
struct InputView {
  Ort::ConstValue value;
  std::vector<int64_t> shape;
  ONNXTensorElementDataType type;
  bool present;
};

inline InputView GetInput(const Ort::KernelContext& ctx, size_t index) {
  InputView v{ctx.GetInput(index), {}, ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED, false};
  if (v.value == nullptr) return v;
  auto info = v.value.GetTensorTypeAndShapeInfo();
  v.shape = info.GetShape();
  v.type = info.GetElementType();
  v.present = true;
  return v;
}

inline const char* TypeName(ONNXTensorElementDataType t) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT:
      return "float32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16:
      return "float16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16:
      return "bfloat16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32:
      return "int32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64:
      return "int64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE:
      return "float64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8:
      return "uint8";
    default:
      return "other";
  }
}

// Checks presence, rank and element type; `name` is the input's name in the op schema.
inline void Expect(const InputView& v, const char* name, size_t rank,
                   ONNXTensorElementDataType type) {
  if (!v.present) Fail("input '", name, "' is required");
  if (v.shape.size() != rank)
    Fail("input '", name, "' must have rank ", rank, ", got shape ", ShapeStr(v.shape));
  if (v.type != type)
    Fail("input '", name, "' must be ", TypeName(type), ", got ", TypeName(v.type));
}

inline void ExpectDim(const InputView& v, const char* name, size_t axis, int64_t expected,
                      const char* what) {
  if (v.shape[axis] != expected)
    Fail("input '", name, "' dim ", axis, " must be ", expected, " (", what, "), got shape ",
         ShapeStr(v.shape));
}

// The op's intra-op thread pool as the kernels' ParallelFor; `ctx` must outlive it.
inline ParallelFor OrtParallelFor(const Ort::KernelContext& ctx) {
  auto run = [](const void* pool, void (*fn)(void*, size_t), size_t n, void* data) {
    static_cast<const Ort::KernelContext*>(pool)->ParallelFor(fn, n, 0, data);
  };
  return ParallelFor(run, &ctx);
}

}  // namespace ort_lora
