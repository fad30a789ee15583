// The one error type of ort_lora's C++ code and the helper that throws it. No ONNX Runtime or
// CUDA types: the CUDA host plan (cuda/sgmv_plan.cc) uses it in builds without ORT (the CPU
// emulator, the C entries); ort_common.h adds the conversion to an ORT status.
#pragma once

#include <sstream>
#include <stdexcept>

namespace ort_lora {

// Thrown for bad inputs: the message names the input and the expected value. The op boundary
// (GuardCompute) turns it into ORT_INVALID_ARGUMENT, "<Op>: <message>"; the C entries return
// its message. A std::invalid_argument, so code without this header can catch it too.
struct InputError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// Throws InputError with the arguments streamed one after another.
template <typename... Args>
[[noreturn]] void Fail(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  throw InputError(os.str());
}

}  // namespace ort_lora
