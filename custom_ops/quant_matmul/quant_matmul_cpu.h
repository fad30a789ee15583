// The QuantMatMul CPU kernel: y = x @ W^T for a 4- or 8-bit block-quantized W [N, K] stored in
// column tiles for int8 dot products (VNNI), x quantized to int8 per block as it is read.
// No ONNX Runtime types; the op (quant_matmul_op.h) checks shapes and calls it.
//
// Layout of W (ort_lora/quant_tiles.py writes it): N is cut into tiles of 64 columns (the last
// padded with zero codes and scales), K into blocks of `block_size`, a block into chunks of
// 256 bytes (the tile's 64 columns x 4 bytes). Tile t, block b:
//   codes   4 bits: uint8 [tiles, K / block_size, block_size / 8, 256]: chunk j holds the codes
//           of k = b * block_size + 8 j + (0..7); column c's bytes 4c..4c+3 hold k + i in the
//           low nibble and k + 4 + i in the high one
//           8 bits: uint8 [tiles, K / block_size, block_size / 4, 256]: chunk j holds the codes
//           of k = b * block_size + 4 j + (0..3); column c's bytes 4c..4c+3 hold k + i
//           (either way a 64-byte line is one register of 16 columns, 4 bytes per column as
//           vpdpbusd reads them, and a tile's codes are read in order)
//   scales  float [tiles, K / block_size, 64]
//   zeros   uint8 [tiles, K / block_size, 64] or none: 8 (4 bits), 128 (8 bits)
//   offsets float [tiles, K / block_size, 64] or none: 0
//   W[n, k] = (code - zero) * scale + offset        of n's column and k's block
// or, 4 bits without zeros, a GGUF file's own numbers (Q4_0, Q4_1: 0.625 bytes a weight, not
// 0.75): scales float16, and offsets none or float16 minimums m, the weights at code 0:
//   W[n, k] = code * scale + m = (code - 8) * scale + offset, offset = m + 8 * scale in float32
// (one rounding, so the float32 offsets of the same weights give the same y bit for bit).
// x [M, K] is quantized per block as ONNX Runtime's MatMulNBits does at accuracy_level 4
// (quant.py's quantize_activations): scale amax / 127, codes rint(x * 127 / amax). The offset
// multiplies the float block sums of x (unquantized), as the export's reference does. With
// float_x, x is not quantized (MatMulNBits' accuracy_level 0: a slow path for --verify).
#pragma once

#include <cstdint>

#include "common/parallel_for.h"

namespace ort_lora {

constexpr int64_t kQuantTile = 64;  // columns per tile
constexpr int kMaxOutputs = 3;      // y cut by columns into up to 3 outputs (q/k/v)

struct QuantMatMulArgs {
  const float* x;  // [m, k]
  int64_t m, k, n, block_size;
  int bits;  // 4 or 8: the codes' layout above
  const uint8_t* codes;
  const float* scales;
  const uint8_t* zeros;  // nullptr: 2^(bits - 1)
  const float* offsets;  // nullptr: none
  // float16 (their bits) instead: scales, and minimums for offsets (the layout above); 4 bits
  const uint16_t* half_scales;
  const uint16_t* minimums;
  bool float_x;  // x as it is, not quantized (accuracy_level 0 / 1: --verify's check)
  // y [m, n] cut by columns: output o is y[o] [m, columns[o]] (multiples of kQuantTile but
  // the last), `outputs` of them
  float* y[kMaxOutputs];
  int64_t columns[kMaxOutputs];
  int outputs;
};

void QuantMatMulCpu(const QuantMatMulArgs& a, const ParallelFor& parallel);

}  // namespace ort_lora
