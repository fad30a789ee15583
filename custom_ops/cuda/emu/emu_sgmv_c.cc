// LoraSGMV under the CPU emulator: the C entry the tests call (ctypes). It mirrors
// ort_lora_cuda_sgmv (cuda_runtime_c.cc) with host pointers: the real BuildSgmvPlan, the plan
// serialized into scratch exactly as uploaded to the device (tiles, row pointers, then v), the
// same SgmvArgs (PlanArgs), then LaunchLoraSgmv, whose kernels run as emulated CUDA threads.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "cuda/emu/cuda_emu.h"
#include "cuda/sgmv_plan.h"

#define ORT_LORA_EMU_C extern "C" __attribute__((visibility("default")))

namespace {

thread_local std::string g_last_message;
constexpr int kInvalidInput = -1;

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

}  // namespace

// The message of the last failed call: a validation error (-1) or an emulated launch failure.
ORT_LORA_EMU_C const char* ort_lora_emu_error_string(int code) {
  if (code == kInvalidInput) return g_last_message.c_str();
  const char* emu = ort_lora::emu::LastErrorMessage();
  return emu[0] != '\0' ? emu : "CUDA error (emulator)";
}

// x [num_rows, in], y and y_out [num_rows, out], key_cache and value_cache (`half` elements
// each): host arrays of dtype 0 float16 / 1 bfloat16. Metadata laid out as in the op. Returns 0,
// -1 for invalid input, or the cudaError_t of a failed emulated launch.
ORT_LORA_EMU_C int ort_lora_emu_sgmv(ORT_LORA_SGMV_C_PARAMS) {
  using namespace ort_lora;
  SgmvPlan plan;
  g_last_message = PlanForCEntry(dtype, ORT_LORA_SGMV_C_METADATA, ORT_LORA_SGMV_C_POOL, plan);
  if (!g_last_message.empty()) return kInvalidInput;
  const size_t y_bytes = static_cast<size_t>(num_rows) * out_features * 2;
  if (y_bytes > 0 && y_out != y) std::memmove(y_out, y, y_bytes);
  if (plan.tiles.empty()) return 0;
  // Device scratch stand-in: 256-aligned like cudaMalloc; v poisoned (NaN) so an unwritten
  // element read by the expand shows.
  const size_t bytes = (plan.ScratchBytes(num_rows) + 255) / 256 * 256;
  std::unique_ptr<void, FreeDeleter> scratch(std::aligned_alloc(256, bytes));
  if (!scratch) return cudaErrorMemoryAllocation;
  std::memset(scratch.get(), 0xff, bytes);
  const std::vector<uint8_t> serialized = plan.Serialize();
  std::memcpy(scratch.get(), serialized.data(), serialized.size());
  const SgmvArgs args = PlanArgs(plan, scratch.get(), x, y_out, in_features, out_features);
  const auto t = static_cast<SgmvDtype>(dtype);
  return LaunchLoraSgmv(t, args, nullptr);
}
