// Kernels that check the emulator itself (compiled into the emulator library, tests only):
// a barrier that is there or missing, a warp reduction by shuffles, mismatched barriers
// (deadlock), a shuffle that reads an exited lane, and the host float16 / bfloat16 rounding.
#include <cstdint>

#include "cuda/emu/cuda_emu.h"

#define ORT_LORA_EMU_C extern "C" __attribute__((visibility("default")))

namespace {

// out[t] = in[n - 1 - t] through shared memory; with `sync` false the barrier is missing.
__global__ void ReverseThroughShared(const float* in, float* out, bool sync) {
  __shared__ float s[1024];
  const unsigned t = threadIdx.x, n = blockDim.x;
  s[t] = in[blockIdx.x * n + t];
  if (sync) __syncthreads();
  out[blockIdx.x * n + t] = s[n - 1 - t];
}

// out[warp] = sum of in over the warp's lanes (butterfly reduction, as ShrinkBgmv does).
__global__ void WarpSum(const float* in, float* out) {
  const unsigned t = blockIdx.x * blockDim.x + threadIdx.x;
  float s = in[t];
  for (int d = 16; d > 0; d /= 2) s += __shfl_xor_sync(0xffffffffu, s, d);
  if (threadIdx.x % 32 == 0) out[t / 32] = s;
}

// Lane 0 of warp 0 waits at __syncthreads while the other lanes of its warp shuffle: deadlock.
__global__ void MismatchedBarriers(float* out) {
  float v = static_cast<float>(threadIdx.x);
  if (threadIdx.x == 0)
    __syncthreads();
  else if (threadIdx.x < 32)
    v = __shfl_xor_sync(0xffffffffu, v, 1);
  else
    __syncthreads();
  out[threadIdx.x] = v;
}

// Odd lanes exit; even lanes shuffle with a full mask: reads an exited lane.
__global__ void ShuffleFromExitedLane(float* out) {
  if (threadIdx.x % 2) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.f, 1);
}

}  // namespace

// which: 0 reverse with barrier, 1 reverse without, 2 warp sum, 3 mismatched barriers,
// 4 shuffle from an exited lane. `blocks` blocks of `threads` threads; in/out sized for them.
// Returns the cudaError_t (message: ort_lora_emu_error_string).
ORT_LORA_EMU_C int ort_lora_emu_selftest(int which, const float* in, float* out, int blocks,
                                         int threads) {
  const dim3 grid(blocks), block(threads);
  switch (which) {
    case 0:
    case 1:
      ORT_LORA_EMU_LAUNCH(ReverseThroughShared, grid, block, in, out, which == 0);
      break;
    case 2:
      ORT_LORA_EMU_LAUNCH(WarpSum, grid, block, in, out);
      break;
    case 3:
      ORT_LORA_EMU_LAUNCH(MismatchedBarriers, grid, block, out);
      break;
    case 4:
      ORT_LORA_EMU_LAUNCH(ShuffleFromExitedLane, grid, block, out);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

// The host versions of the conversions the kernels use: float -> T (dtype 0 __float2half_rn,
// 1 __float2bfloat16_rn) -> bits, and the bits back to float (__half2float, __bfloat162float).
ORT_LORA_EMU_C void ort_lora_emu_round(int dtype, const float* in, uint16_t* bits, float* back,
                                       int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (dtype == 0) {
      const __half h = __float2half_rn(in[i]);
      bits[i] = __half_as_ushort(h);
      back[i] = __half2float(h);
    } else {
      const __nv_bfloat16 b = __float2bfloat16_rn(in[i]);
      bits[i] = __bfloat16_as_ushort(b);
      back[i] = __bfloat162float(b);
    }
  }
}
