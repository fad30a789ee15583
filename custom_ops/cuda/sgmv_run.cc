// CUDA part of the host side of LoraSGMV (sgmv_plan.h): what each stream keeps (the last plan
// uploads and the v scratch), RunLoraSgmv, and the C entries' body. The only file of the op that
// calls the CUDA runtime; the emulator links it against emu/cuda_emu_runtime.cc.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/errors.h"
#include "cuda/sgmv_plan.h"

namespace ort_lora {

namespace {

constexpr int kPlanSlots = 16;  // uploads kept per stream; a step uploads one per LoRA module
constexpr size_t kMinSlotBytes = 16 << 10;
constexpr size_t kMinVBytes = 256 << 10;
constexpr int kInvalidInput = -1;

size_t AlignUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

void Check(cudaError_t e, const char* call) {
  if (e != cudaSuccess)
    throw CudaCallError(
        std::string(call) + " failed: " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e), e);
}

// One upload: the plan's bytes in pinned host memory (what the host compares), their device
// copy, and the event recorded behind the copy (the host memory is rewritten only after it).
struct PlanSlot {
  void* host = nullptr;
  void* device = nullptr;
  size_t capacity = 0;  // bytes of host and of device
  size_t size = 0;      // bytes of the plan held; 0: none
  cudaEvent_t copied = nullptr;
  uint64_t last_use = 0;
};

// What RunLoraSgmv keeps for one stream. Everything is queued on that stream, so device memory
// is reused in stream order: a new upload into a slot, or a new v, runs after every kernel
// queued before it, which includes every kernel that read the old contents.
class StreamState {
 public:
  explicit StreamState(cudaStream_t stream) : stream_(stream) {}
  // The device address of `bytes`: an earlier upload with the same bytes, or a new one.
  const void* Upload(const std::vector<uint8_t>& bytes, SgmvStats& stats);
  // v scratch of at least `bytes`, grown stream-ordered.
  float* V(size_t bytes);
  // Frees everything (synchronizes the stream first); returns the first error.
  cudaError_t Release();

