// LoraSGMV under the CPU emulator: the C entries the tests call (ctypes). ort_lora_emu_sgmv is
// ort_lora_cuda_sgmv (cuda_runtime_c.cc) with host pointers: the same SgmvCEntry, so the real
// BuildSgmvPlan, the real RunLoraSgmv (plan uploads and reuse per stream, v scratch, the y copy)
// over the emulated runtime (cuda_emu_runtime.cc), then LaunchLoraSgmv, whose kernels run as
// emulated CUDA threads. `stream` is any non-null handle.
#include <cstdint>
#include <string>

#include "cuda/emu/cuda_emu.h"
#include "cuda/sgmv_plan.h"

#define ORT_LORA_EMU_C extern "C" __attribute__((visibility("default")))

namespace {
thread_local std::string g_last_message;
constexpr int kInvalidInput = -1;
}  // namespace

// The message of the last failed call: a validation error (-1), the emulator's message of a
// failed launch, or the message of a failed emulated runtime call.
ORT_LORA_EMU_C const char* ort_lora_emu_error_string(int code) {
  if (code == kInvalidInput) return g_last_message.c_str();
  const char* emu = ort_lora::emu::LastErrorMessage();
  return emu[0] != '\0' ? emu : g_last_message.c_str();
}

// x [num_rows, in], y and y_out [num_rows, out], key_cache and value_cache (`half` elements
// each): host arrays of dtype 0 float16 / 1 bfloat16. Metadata laid out as in the op. Returns 0,
// -1 for invalid input, or the cudaError_t of a failed (emulated) CUDA call.
ORT_LORA_EMU_C int ort_lora_emu_sgmv(ORT_LORA_SGMV_C_PARAMS) {
  return ort_lora::SgmvCEntry(ORT_LORA_SGMV_C_ARGS, g_last_message);
}

// As ort_lora_cuda_sgmv_release_stream and ort_lora_cuda_sgmv_stats.
ORT_LORA_EMU_C int ort_lora_emu_release_stream(void* stream) {
  return ort_lora::ReleaseSgmvStream(static_cast<cudaStream_t>(stream));
}

ORT_LORA_EMU_C void ort_lora_emu_sgmv_stats(uint64_t* out) {
  const ort_lora::SgmvStats s = ort_lora::GetSgmvStats();
  out[0] = s.uploads, out[1] = s.reused, out[2] = s.host_waits, out[3] = s.y_copies;
}
