// Small extern "C" CUDA helpers for Python (ctypes, ort_lora/runtime/cuda_pool.py): device
// memory for the pool, pinned staging, streams, events, asynchronous copies, and a direct
// LoraSGMV entry (no ONNX Runtime) for bench/gpu_check.py. Every function returns the
// cudaError_t as an int (0 = success; ort_lora_cuda_error_string names it). Nothing here runs
// at load time: the CUDA runtime (linked statically) opens the driver on the first call.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "cuda/sgmv_plan.h"

#define ORT_LORA_C extern "C" __attribute__((visibility("default")))

namespace {
thread_local std::string g_last_message;  // the message of the last ort_lora_cuda_sgmv error
constexpr int kInvalidInput = -1;
}  // namespace

ORT_LORA_C const char* ort_lora_cuda_error_string(int code) {
  if (code == kInvalidInput) return g_last_message.c_str();
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
ORT_LORA_C int ort_lora_cuda_device_count(int* n) { return cudaGetDeviceCount(n); }
ORT_LORA_C int ort_lora_cuda_set_device(int device) { return cudaSetDevice(device); }
ORT_LORA_C int ort_lora_cuda_malloc(void** ptr, uint64_t bytes) { return cudaMalloc(ptr, bytes); }
ORT_LORA_C int ort_lora_cuda_free(void* ptr) { return cudaFree(ptr); }
ORT_LORA_C int ort_lora_cuda_host_alloc(void** ptr, uint64_t bytes) {
  return cudaHostAlloc(ptr, bytes, cudaHostAllocDefault);
}
ORT_LORA_C int ort_lora_cuda_host_free(void* ptr) { return cudaFreeHost(ptr); }
ORT_LORA_C int ort_lora_cuda_memset(void* ptr, int value, uint64_t bytes) {
  return cudaMemset(ptr, value, bytes);
}
ORT_LORA_C int ort_lora_cuda_stream_create(void** stream) {
  return cudaStreamCreateWithFlags(reinterpret_cast<cudaStream_t*>(stream), cudaStreamNonBlocking);
}
ORT_LORA_C int ort_lora_cuda_stream_destroy(void* s) {
  return cudaStreamDestroy(static_cast<cudaStream_t>(s));
}
ORT_LORA_C int ort_lora_cuda_stream_synchronize(void* s) {
  return cudaStreamSynchronize(static_cast<cudaStream_t>(s));
}
ORT_LORA_C int ort_lora_cuda_stream_wait_event(void* s, void* e) {
  return cudaStreamWaitEvent(static_cast<cudaStream_t>(s), static_cast<cudaEvent_t>(e), 0);
}
ORT_LORA_C int ort_lora_cuda_event_create(void** e) {
  return cudaEventCreateWithFlags(reinterpret_cast<cudaEvent_t*>(e), cudaEventDisableTiming);
}
ORT_LORA_C int ort_lora_cuda_event_record(void* e, void* s) {
  return cudaEventRecord(static_cast<cudaEvent_t>(e), static_cast<cudaStream_t>(s));
}
// 0: complete, cudaErrorNotReady (600): still pending, anything else: an error.
ORT_LORA_C int ort_lora_cuda_event_query(void* e) {
  return cudaEventQuery(static_cast<cudaEvent_t>(e));
}
ORT_LORA_C int ort_lora_cuda_event_synchronize(void* e) {
  return cudaEventSynchronize(static_cast<cudaEvent_t>(e));
}
ORT_LORA_C int ort_lora_cuda_event_destroy(void* e) {
  return cudaEventDestroy(static_cast<cudaEvent_t>(e));
}
// kind: 1 host->device, 2 device->host, 3 device->device (cudaMemcpyKind).
ORT_LORA_C int ort_lora_cuda_memcpy_async(void* dst, const void* src, uint64_t bytes, int kind,
                                          void* s) {
  return cudaMemcpyAsync(dst, src, bytes, static_cast<cudaMemcpyKind>(kind),
                         static_cast<cudaStream_t>(s));
}
// `height` rows of `width` bytes, rows `dpitch` / `spitch` bytes apart.
ORT_LORA_C int ort_lora_cuda_memcpy_2d_async(void* dst, uint64_t dpitch, const void* src,
                                             uint64_t spitch, uint64_t width, uint64_t height,
                                             int kind, void* s) {
  return cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height,
                           static_cast<cudaMemcpyKind>(kind), static_cast<cudaStream_t>(s));
}

// LoraSGMV without ONNX Runtime, for checks and benchmarks: x, y, y_out, key_cache and
// value_cache are device pointers (dtype 0 float16, 1 bfloat16); the metadata is on the host,
// laid out as in the op. Validation errors return -1 (message: ort_lora_cuda_error_string).
// Scratch is cudaMallocAsync'd and freed on `stream`.
ORT_LORA_C int ort_lora_cuda_sgmv(ORT_LORA_SGMV_C_PARAMS, void* stream) {
  using namespace ort_lora;
  SgmvPlan plan;
  g_last_message = PlanForCEntry(dtype, ORT_LORA_SGMV_C_METADATA, ORT_LORA_SGMV_C_POOL, plan);
  if (!g_last_message.empty()) return kInvalidInput;
  auto s = static_cast<cudaStream_t>(stream);
  void* scratch = nullptr;
  if (!plan.tiles.empty()) {
    if (cudaError_t e = cudaMallocAsync(&scratch, plan.ScratchBytes(num_rows), s); e != cudaSuccess)
      return e;
  }
  const auto t = static_cast<SgmvDtype>(dtype);
  cudaError_t err =
      RunLoraSgmv(t, plan, x, y, y_out, num_rows, in_features, out_features, scratch, s);
  if (scratch != nullptr) {
    const cudaError_t free_err = cudaFreeAsync(scratch, s);
    if (err == cudaSuccess) err = free_err;
  }
  return err;
}
