// CUDA part of the host side of LoraSGMV: the pinned upload ring and RunLoraSgmv (sgmv_plan.h).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

#include "cuda/sgmv_plan.h"

namespace ort_lora {

namespace {

size_t AlignUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

// A small ring of pinned host buffers for plan uploads. A slot is reused only after the event
// recorded behind its last copy has completed (the ring holds 64 slots, so the host may run up to
// 64 LoraSGMV nodes ahead of the GPU). Created lazily on the first launch, never at load;
// intentionally never freed (process lifetime, like ORT's own op objects). One CUDA device per
// process is assumed.
class PinnedRing {
 public:
  cudaError_t Upload(const std::vector<uint8_t>& bytes, void* dst, cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mu_);
    Slot& slot = slots_[next_++ % kSlots];
    if (slot.done != nullptr) {
      if (cudaError_t e = cudaEventSynchronize(slot.done); e != cudaSuccess) return e;
    } else if (cudaError_t e = cudaEventCreateWithFlags(&slot.done, cudaEventDisableTiming);
               e != cudaSuccess) {
      return e;
    }
    if (slot.capacity < bytes.size()) {
      if (slot.host != nullptr) cudaFreeHost(slot.host);
      slot.capacity = std::max<size_t>(AlignUp(bytes.size(), 4096), 16 << 10);
      if (cudaError_t e = cudaHostAlloc(&slot.host, slot.capacity, cudaHostAllocDefault);
          e != cudaSuccess) {
        slot.host = nullptr, slot.capacity = 0;
        return e;
      }
    }
    std::memcpy(slot.host, bytes.data(), bytes.size());
    if (cudaError_t e =
            cudaMemcpyAsync(dst, slot.host, bytes.size(), cudaMemcpyHostToDevice, stream);
        e != cudaSuccess)
      return e;
    return cudaEventRecord(slot.done, stream);
  }

 private:
  static constexpr int kSlots = 64;
  struct Slot {
    void* host = nullptr;
    size_t capacity = 0;
    cudaEvent_t done = nullptr;
  };
  std::mutex mu_;
  Slot slots_[kSlots];
  unsigned next_ = 0;
};

PinnedRing& Ring() {
  static PinnedRing* ring = new PinnedRing();
  return *ring;
}

}  // namespace

cudaError_t RunLoraSgmv(SgmvDtype dtype, const SgmvPlan& plan, const void* x, const void* y,
                        void* y_out, int64_t num_rows, int64_t in_features, int64_t out_features,
                        void* scratch, cudaStream_t stream) {
  const size_t y_bytes = static_cast<size_t>(num_rows) * out_features * 2;
  if (y_bytes > 0 && y_out != y) {
    if (cudaError_t e = cudaMemcpyAsync(y_out, y, y_bytes, cudaMemcpyDeviceToDevice, stream);
        e != cudaSuccess)
      return e;
  }
  if (plan.tiles.empty()) return cudaSuccess;
  if (cudaError_t e = Ring().Upload(plan.Serialize(), scratch, stream); e != cudaSuccess) return e;
  const SgmvArgs args = PlanArgs(plan, scratch, x, y_out, in_features, out_features);
  return LaunchLoraSgmv(dtype, args, stream);
}

}  // namespace ort_lora