 private:
  PlanSlot& Victim();
  void Grow(PlanSlot& s, size_t bytes);
  cudaStream_t stream_;
  PlanSlot slots_[kPlanSlots];
  uint64_t clock_ = 0;
  void* v_ = nullptr;
  size_t v_capacity_ = 0;
};

const void* StreamState::Upload(const std::vector<uint8_t>& bytes, SgmvStats& stats) {
  ++clock_;
  for (PlanSlot& s : slots_) {
    if (s.size != bytes.size() || std::memcmp(s.host, bytes.data(), bytes.size()) != 0) continue;
    s.last_use = clock_;
    ++stats.reused;
    return s.device;
  }
  PlanSlot& s = Victim();
  if (s.copied == nullptr) {
    Check(cudaEventCreateWithFlags(&s.copied, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  } else if (const cudaError_t q = cudaEventQuery(s.copied); q == cudaErrorNotReady) {
    ++stats.host_waits;  // its copy is still reading the pinned bytes
    Check(cudaEventSynchronize(s.copied), "cudaEventSynchronize (plan slot)");
  } else {
    Check(q, "cudaEventQuery (plan slot)");
  }
  s.size = 0;  // holds no plan until the new copy is queued
  if (s.capacity < bytes.size()) Grow(s, bytes.size());
  std::memcpy(s.host, bytes.data(), bytes.size());
  Check(cudaMemcpyAsync(s.device, s.host, bytes.size(), cudaMemcpyHostToDevice, stream_),
        "cudaMemcpyAsync (plan upload)");
  Check(cudaEventRecord(s.copied, stream_), "cudaEventRecord (plan upload)");
  s.size = bytes.size(), s.last_use = clock_;
  ++stats.uploads;
  return s.device;
}

PlanSlot& StreamState::Victim() {
  PlanSlot* victim = &slots_[0];
  for (PlanSlot& s : slots_)
    if (s.last_use < victim->last_use) victim = &s;
  return *victim;
}

void StreamState::Grow(PlanSlot& s, size_t bytes) {
  const size_t capacity = std::max(AlignUp(bytes, 4096), kMinSlotBytes);
  if (s.host != nullptr) Check(cudaFreeHost(s.host), "cudaFreeHost (plan slot)");
  if (s.device != nullptr) Check(cudaFreeAsync(s.device, stream_), "cudaFreeAsync (plan slot)");
  s.host = s.device = nullptr, s.capacity = 0;
  Check(cudaHostAlloc(&s.host, capacity, cudaHostAllocDefault), "cudaHostAlloc (plan slot)");
  Check(cudaMallocAsync(&s.device, capacity, stream_), "cudaMallocAsync (plan slot)");
  s.capacity = capacity;
}

float* StreamState::V(size_t bytes) {
  if (bytes > v_capacity_) {
    const size_t capacity = std::max({AlignUp(bytes, 4096), 2 * v_capacity_, kMinVBytes});
    if (v_ != nullptr) Check(cudaFreeAsync(v_, stream_), "cudaFreeAsync (v scratch)");
    v_ = nullptr, v_capacity_ = 0;
    Check(cudaMallocAsync(&v_, capacity, stream_), "cudaMallocAsync (v scratch)");
    v_capacity_ = capacity;
  }
  return static_cast<float*>(v_);
}

cudaError_t StreamState::Release() {
  cudaError_t first = cudaSuccess;
  auto keep = [&](cudaError_t e) {
    if (first == cudaSuccess) first = e;
  };
  for (PlanSlot& s : slots_)
    if (s.device != nullptr) keep(cudaFreeAsync(s.device, stream_));
  if (v_ != nullptr) keep(cudaFreeAsync(v_, stream_));
  keep(cudaStreamSynchronize(stream_));  // the copies out of the pinned slots have landed
  for (PlanSlot& s : slots_) {
    if (s.host != nullptr) keep(cudaFreeHost(s.host));
    if (s.copied != nullptr) keep(cudaEventDestroy(s.copied));
    s = PlanSlot{};
  }
  v_ = nullptr, v_capacity_ = 0;
  return first;
}

// Process-wide, like ORT's op objects (never destroyed: ops may run until the process ends).
struct Streams {
  std::mutex mu;
  std::map<cudaStream_t, std::unique_ptr<StreamState>> states;
  SgmvStats stats{};
};

Streams& GetStreams() {
  static Streams* streams = new Streams();
  return *streams;
}

}  // namespace

SgmvArgs PrepareLoraSgmv(const SgmvPlan& plan, const SgmvPool& pool, const void* x, const void* y,
                         void* y_out, cudaStream_t stream) {
  if (stream == nullptr)
    Fail("the CUDA stream is null: LoraSGMV(CUDA) runs only on an explicit stream (ORT's compute ",
         "stream), never on the legacy default stream, which is not ordered with it");
  thread_local std::vector<uint8_t> bytes;
  if (plan.layer_max_rank > 0) plan.Serialize(bytes);
  Streams& g = GetStreams();
  const std::lock_guard<std::mutex> lock(g.mu);
  const size_t y_bytes = static_cast<size_t>(plan.meta.num_rows) * plan.meta.out_features * 2;
  if (y_bytes > 0 && y_out != y) {
    Check(cudaMemcpyAsync(y_out, y, y_bytes, cudaMemcpyDeviceToDevice, stream),
          "cudaMemcpyAsync (y -> y_out)");
    ++g.stats.y_copies;
  }
  if (plan.layer_max_rank == 0) return SgmvArgs{};  // no row has an adapter at this layer
  std::unique_ptr<StreamState>& state = g.states[stream];
  if (!state) state = std::make_unique<StreamState>(stream);
  const void* device_plan = state->Upload(bytes, g.stats);
  return PlanArgs(plan, device_plan, state->V(plan.VBytes()), pool, x, y_out);
}

void RunLoraSgmv(SgmvDtype dtype, const SgmvPlan& plan, const SgmvPool& pool, const void* x,
                 const void* y, void* y_out, cudaStream_t stream) {
  const SgmvArgs args = PrepareLoraSgmv(plan, pool, x, y, y_out, stream);
  if (plan.layer_max_rank > 0) Check(LaunchLoraSgmv(dtype, args, stream), "LoraSGMV kernels");
}

cudaError_t ReleaseSgmvStream(cudaStream_t stream) {
  Streams& g = GetStreams();
  const std::lock_guard<std::mutex> lock(g.mu);
  auto it = g.states.find(stream);
  if (it == g.states.end()) return cudaSuccess;
  const cudaError_t e = it->second->Release();
  g.states.erase(it);
  return e;
}

SgmvStats GetSgmvStats() {
  Streams& g = GetStreams();
  const std::lock_guard<std::mutex> lock(g.mu);
  return g.stats;
}

int SgmvCEntry(int dtype, const void* x, const void* y, void* y_out, const SgmvPool& pool,
               const SgmvMetadata& meta, cudaStream_t stream, std::string& message) {
  message.clear();
  if (dtype != static_cast<int>(SgmvDtype::kFloat16) &&
      dtype != static_cast<int>(SgmvDtype::kBFloat16)) {
    message = "dtype must be 0 (float16) or 1 (bfloat16), got " + std::to_string(dtype);
    return kInvalidInput;
  }
  try {
    const SgmvPlan plan = BuildSgmvPlan(meta, pool);
    RunLoraSgmv(static_cast<SgmvDtype>(dtype), plan, pool, x, y, y_out, stream);
  } catch (const InputError& e) {
    message = e.what();
    return kInvalidInput;
  } catch (const CudaCallError& e) {
    message = e.what();
    return static_cast<int>(e.code);
  }
  return 0;
}

}  // namespace ort_lora
