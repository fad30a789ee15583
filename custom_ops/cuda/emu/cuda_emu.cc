// CUDA-on-CPU emulator: fibers, barriers and the grid launcher (see cuda_emu.h).
#include "cuda/emu/cuda_emu.h"

#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

// The kernel objects' .bss, renamed by the build (tests/cuda_emu_build.py): all __shared__ data.
extern "C" char __start_ort_lora_emu_shared[] __attribute__((weak));
extern "C" char __stop_ort_lora_emu_shared[] __attribute__((weak));

namespace ort_lora::emu {
namespace {

constexpr size_t kStackBytes = 32 << 10;  // per fiber; the kernels use < 1 KiB (reported)
constexpr size_t kGuardBytes = 4096;      // PROT_NONE below each stack: overflow faults
constexpr unsigned char kStackPaint = 0xa5;
constexpr int kMaxThreads = 1024;

enum class Wait { kReady, kSync, kShuffle, kExited };

struct Fiber {
  ucontext_t ctx;
  uint3 tid;
  Wait wait = Wait::kExited;
  unsigned mask = 0;  // shuffle arguments and result
  int lane_mask = 0, width = 0;
  uint64_t bits = 0, result = 0;
};

struct Device {
  std::vector<Fiber> fibers;
  char* stacks = nullptr;  // kMaxThreads x (guard, stack), reserved once
  int painted = 0;         // stacks [0, painted) are guarded and painted (first use)
  ucontext_t scheduler;
  Fiber* current = nullptr;
  const std::function<void()>* body = nullptr;
  uint3 block_idx{};
  dim3 block_dim, grid_dim;
  cudaError_t error = cudaSuccess;
  std::string message;
  uint64_t switches = 0;
};

Device& Dev() {
  static thread_local Device device;
  return device;
}

char* StackBase(Device& d, int i) {
  return d.stacks + i * (kGuardBytes + kStackBytes) + kGuardBytes;
}

bool AllocateStacks(Device& d, int n) {
  if (d.stacks == nullptr) {
    const size_t bytes = kMaxThreads * (kGuardBytes + kStackBytes);
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return false;
    d.stacks = static_cast<char*>(p);
    d.fibers.resize(kMaxThreads);
  }
  for (; d.painted < n; ++d.painted) {
    if (mprotect(StackBase(d, d.painted) - kGuardBytes, kGuardBytes, PROT_NONE) != 0) return false;
    std::memset(StackBase(d, d.painted), kStackPaint, kStackBytes);
  }
  return true;
}

void FiberMain() {
  Device& d = Dev();
  (*d.body)();
  d.current->wait = Wait::kExited;
  swapcontext(&d.current->ctx, &d.scheduler);  // never resumed
}

// Suspends the running fiber until the scheduler releases its barrier.
void Suspend(Wait wait) {
  Device& d = Dev();
  d.current->wait = wait;
  swapcontext(&d.current->ctx, &d.scheduler);
}

void Fail(cudaError_t code, const std::string& message) {
  Device& d = Dev();
  if (d.error == cudaSuccess) d.error = code, d.message = message;
}

std::string Where(const char* kernel) {
  const Device& d = Dev();
  std::ostringstream os;
  os << kernel << " block (" << d.block_idx.x << ", " << d.block_idx.y << ", " << d.block_idx.z
     << ")";
  return os.str();
}

int NumThreads(const dim3& b) { return static_cast<int>(b.x * b.y * b.z); }

// Releases the shuffle of warp [begin, end) if all its live lanes wait on one. Returns false
// (with the error set) if the shuffle is malformed.
enum class Release { kNone, kReleased, kError };

Release ReleaseWarp(const char* kernel, int begin, int end) {
  Device& d = Dev();
  unsigned live = 0, waiting = 0;
  for (int t = begin; t < end; ++t) {
    const Wait w = d.fibers[t].wait;
    if (w != Wait::kExited) live |= 1u << (t - begin);
    if (w == Wait::kShuffle) waiting |= 1u << (t - begin);
  }
  if (waiting == 0 || waiting != live) return Release::kNone;
  for (int t = begin; t < end; ++t) {
    Fiber& f = d.fibers[t];
    if (f.wait != Wait::kShuffle) continue;
    const int lane = t - begin;
    const bool width_ok = f.width > 0 && f.width <= kWarpSize && (f.width & (f.width - 1)) == 0;
    int src = lane ^ (f.lane_mask & (kWarpSize - 1));          // PTX shfl.bfly: a source past the
    if (width_ok && src > (lane | (f.width - 1))) src = lane;  // lane's segment: its own value
    const bool ok =
        width_ok && (f.mask & live) == f.mask && (f.mask >> lane & 1u) && (f.mask >> src & 1u);
    if (!ok) {
      std::ostringstream os;
      os << Where(kernel) << ": thread " << t << " __shfl_xor_sync mask 0x" << std::hex << f.mask
         << " width " << std::dec << f.width << " must name its own lane and source lane " << src
         << ", all waiting on the shuffle (live lanes 0x" << std::hex << live
         << "), width a power of 2 <= 32";
      Fail(cudaErrorLaunchFailure, os.str());
      return Release::kError;
    }
    f.result = d.fibers[begin + src].bits;
  }
  for (int t = begin; t < end; ++t)
    if (d.fibers[t].wait == Wait::kShuffle) d.fibers[t].wait = Wait::kReady;
  return Release::kReleased;
}

std::string DeadlockMessage(const char* kernel, int n) {
  const Device& d = Dev();
  int sync = 0, shuffle = 0, exited = 0;
  for (int t = 0; t < n; ++t) {
    const Wait w = d.fibers[t].wait;
    sync += w == Wait::kSync, shuffle += w == Wait::kShuffle, exited += w == Wait::kExited;
  }
  std::ostringstream os;
  os << Where(kernel) << ": deadlock (mismatched barriers): " << sync
     << " threads wait at __syncthreads, " << shuffle << " at __shfl_xor_sync (their warps' other "
     << "live lanes do not), " << exited << " exited";
  return os.str();
}

// Releases every barrier that can be; false if none could (deadlock) or a shuffle was bad.
bool ReleaseBarriers(const char* kernel, int n) {
  Device& d = Dev();
  bool released = false;
  for (int w = 0; w < n; w += kWarpSize) {
    const Release r = ReleaseWarp(kernel, w, std::min(n, w + kWarpSize));
    if (r == Release::kError) return false;
    released |= r == Release::kReleased;
  }
  int live = 0, sync = 0;
  for (int t = 0; t < n; ++t)
    live += d.fibers[t].wait != Wait::kExited, sync += d.fibers[t].wait == Wait::kSync;
  if (sync > 0 && sync == live) {
    for (int t = 0; t < n; ++t)
      if (d.fibers[t].wait == Wait::kSync) d.fibers[t].wait = Wait::kReady;
    released = true;
  }
  if (!released) Fail(cudaErrorLaunchFailure, DeadlockMessage(kernel, n));
  return released;
}

void StartFiber(Device& d, int t) {
  Fiber& f = d.fibers[t];
  const dim3& b = d.block_dim;
  f.tid = {t % b.x, t / b.x % b.y, t / (b.x * b.y)};
  f.wait = Wait::kReady;
  getcontext(&f.ctx);
  f.ctx.uc_stack.ss_sp = StackBase(d, t);
  f.ctx.uc_stack.ss_size = kStackBytes;
  f.ctx.uc_link = nullptr;
  makecontext(&f.ctx, FiberMain, 0);
}

bool RunBlock(const char* kernel) {
  Device& d = Dev();
  char* const shared = __start_ort_lora_emu_shared;
  if (shared != nullptr) std::memset(shared, 0xff, __stop_ort_lora_emu_shared - shared);
  const int n = NumThreads(d.block_dim);
  for (int t = 0; t < n; ++t) StartFiber(d, t);
  for (;;) {
    bool any_live = false;
    for (int t = 0; t < n; ++t) {
      Fiber& f = d.fibers[t];
      if (f.wait == Wait::kReady) {
        d.current = &f;
        swapcontext(&d.scheduler, &f.ctx);
        ++d.switches;
      }
      any_live |= f.wait != Wait::kExited;
    }
    if (!any_live) return true;
    if (!ReleaseBarriers(kernel, n)) return false;
  }
}

bool CheckConfig(const char* kernel, const dim3& grid, const dim3& block) {
  std::ostringstream os;
  if (block.x == 0 || block.y == 0 || block.z == 0 || NumThreads(block) > kMaxThreads)
    os << "block (" << block.x << ", " << block.y << ", " << block.z << ") must have 1.."
       << kMaxThreads << " threads";
  else if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > INT32_MAX || grid.y > 65535 ||
           grid.z > 65535)
    os << "grid (" << grid.x << ", " << grid.y << ", " << grid.z
       << ") must be in [1, 2^31 - 1] x [1, 65535] x [1, 65535]";
  else
    return true;
  Fail(cudaErrorInvalidConfiguration, std::string(kernel) + ": " + os.str());
  return false;
}

}  // namespace

