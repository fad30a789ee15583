#include "quant_matmul/quant_matmul_op.h"

#include <vector>

#include "quant_matmul/quant_matmul_cpu.h"

namespace ort_lora {

namespace {

constexpr auto kF32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto kU8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
enum Input { kX, kCodes, kScales, kZeros, kOffsets, kNumInputs };

// y's shape: x's with the last dim N (known dims only; otherwise y stays unknown).
OrtStatusPtr InferShape(const OrtCustomOp*, OrtShapeInferContext* c) {
  try {
    Ort::ShapeInferContext ctx(&Ort::GetApi(), c);
    InferredShape shape = ctx.GetInputShape(kX);
    if (!FullyKnown(shape)) return nullptr;
    shape.back() = Ort::ShapeInferContext::SymbolicInteger(ctx.GetAttrInt("N"));
    SetInferredShape(c, 0, shape, kF32);
  } catch (const std::exception&) {
  }
  return nullptr;
}

// One tiled weight input [tiles, blocks, ..., last]: rank, type and every dim.
void ExpectTiled(const InputView& v, const char* name, ONNXTensorElementDataType type,
                 const std::vector<int64_t>& dims) {
  Expect(v, name, dims.size(), type);
  if (v.shape != dims)
    Fail("input '", name, "' must have shape ", ShapeStr(dims), " (from K, N and block_size), got ",
         ShapeStr(v.shape));
}

}  // namespace

QuantMatMulKernel::QuantMatMulKernel(const OrtApi&, const OrtKernelInfo* info) {
  Ort::ConstKernelInfo ki(info);
  k_ = RequiredInt(ki, "K");
  n_ = RequiredInt(ki, "N");
  block_size_ = RequiredInt(ki, "block_size");
  const int64_t bits = AttrOr<int64_t>(ki, "bits", 4);
  const int64_t level = AttrOr<int64_t>(ki, "accuracy_level", 4);
  if (bits != 4) Fail("attribute 'bits' must be 4 (the only width of this kernel), got ", bits);
  if (level != 0 && level != 1 && level != 4)
    Fail("attribute 'accuracy_level' must be 4 (int8 x) or 0 / 1 (float x), got ", level);
  float_x_ = level != 4;
  if (block_size_ < 16 || (block_size_ & (block_size_ - 1)))
    Fail("attribute 'block_size' must be a power of two >= 16, got ", block_size_);
  if (k_ <= 0 || k_ % block_size_)
    Fail("attribute 'K' (", k_, ") must be a positive multiple of block_size (", block_size_, ")");
  if (n_ <= 0) Fail("attribute 'N' must be positive, got ", n_);
}

OrtStatusPtr QuantMatMulKernel::ComputeV2(OrtKernelContext* context) {
  return GuardCompute("QuantMatMul", [&] { Compute(context); });
}

void QuantMatMulKernel::Compute(OrtKernelContext* context) {
  Ort::KernelContext ctx(context);
  std::vector<InputView> in;
  for (size_t i = 0; i < kNumInputs; ++i) in.push_back(GetInput(ctx, i));
  const InputView& x = in[kX];
  if (!x.present || x.shape.empty()) Fail("input 'x' is required and must have rank >= 1");
  if (x.type != kF32) Fail("input 'x' must be float32, got ", TypeName(x.type));
  if (x.shape.back() != k_)
    Fail("input 'x' must have last dim K = ", k_, ", got shape ", ShapeStr(x.shape));
  const int64_t tiles = (n_ + kQuantTile - 1) / kQuantTile, blocks = k_ / block_size_;
  ExpectTiled(in[kCodes], "codes", kU8, {tiles, blocks, block_size_ / 8, 4 * kQuantTile});
  ExpectTiled(in[kScales], "scales", kF32, {tiles, blocks, kQuantTile});
  if (in[kZeros].present) ExpectTiled(in[kZeros], "zeros", kU8, {tiles, blocks, kQuantTile});
  if (in[kOffsets].present) ExpectTiled(in[kOffsets], "offsets", kF32, {tiles, blocks, kQuantTile});

  std::vector<int64_t> y_shape = x.shape;
  y_shape.back() = n_;
  auto y = ctx.GetOutput(0, y_shape);
  int64_t m = 1;
  for (size_t i = 0; i + 1 < x.shape.size(); ++i) m *= x.shape[i];
  QuantMatMulArgs a{x.value.GetTensorData<float>(),
                    m,
                    k_,
                    n_,
                    block_size_,
                    in[kCodes].value.GetTensorData<uint8_t>(),
                    in[kScales].value.GetTensorData<float>(),
                    in[kZeros].present ? in[kZeros].value.GetTensorData<uint8_t>() : nullptr,
                    in[kOffsets].present ? in[kOffsets].value.GetTensorData<float>() : nullptr,
                    y.GetTensorMutableData<float>(),
                    float_x_};
  QuantMatMulCpu(a, OrtParallelFor(ctx));
}

QuantMatMulOp::QuantMatMulOp() { InferOutputShapeFn = InferShape; }

OrtStatusPtr QuantMatMulOp::CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info,
                                           void** kernel) const {
  return GuardCompute("QuantMatMul", [&] { *kernel = new QuantMatMulKernel(api, info); });
}

ONNXTensorElementDataType QuantMatMulOp::GetInputType(size_t index) const {
  return index == kCodes || index == kZeros ? kU8 : kF32;
}

}  // namespace ort_lora
