// The one registration file: every op x provider x dtype of the ort_lora domain.
// Loaded with SessionOptions.register_custom_ops_library(path); links no ORT library.
#include <cstdio>
#include <cstdlib>

#include "common/ort_common.h"
#include "lora_sgmv/lora_sgmv_op.h"
#include "paged_attention/paged_attention_op.h"
#include "quant_matmul/quant_matmul_op.h"
#ifdef ORT_LORA_WITH_CUDA
#include "cuda/lora_sgmv_cuda_op.h"
#endif

namespace {

constexpr const char* kDomain = "ort_lora";

// Ops live as long as the process: ORT keeps raw pointers to them in every session.
struct Registry {
  ort_lora::LoraSgmvOp lora_sgmv_cpu;
  ort_lora::PagedAttentionOp paged_attention_cpu;
  ort_lora::QuantMatMulOp quant_matmul_cpu;
#ifdef ORT_LORA_WITH_CUDA
  ort_lora::LoraSgmvCudaOp lora_sgmv_cuda_f16{ort_lora::SgmvDtype::kFloat16};
  ort_lora::LoraSgmvCudaOp lora_sgmv_cuda_bf16{ort_lora::SgmvDtype::kBFloat16};
#endif
};

}  // namespace

namespace ort_lora {

// The runtime's GetTensorElementTypeAndShapeDataReference, or null before ONNX Runtime 1.24 or
// with ORT_LORA_ORT_API below 24 (the highest C API version the ops may use; the tests run the
// ops both ways). The C API's function table only grows, in order, so the entry's place is
// fixed: 414 (after the 285 of API 21 and those versions 22 to 24 added). Asked of runtimes
// 1.24 and later only: GetApi prints an error for a version the runtime does not have.
TensorShapeReferenceFn FindTensorShapeReference(const OrtApiBase* api_base) {
  constexpr unsigned kApi = 24;
  constexpr size_t kEntry = 414;
  const char* cap = std::getenv("ORT_LORA_ORT_API");
  unsigned major = 0, minor = 0;
  if ((cap != nullptr && std::strtoul(cap, nullptr, 10) < kApi) ||
      std::sscanf(api_base->GetVersionString(), "%u.%u", &major, &minor) != 2 ||
      (major == 1 && minor < kApi))
    return nullptr;
  const OrtApi* api = api_base->GetApi(kApi);
  if (api == nullptr) return nullptr;
  return reinterpret_cast<TensorShapeReferenceFn>(reinterpret_cast<void* const*>(api)[kEntry]);
}

}  // namespace ort_lora

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) {
    // Version 1 of the API exists in every runtime: use it to report the mismatch.
    const OrtApi* v1 = api_base->GetApi(1);
    std::string msg = std::string("ort_lora ops need ONNX Runtime API version ") +
                      std::to_string(ORT_API_VERSION) + " or newer; this runtime is " +
                      api_base->GetVersionString();
    return v1 ? v1->CreateStatus(ORT_FAIL, msg.c_str()) : nullptr;
  }
  Ort::InitApi(api);
  ort_lora::TensorShapeReference().store(ort_lora::FindTensorShapeReference(api_base));
  static Registry* registry = new Registry();
  return ort_lora::GuardCompute("RegisterCustomOps", [&] {
    Ort::CustomOpDomain domain(kDomain);
    domain.Add(&registry->lora_sgmv_cpu);
    domain.Add(&registry->paged_attention_cpu);
    domain.Add(&registry->quant_matmul_cpu);
#ifdef ORT_LORA_WITH_CUDA
    // Constructing these calls no CUDA function: the library loads without a GPU or driver.
    domain.Add(&registry->lora_sgmv_cuda_f16);
    domain.Add(&registry->lora_sgmv_cuda_bf16);
#endif
    Ort::UnownedSessionOptions(options).Add(domain);
    // The session options must keep the domain alive; ORT does not copy it.
    domain.release();
  });
}