const uint3& ThreadIdx() { return Dev().current->tid; }
const uint3& BlockIdx() { return Dev().block_idx; }
const dim3& BlockDim() { return Dev().block_dim; }
const dim3& GridDim() { return Dev().grid_dim; }

void SyncThreads() { Suspend(Wait::kSync); }

uint64_t ShuffleXor(unsigned mask, uint64_t bits, int lane_mask, int width) {
  Fiber& f = *Dev().current;
  f.mask = mask, f.bits = bits, f.lane_mask = lane_mask, f.width = width;
  Suspend(Wait::kShuffle);
  return f.result;
}

void RunGrid(const char* kernel, dim3 grid, dim3 block, const std::function<void()>& body) {
  static std::mutex shared_memory;  // one section for all: one launch at a time per process
  const std::lock_guard<std::mutex> lock(shared_memory);
  Device& d = Dev();
  if (d.error != cudaSuccess) return;  // an earlier launch failed and nobody asked yet
  d.message.clear();
  if (!CheckConfig(kernel, grid, block)) return;
  if (!AllocateStacks(d, NumThreads(block)))
    return Fail(cudaErrorMemoryAllocation, "emulator: fiber stacks");
  d.body = &body, d.grid_dim = grid, d.block_dim = block;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        d.block_idx = {x, y, z};
        if (!RunBlock(kernel)) return;
      }
}

