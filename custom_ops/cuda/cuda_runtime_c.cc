// Small extern "C" CUDA helpers for Python (ctypes, ort_lora/runtime/cuda_pool.py): device
// memory for the pool, pinned staging, streams, events, asynchronous copies, and a direct
// LoraSGMV entry (no ONNX Runtime) for bench/gpu_check.py. Every function returns the
// cudaError_t as an int (0 = success; ort_lora_cuda_error_string names it). Nothing here runs
// at load time: the CUDA runtime (linked statically) opens the driver on the first call.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <string>

#include "cuda/sgmv_plan.h"

#define ORT_LORA_C extern "C" __attribute__((visibility("default")))

namespace {
thread_local std::string g_last_message;  // the message of the last failed ort_lora_cuda_sgmv*
thread_local int g_last_code = 0;         // its return code
}  // namespace

// The message of `code`: that of the last failed ort_lora_cuda_sgmv* call if it returned
// `code` (validation errors are -1; CUDA errors name the failed call), else CUDA's own.
ORT_LORA_C const char* ort_lora_cuda_error_string(int code) {
  if (code != 0 && code == g_last_code && !g_last_message.empty()) return g_last_message.c_str();
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
// laid out as in the op; `stream` must not be null. The same RunLoraSgmv as the op: the plan is
// uploaded unless the stream holds it already, the scratch is the stream's own. Validation
// errors return -1; the message of any failure: ort_lora_cuda_error_string.
ORT_LORA_C int ort_lora_cuda_sgmv(ORT_LORA_SGMV_C_PARAMS) {
  g_last_code = ort_lora::SgmvCEntry(ORT_LORA_SGMV_C_ARGS, g_last_message);
  return g_last_code;
}

// Frees what LoraSGMV keeps for `stream` (plan uploads, v scratch); call before destroying it.
ORT_LORA_C int ort_lora_cuda_sgmv_release_stream(void* stream) {
  return ort_lora::ReleaseSgmvStream(static_cast<cudaStream_t>(stream));
}

// The process's LoraSGMV counters: uploads, reused, host_waits, y_copies (sgmv_plan.h).
ORT_LORA_C int ort_lora_cuda_sgmv_stats(uint64_t* out) {
  const ort_lora::SgmvStats s = ort_lora::GetSgmvStats();
  out[0] = s.uploads, out[1] = s.reused, out[2] = s.host_waits, out[3] = s.y_copies;
  return 0;
}

namespace {

// Device time of `iters` launches of LoraSGMV's kernels, replayed from one CUDA graph (no host
// work between them), in microseconds per launch.
cudaError_t TimeKernels(ort_lora::SgmvDtype dtype, const ort_lora::SgmvArgs& args, int iters,
                        cudaStream_t s, float* us) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  cudaError_t e = cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
  for (int i = 0; e == cudaSuccess && i < iters; ++i) e = ort_lora::LaunchLoraSgmv(dtype, args, s);
  const cudaError_t end = cudaStreamEndCapture(s, &graph);
  if (e == cudaSuccess) e = end;
  if (e == cudaSuccess) e = cudaGraphInstantiate(&exec, graph, 0);
  if (e == cudaSuccess) e = cudaGraphLaunch(exec, s);  // warm-up
  if (e == cudaSuccess) e = cudaEventCreate(&start);
  if (e == cudaSuccess) e = cudaEventCreate(&stop);
  if (e == cudaSuccess) e = cudaEventRecord(start, s);
  if (e == cudaSuccess) e = cudaGraphLaunch(exec, s);
  if (e == cudaSuccess) e = cudaEventRecord(stop, s);
  if (e == cudaSuccess) e = cudaEventSynchronize(stop);
  float ms = 0.f;
  if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, start, stop);
  *us = ms * 1000.f / static_cast<float>(iters);
  if (start != nullptr) cudaEventDestroy(start);
  if (stop != nullptr) cudaEventDestroy(stop);
  if (exec != nullptr) cudaGraphExecDestroy(exec);
  if (graph != nullptr) cudaGraphDestroy(graph);
  return e;
}

}  // namespace

// Timing for bench/gpu_check.py, arguments as ort_lora_cuda_sgmv, then:
//   kernel_us  device time per call of the kernels alone (a CUDA graph of `iters` launches,
//              timed with CUDA events; the plan uploaded once before);
//   host_us    host time per call of the whole entry (validation, plan, upload check, launch),
//              `iters` calls back to back, then a stream synchronize (included).
// The graph's launches accumulate into y_out (values are not checked). Returns as
// ort_lora_cuda_sgmv.
ORT_LORA_C int ort_lora_cuda_sgmv_time(ORT_LORA_SGMV_C_PARAMS, int iters, float* kernel_us,
                                       float* host_us) {
  using namespace ort_lora;
  *kernel_us = *host_us = 0.f;
  if (iters < 1) return g_last_message = "iters must be >= 1", g_last_code = -1;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i)
    if (ort_lora_cuda_sgmv(ORT_LORA_SGMV_C_FORWARD) != 0) return g_last_code;
  const auto s = static_cast<cudaStream_t>(stream);
  if (cudaError_t e = cudaStreamSynchronize(s); e != cudaSuccess) return g_last_code = e;
  const std::chrono::duration<float, std::micro> host = std::chrono::steady_clock::now() - t0;
  *host_us = host.count() / static_cast<float>(iters);
  SgmvArgs args{};
  SgmvPlan plan;
  const SgmvPool pool = ORT_LORA_SGMV_C_POOL;
  try {
    plan = BuildSgmvPlan(ORT_LORA_SGMV_C_META, pool);
    args = PrepareLoraSgmv(plan, pool, x, y, y_out, s);
  } catch (const std::exception& e) {  // the calls above passed: not expected
    g_last_message = e.what();
    return g_last_code = -1;
  }
  if (plan.layer_max_rank == 0) return 0;
  return g_last_code = TimeKernels(static_cast<SgmvDtype>(dtype), args, iters, s, kernel_us);
}
