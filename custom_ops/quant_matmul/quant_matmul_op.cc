#include "quant_matmul/quant_matmul_op.h"

#include <vector>

#include "quant_matmul/quant_matmul_cpu.h"

namespace ort_lora {

namespace {

constexpr auto kF32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto kF16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
constexpr auto kU8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
enum Input { kX, kCodes, kScales, kZeros, kOffsets, kNumInputs };

// The outputs' shapes: x's with the last dim N, or each of splits (known dims only; otherwise
// they stay unknown).
OrtStatusPtr InferShape(const OrtCustomOp*, OrtShapeInferContext* c) {
  try {
    Ort::ShapeInferContext ctx(&Ort::GetApi(), c);
    InferredShape shape = ctx.GetInputShape(kX);
    if (!FullyKnown(shape)) return nullptr;
    std::vector<int64_t> columns{ctx.GetAttrInt("N")};
    try {
      columns = ctx.GetAttrInts("splits");
    } catch (const std::exception&) {
    }
    for (size_t o = 0; o < columns.size(); ++o) {
      shape.back() = Ort::ShapeInferContext::SymbolicInteger(columns[o]);
      SetInferredShape(c, o, shape, kF32);
    }
  } catch (const std::exception&) {
  }
  return nullptr;
}

// One tiled weight input [tiles, blocks, ..., last]: rank, type and every dim.
void ExpectTiled(const InputView& v, const char* name, ONNXTensorElementDataType type,
                 const Dims& dims) {
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
  bits_ = AttrOr<int64_t>(ki, "bits", 4);
  const int64_t level = AttrOr<int64_t>(ki, "accuracy_level", 4);
  if (bits_ != 4 && bits_ != 8) Fail("attribute 'bits' must be 4 or 8, got ", bits_);
  if (level != 0 && level != 1 && level != 4)
    Fail("attribute 'accuracy_level' must be 4 (int8 x) or 0 / 1 (float x), got ", level);
  float_x_ = level != 4;
  if (block_size_ < 16 || (block_size_ & (block_size_ - 1)))
    Fail("attribute 'block_size' must be a power of two >= 16, got ", block_size_);
  if (k_ <= 0 || k_ % block_size_)
    Fail("attribute 'K' (", k_, ") must be a positive multiple of block_size (", block_size_, ")");
  if (n_ <= 0) Fail("attribute 'N' must be positive, got ", n_);
  try {
    splits_ = ki.GetAttributes<int64_t>("splits");
  } catch (const Ort::Exception&) {
    splits_ = {n_};
  }
  if (splits_.empty() || splits_.size() > kMaxOutputs)
    Fail("attribute 'splits' must have 1 to ", kMaxOutputs, " values, got ", splits_.size());
  int64_t sum = 0;
  for (size_t o = 0; o < splits_.size(); ++o) {
    if (splits_[o] <= 0 || (o + 1 < splits_.size() && splits_[o] % kQuantTile))
      Fail("attribute 'splits' ", ShapeStr(splits_), ": each value must be positive, all but the ",
           "last multiples of ", kQuantTile, " (the weight's column tiles)");
    sum += splits_[o];
  }
  if (sum != n_) Fail("attribute 'splits' ", ShapeStr(splits_), " must sum to N (", n_, ")");
}

OrtStatusPtr QuantMatMulKernel::ComputeV2(OrtKernelContext* context) {
  return GuardCompute("QuantMatMul", [&] { Compute(context); });
}

void QuantMatMulKernel::Compute(OrtKernelContext* context) {
  Ort::KernelContext ctx(context);
  InputView in[kNumInputs];  // in place: a decode step's calls allocate nothing here
  for (size_t i = 0; i < kNumInputs; ++i) in[i] = GetInput(ctx, i);
  const InputView& x = in[kX];
  if (!x.present || x.shape.empty()) Fail("input 'x' is required and must have rank >= 1");
  if (x.type != kF32) Fail("input 'x' must be float32, got ", TypeName(x.type));
  if (x.shape.back() != k_)
    Fail("input 'x' must have last dim K = ", k_, ", got shape ", ShapeStr(x.shape));
  const int64_t tiles = (n_ + kQuantTile - 1) / kQuantTile, blocks = k_ / block_size_;
  ExpectTiled(in[kCodes], "codes", kU8, {tiles, blocks, block_size_ * bits_ / 32, 4 * kQuantTile});
  // float16 scales (and minimums for offsets): a GGUF file's own numbers, 4 bits, no zeros
  const bool half = in[kScales].present && in[kScales].type == kF16;
  if (half && (bits_ != 4 || in[kZeros].present))
    Fail("float16 'scales' need bits 4 and no 'zeros' input (GGUF Q4_0 / Q4_1 blocks)");
  const auto scale_type = half ? kF16 : kF32;
  ExpectTiled(in[kScales], "scales", scale_type, {tiles, blocks, kQuantTile});
  if (in[kZeros].present) ExpectTiled(in[kZeros], "zeros", kU8, {tiles, blocks, kQuantTile});
  if (in[kOffsets].present)
    ExpectTiled(in[kOffsets], "offsets", scale_type, {tiles, blocks, kQuantTile});

  if (ctx.GetOutputCount() != splits_.size())
    Fail("the node has ", ctx.GetOutputCount(), " outputs; attribute 'splits' names ",
         splits_.size());
  int64_t m = 1;
  for (size_t i = 0; i + 1 < x.shape.size(); ++i) m *= x.shape[i];
  QuantMatMulArgs a{};
  a.x = x.value.GetTensorData<float>();
  a.m = m;
  a.k = k_;
  a.n = n_;
  a.block_size = block_size_;
  a.bits = static_cast<int>(bits_);
  a.codes = in[kCodes].value.GetTensorData<uint8_t>();
  const bool offsets = in[kOffsets].present;
  if (half) {
    a.half_scales = static_cast<const uint16_t*>(in[kScales].value.GetTensorRawData());
    a.minimums =
        offsets ? static_cast<const uint16_t*>(in[kOffsets].value.GetTensorRawData()) : nullptr;
  } else {
    a.scales = in[kScales].value.GetTensorData<float>();
    a.offsets = offsets ? in[kOffsets].value.GetTensorData<float>() : nullptr;
  }
  a.zeros = in[kZeros].present ? in[kZeros].value.GetTensorData<uint8_t>() : nullptr;
  a.float_x = float_x_;
  a.outputs = static_cast<int>(splits_.size());
  Dims y_shape = x.shape;
  for (int o = 0; o < a.outputs; ++o) {
    y_shape.back() = a.columns[o] = splits_[o];
    a.y[o] = ctx.GetOutput(o, y_shape.data(), y_shape.size()).GetTensorMutableData<float>();
  }
  QuantMatMulCpu(a, OrtParallelFor(ctx));
}

QuantMatMulOp::QuantMatMulOp() { InferOutputShapeFn = InferShape; }

OrtStatusPtr QuantMatMulOp::CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info,
                                           void** kernel) const {
  return GuardCompute("QuantMatMul", [&] { *kernel = new QuantMatMulKernel(api, info); });
}

ONNXTensorElementDataType QuantMatMulOp::GetInputType(size_t index) const {
  if (index == kScales || index == kOffsets)  // float32 or float16: checked at run time
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  return index == kCodes || index == kZeros ? kU8 : kF32;
}

}  // namespace ort_lora