const char* LastErrorMessage() { return Dev().message.c_str(); }

}  // namespace ort_lora::emu

// The emulator's cudaGetLastError: returns and clears the last launch failure.
cudaError_t cudaGetLastError() {
  auto& d = ort_lora::emu::Dev();
  const cudaError_t e = d.error;
  d.error = cudaSuccess;
  return e;
}

#define ORT_LORA_EMU_C extern "C" __attribute__((visibility("default")))

// Fiber context switches so far, the deepest stack use of any fiber, and the stack size.
ORT_LORA_EMU_C void ort_lora_emu_stats(uint64_t* switches, uint64_t* stack_used,
                                       uint64_t* stack_bytes) {
  auto& d = ort_lora::emu::Dev();
  using ort_lora::emu::kStackBytes;
  size_t used = 0;
  for (int i = 0; i < d.painted; ++i) {
    const char* base = ort_lora::emu::StackBase(d, i);
    size_t untouched = 0;
    while (untouched < kStackBytes &&
           static_cast<unsigned char>(base[untouched]) == ort_lora::emu::kStackPaint)
      ++untouched;
    used = std::max(used, kStackBytes - untouched);
  }
  *switches = d.switches, *stack_used = used, *stack_bytes = kStackBytes;
}

// Bytes of the poisoned __shared__ section (all kernels' shared arrays).
ORT_LORA_EMU_C uint64_t ort_lora_emu_shared_bytes() {
  return __stop_ort_lora_emu_shared - __start_ort_lora_emu_shared;
}
