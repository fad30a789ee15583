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
