// CUDA-on-CPU emulator: runs CUDA kernel source compiled by g++ (no nvcc, no cudart, no GPU).
// Included by a .cu file only when ORT_LORA_CUDA_EMU is defined; tests/cuda_emu_build.py builds
// the emulator library. Host code only: the CUDA headers are used for their types (dim3, __half,
// __nv_bfloat16) and their host conversion functions (round to nearest even).
//
// Model: a grid runs block by block on the calling OS thread; a block's threads are fibers
// (ucontext, one reused stack each, with a guard page). Thread 0 runs until it reaches a barrier
// or exits, then thread 1, and so on; then the scheduler releases every barrier whose scope
// waits on it completely:
//   __syncthreads()      the block: every live (not exited) thread of the block waits on it;
//   __shfl_xor_sync(...) the warp: every live lane of the warp waits on a shuffle; the values
//                        are exchanged at release, then the lanes resume.
// If threads remain but no barrier can be released, the launch fails with a deadlock error that
// names the kernel, the block and what each thread waits on (no hang). Because each thread runs
// to its barrier before the next one starts, a missing __syncthreads between a shared-memory
// write and another thread's read gives wrong results. `__shared__` variables are function
// statics (blocks run one after another); the build places the kernel objects' .bss in the
// section "ort_lora_emu_shared", and every block starts with that section poisoned (all bytes
// 0xff: NaN in float, half and bfloat16), so a read of an element no thread wrote shows.
//
// Not modelled: timing, memory coalescing and banks, races between warps inside one barrier
// interval (threads never interleave between barriers), atomics, nvcc's code generation.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>

#undef __shared__
#define __shared__ static
#define __launch_bounds__(...)

namespace ort_lora::emu {

constexpr int kWarpSize = 32;

// The calling fiber's thread index and its launch's dimensions (valid inside a kernel only).
const uint3& ThreadIdx();
const uint3& BlockIdx();
const dim3& BlockDim();
const dim3& GridDim();

void SyncThreads();
// Lane l receives the `bits` of lane l ^ lane_mask (within segments of `width` lanes).
uint64_t ShuffleXor(unsigned mask, uint64_t bits, int lane_mask, int width);

// Runs `body` (one kernel call) for every thread of every block of `grid`. A failure (bad
// configuration, deadlock, bad shuffle) is kept for cudaGetLastError and the remaining blocks
// are not run.
void RunGrid(const char* kernel, dim3 grid, dim3 block, const std::function<void()>& body);

// The message of the last launch failure ("" if none).
const char* LastErrorMessage();

}  // namespace ort_lora::emu

#define threadIdx (::ort_lora::emu::ThreadIdx())
#define blockIdx (::ort_lora::emu::BlockIdx())
#define blockDim (::ort_lora::emu::BlockDim())
#define gridDim (::ort_lora::emu::GridDim())

inline void __syncthreads() { ::ort_lora::emu::SyncThreads(); }

template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = ::ort_lora::emu::kWarpSize) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffle of <= 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  bits = ::ort_lora::emu::ShuffleXor(mask, bits, lane_mask, width);
  std::memcpy(&value, &bits, sizeof(T));
  return value;
}

// kernel<<<grid, block, 0, stream>>>(args...) in emulator builds (shared bytes and stream unused).
#define ORT_LORA_EMU_LAUNCH(kernel, grid, block, ...) \
  ::ort_lora::emu::RunGrid(#kernel, grid, block, [&] { kernel(__VA_ARGS__); })
