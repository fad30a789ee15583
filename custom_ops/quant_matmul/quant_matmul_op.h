// QuantMatMul (domain ort_lora, CPU, float32): y = x @ W^T for a 4- or 8-bit block-quantized
// weight W [N, K] in column tiles for int8 dot products (quant_matmul_cpu.h has the layouts),
// with x quantized to int8 per block as com.microsoft.MatMulNBits does at accuracy_level 4.
//
// Inputs
//    0 x          float [..., K]
//    1 codes      uint8 [ceil(N / 64), K / block_size, block_size * bits / 32, 256]
//                 (4 bits: 8 k per chunk of 256 bytes, two codes a byte; 8 bits: 4 k, one)
//    2 scales     float [ceil(N / 64), K / block_size, 64]
//    3 zeros      uint8 [ceil(N / 64), K / block_size, 64]  optional (absent: 2^(bits - 1))
//    4 offsets    float [ceil(N / 64), K / block_size, 64]  optional (absent: 0)
//                 Or float16 scales and offsets (4 bits, no zeros: a GGUF file's Q4_0 / Q4_1
//                 numbers), the offsets then the minimums m: W = code * scale + m
// Outputs
//    0 y          float [..., N], or with splits its first splits[0] columns
//    1, 2         float [..., splits[1]], [..., splits[2]]: the next columns (with splits)
// Attributes: K, N, block_size (a power of two >= 16), bits (4, the default, or 8),
//             accuracy_level (4, the default: x quantized to int8 per block; 0 or 1: x as it
//             is, float products: a slow path, for --verify), splits (optional, 1 to 3
//             values summing to N, all but the last multiples of 64: y cut by columns into
//             that many outputs, as a Split after it would, without the copy).
// Semantics: ort_lora/export/quant.py (tile_blocks, quantize_activations, dequantize).
#pragma once

#include <vector>

#include "common/ort_common.h"
#include "quant_matmul/quant_matmul_cpu.h"

namespace ort_lora {

struct QuantMatMulKernel {
  QuantMatMulKernel(const OrtApi& api, const OrtKernelInfo* info);
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

 private:
  void Compute(OrtKernelContext* context);
  int64_t k_;
  int64_t n_;
  int64_t block_size_;
  int64_t bits_;
  bool float_x_;
  std::vector<int64_t> splits_;  // the outputs' columns
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
  size_t GetOutputTypeCount() const { return kMaxOutputs; }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t index) const {
    return index == 0 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }
  ONNXTensorElementDataType GetOutputType(size_t) const {
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
};

}  // namespace ort_lora
