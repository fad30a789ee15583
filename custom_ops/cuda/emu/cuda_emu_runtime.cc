// The CUDA runtime calls of sgmv_run.cc, emulated on the host for the emulator library (tests
// only): "device" and pinned memory are host allocations (fresh memory is poisoned, 0xff: NaN in
// float, half and bfloat16), copies are done when queued, streams are opaque handles. Every call
// is logged with its stream, and allocations and events are counted, so tests can check which
// stream each call used and that a release frees everything. With pending events on, a recorded
// event stays not ready until cudaEventSynchronize: a test can see when the host would wait.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "cuda/emu/cuda_emu.h"

namespace {

struct EmuEvent {
  bool pending = false;
};

struct Runtime {
  std::mutex mu;
  std::vector<std::pair<std::string, const void*>> log;  // (call, stream or nullptr)
  std::set<void*> device, host;
  std::set<EmuEvent*> events;
  bool pending_events = false;
};

Runtime& Rt() {
  static Runtime* rt = new Runtime();
  return *rt;
}

void Log(Runtime& rt, const char* call, const void* stream) { rt.log.emplace_back(call, stream); }

void* Allocate(std::set<void*>& live, size_t bytes) {
  void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
  if (p == nullptr) return nullptr;
  std::memset(p, 0xff, bytes);
  live.insert(p);
  return p;
}

// Logs `call`, then runs body(runtime, event) under the lock; an unknown event is an error.
template <typename Body>
cudaError_t OnEvent(const char* call, cudaEvent_t event, const void* stream, Body body) {
  Runtime& rt = Rt();
  const std::lock_guard<std::mutex> lock(rt.mu);
  Log(rt, call, stream);
  auto* e = reinterpret_cast<EmuEvent*>(event);
  if (rt.events.count(e) == 0) return cudaErrorInvalidValue;
  return body(rt, e);
}

cudaError_t Release(std::set<void*>& live, void* p) {
  if (live.erase(p) == 0) return cudaErrorInvalidValue;
  std::free(p);
  return cudaSuccess;
}

}  // namespace

// A name for every error the tests can meet; the emulator's message of a failed launch.
const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration:
      return "cudaErrorInvalidConfiguration";
    case cudaErrorNotReady:
      return "cudaErrorNotReady";
    default:
      return "cudaError(emulator)";
  }
}

const char* cudaGetErrorString(cudaError_t error) {
  const char* launch = ort_lora::emu::LastErrorMessage();
  return error != cudaSuccess && launch[0] != '\0' ? launch : cudaGetErrorName(error);
}

cudaError_t cudaMallocAsync(void** ptr, size_t bytes, cudaStream_t stream) {
  Runtime& rt = Rt();
  const std::lock_guard<std::mutex> lock(rt.mu);
  Log(rt, "cudaMallocAsync", stream);
  *ptr = Allocate(rt.device, bytes);
  return *ptr != nullptr ? cudaSuccess : cudaErrorMemoryAllocation;
}

cudaError_t cudaFreeAsync(void* ptr, cudaStream_t stream) {
  Runtime& rt = Rt();
  const std::lock_guard<std::mutex> lock(rt.mu);
  Log(rt, "cudaFreeAsync", stream);
  return Release(rt.device, ptr);
}

cudaError_t cudaHostAlloc(void** ptr, size_t bytes, unsigned int) {
  Runtime& rt = Rt();
  const std::lock_guard<std::mutex> lock(rt.mu);
  Log(rt, "cudaHostAlloc", nullptr);
  *ptr = Allocate(rt.host, bytes);
  return *ptr != nullptr ? cudaSuccess : cudaErrorMemoryAllocation;
}

cudaError_t cudaFreeHost(void* ptr) {
  Runtime& rt = Rt();
  const std::lock_guard<std::mutex> lock(rt.mu);
  Log(rt, "cudaFreeHost", nullptr);
  return Release(rt.host, ptr);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  Runtime& rt = Rt();
  const std::lock_guard<std::mutex> lock(rt.mu);
  Log(rt, kind == cudaMemcpyHostToDevice ? "cudaMemcpyAsync H2D" : "cudaMemcpyAsync D2D", stream);
  std::memmove(dst, src, bytes);
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  Runtime& rt = Rt();
  const std::lock_guard<std::mutex> lock(rt.mu);
  Log(rt, "cudaStreamSynchronize", stream);
  for (EmuEvent* e : rt.events) e->pending = false;  // this stream's events among them
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) {
  Runtime& rt = Rt();
  const std::lock_guard<std::mutex> lock(rt.mu);
  Log(rt, "cudaEventCreateWithFlags", nullptr);
  auto* e = new EmuEvent();
  rt.events.insert(e);
  *event = reinterpret_cast<cudaEvent_t>(e);
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  return OnEvent("cudaEventDestroy", event, nullptr, [](Runtime& rt, EmuEvent* e) {
    rt.events.erase(e);
    delete e;
    return cudaSuccess;
  });
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  return OnEvent("cudaEventRecord", event, stream, [](Runtime& rt, EmuEvent* e) {
    e->pending = rt.pending_events;
    return cudaSuccess;
  });
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  return OnEvent("cudaEventQuery", event, nullptr, [](Runtime&, EmuEvent* e) {
    return e->pending ? cudaErrorNotReady : cudaSuccess;
  });
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  return OnEvent("cudaEventSynchronize", event, nullptr, [](Runtime&, EmuEvent* e) {
    e->pending = false;
    return cudaSuccess;
  });
}

#define ORT_LORA_EMU_C extern "C" __attribute__((visibility("default")))

// Clears the call log; `pending_events` sets whether recorded events stay not ready.
ORT_LORA_EMU_C void ort_lora_emu_runtime_reset(int pending_events) {
  Runtime& rt = Rt();
  const std::lock_guard<std::mutex> lock(rt.mu);
  rt.log.clear();
  rt.pending_events = pending_events != 0;
}

// Calls named `call` logged since the reset: on `stream`, or on any stream if `any_stream`.
ORT_LORA_EMU_C uint64_t ort_lora_emu_runtime_count(const char* call, const void* stream,
                                                   int any_stream) {
  Runtime& rt = Rt();
  const std::lock_guard<std::mutex> lock(rt.mu);
  uint64_t n = 0;
  for (const auto& [name, s] : rt.log) n += name == call && (any_stream || s == stream);
  return n;
}

// Live device allocations, pinned host allocations and events.
ORT_LORA_EMU_C void ort_lora_emu_runtime_live(uint64_t* out) {
  Runtime& rt = Rt();
  const std::lock_guard<std::mutex> lock(rt.mu);
  out[0] = rt.device.size(), out[1] = rt.host.size(), out[2] = rt.events.size();
}
