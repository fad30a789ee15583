// The one registration file: every op x provider x dtype of the ort_lora domain.
// Loaded with SessionOptions.register_custom_ops_library(path); links no ORT library.
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
