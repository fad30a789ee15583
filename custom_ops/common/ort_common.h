// Shared pieces of every ort_lora custom op: the ORT C++ API (initialised by hand in
// RegisterCustomOps), the boundary that turns the error kernels throw (InputError,
// common/errors.h) into an ORT status, the validation helpers that turn a bad input into an
// error naming the input and the expected value, and the kernels' ParallelFor over ORT's pool.
#pragma once

#ifndef ORT_API_MANUAL_INIT
#define ORT_API_MANUAL_INIT
#endif
#include <onnxruntime_cxx_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/parallel_for.h"

namespace ort_lora {

// A tensor's dims, held in place up to kInline of them (every input these ops take; more go to
// the heap): reading an input's shape allocates nothing.
class Dims {
 public:
  Dims() = default;
  Dims(std::initializer_list<int64_t> dims) { assign(dims.begin(), dims.size()); }
  void assign(const int64_t* dims, size_t n) {
    size_ = n;
    if (n > kInline) return heap_.assign(dims, dims + n);
    heap_.clear();
    std::copy(dims, dims + n, inline_);
  }
  const int64_t* data() const { return size_ > kInline ? heap_.data() : inline_; }
  int64_t* data() { return size_ > kInline ? heap_.data() : inline_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const int64_t* begin() const { return data(); }
  const int64_t* end() const { return data() + size_; }
  int64_t operator[](size_t i) const { return data()[i]; }
  int64_t back() const { return data()[size_ - 1]; }
  int64_t& back() { return data()[size_ - 1]; }
  friend bool operator==(const Dims& a, const Dims& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  }
  friend bool operator!=(const Dims& a, const Dims& b) { return !(a == b); }

 private:
  static constexpr size_t kInline = 8;
  int64_t inline_[kInline] = {};
  size_t size_ = 0;
  std::vector<int64_t> heap_;
};

template <typename Shape>  // std::vector<int64_t> or Dims
std::string ShapeStr(const Shape& shape) {
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
  Dims shape;
  ONNXTensorElementDataType type;
  bool present;
};

// ORT's GetTensorElementTypeAndShapeDataReference (C API 24, ONNX Runtime 1.24 and later): an
// input's element type and a pointer to its dims, where GetTensorTypeAndShape allocates an info
// object (and its dims) to be copied and released. Our headers are API 21's, so
// RegisterCustomOps sets it from the runtime's function table (FindTensorShapeReference in
// ort_lora_ops.cc) each time a session registers the library; null on an older runtime, where
// GetInput reads shapes the API 21 way.
using TensorShapeReferenceFn = OrtStatus*(ORT_API_CALL*)(const OrtValue*,
                                                         ONNXTensorElementDataType*,
                                                         const int64_t**, size_t*);
inline std::atomic<TensorShapeReferenceFn>& TensorShapeReference() {
  static std::atomic<TensorShapeReferenceFn> fn{nullptr};  // set while other sessions run
  return fn;
}

inline InputView GetInput(const Ort::KernelContext& ctx, size_t index) {
  InputView v{ctx.GetInput(index), {}, ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED, false};
  if (v.value == nullptr) return v;
  if (TensorShapeReferenceFn shape_of = TensorShapeReference().load(std::memory_order_relaxed)) {
    const int64_t* dims = nullptr;
    size_t rank = 0;
    Ort::ThrowOnError(shape_of(v.value, &v.type, &dims, &rank));
    v.shape.assign(dims, rank);
  } else {
    auto info = v.value.GetTensorTypeAndShapeInfo();
    const std::vector<int64_t> dims = info.GetShape();
    v.shape.assign(dims.data(), dims.size());
    v.type = info.GetElementType();
  }
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
