// QuantMatMul (domain ort_lora, CPU, float32): y = x @ W^T for a 4-bit block-quantized weight
// W [N, K] in column tiles for int8 dot products (quant_matmul_cpu.h has the layout), with
// x quantized to int8 per block as com.microsoft.MatMulNBits does at accuracy_level 4.
//
// Inputs
//    0 x          float [..., K]
//    1 codes      uint8 [ceil(N / 64), K / block_size, block_size / 8, 256]
//    2 scales     float [ceil(N / 64), K / block_size, 64]
//    3 zeros      uint8 [ceil(N / 64), K / block_size, 64]  optional (absent: 8)
//    4 offsets    float [ceil(N / 64), K / block_size, 64]  optional (absent: 0)
// Outputs
//    0 y          float [..., N]
// Attributes: K, N, block_size (a power of two >= 16), bits (4, the only value),
//             accuracy_level (4, the default: x quantized to int8 per block; 0 or 1: x as it
//             is, float products: a slow path, for --verify).
// Semantics: ort_lora/export/quant.py (tile_blocks, quantize_activations, dequantize).
#pragma once

#include "common/ort_common.h"

namespace ort_lora {

struct QuantMatMulKernel {
  QuantMatMulKernel(const OrtApi& api, const OrtKernelInfo* info);
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

 private:
  void Compute(OrtKernelContext* context);
  int64_t k_;
  int64_t n_;
  int64_t block_size_;
  bool float_x_;
};

struct QuantMatMulOp : Ort::CustomOpBase<QuantMatMulOp, QuantMatMulKernel, true> {
  QuantMatMulOp();
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const;
  const char* GetName() const { return "QuantMatMul"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 5; }
  ONNXTensorElementDataType GetInputType(size_t index) const;
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index <= 2 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const {
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
};

}  // namespace ort_lora
