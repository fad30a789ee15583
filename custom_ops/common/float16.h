// IEEE float16 bit patterns as float32, in plain C++ (no ONNX Runtime or ISA types): the
// scalar paths of the kernels that read float16 (LoraSGMV's float16 rows, QuantMatMul's
// float16 scales and minimums); their AVX2 / AVX-512 paths convert lanes with vcvtph2ps.
#pragma once

#include <cstdint>

namespace ort_lora {

// float16 -> float32, exact for every value (subnormals, infinities, NaN).
inline __attribute__((always_inline)) float HalfToFloat(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1Fu, mantissa = bits & 0x3FFu;
  uint32_t w;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float32
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    __builtin_memcpy(&w, &magnitude, sizeof(w));
    w |= sign;
  } else if (exponent == 0x1F) {  // infinity or NaN
    w = sign | 0x7F800000u | (mantissa << 13);
  } else {
    w = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  float f;
  __builtin_memcpy(&f, &w, sizeof(f));
  return f;
}

}  // namespace ort_lora
