// Host part of the CUDA LoraSGMV: validation, plan, serialization. No CUDA runtime calls (the
// CPU emulator links this file; the upload and launch are in sgmv_run.cc).
#include "cuda/sgmv_plan.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <string>

#include "common/errors.h"

namespace ort_lora {

namespace {

constexpr SgmvRankLimit kRankLimit{kMaxCudaRank, "over the CUDA kernel's limit"};

size_t AlignUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

}  // namespace

std::vector<uint8_t> SgmvPlan::Serialize() const {
  std::vector<uint8_t> bytes(RowPtrsOffset() + row_ptrs.size() * sizeof(void*));
  if (!tiles.empty()) std::memcpy(bytes.data(), tiles.data(), tiles.size() * sizeof(SgmvTile));
  if (!row_ptrs.empty())
    std::memcpy(bytes.data() + RowPtrsOffset(), row_ptrs.data(), row_ptrs.size() * sizeof(void*));
  return bytes;
}

size_t SgmvPlan::RowPtrsOffset() const { return AlignUp(tiles.size() * sizeof(SgmvTile), 8); }

size_t SgmvPlan::ScratchBytes(int64_t num_rows) const {
  const size_t plan = AlignUp(RowPtrsOffset() + row_ptrs.size() * sizeof(void*), 256);
  return plan + static_cast<size_t>(num_rows) * max_rank * sizeof(float);
}

SgmvPlan BuildSgmvPlan(const SgmvMetadata& m, const SgmvPool& pool) {
  CheckSgmvLayer(m);
  if (m.num_rows > INT32_MAX) Fail("x has ", m.num_rows, " rows; the CUDA kernel takes < 2^31");
  SgmvPlan plan;
  const std::vector<SgmvActiveSegment> active =
      CheckSgmvSegments(m, pool, kRankLimit, plan.row_ptrs);
  std::vector<SgmvTile> bgmv;
  for (const SgmvActiveSegment& a : active) {
    for (int32_t r = a.row_begin; r < a.row_end; r += kTileRows) {
      const int32_t n = std::min<int32_t>(kTileRows, a.row_end - r);
      const SgmvTile tile{r, n, static_cast<int32_t>(a.rank), static_cast<int32_t>(a.rows),
                          a.scale};
      (n <= kBgmvMaxRows ? bgmv : plan.tiles).push_back(tile);
    }
    plan.max_rank = std::max<int32_t>(plan.max_rank, static_cast<int32_t>(a.rank));
  }
  plan.num_sgmv_tiles = static_cast<int32_t>(plan.tiles.size());
  plan.tiles.insert(plan.tiles.end(), bgmv.begin(), bgmv.end());
  return plan;
}

std::string PlanForCEntry(int dtype, const SgmvMetadata& meta, const SgmvPool& pool,
                          SgmvPlan& plan) {
  if (dtype != static_cast<int>(SgmvDtype::kFloat16) &&
      dtype != static_cast<int>(SgmvDtype::kBFloat16))
    return "dtype must be 0 (float16) or 1 (bfloat16), got " + std::to_string(dtype);
  try {
    plan = BuildSgmvPlan(meta, pool);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

SgmvArgs PlanArgs(const SgmvPlan& plan, void* scratch, const void* x, void* y_out,
                  int64_t in_features, int64_t out_features) {
  auto* base = static_cast<uint8_t*>(scratch);
  return SgmvArgs{x,
                  y_out,
                  reinterpret_cast<float*>(base + plan.ScratchBytes(0)),
                  reinterpret_cast<const SgmvTile*>(base),
                  reinterpret_cast<const void* const*>(base + plan.RowPtrsOffset()),
                  in_features,
                  out_features,
                  plan.max_rank,
                  plan.max_rank,
                  plan.num_sgmv_tiles,
                  static_cast<int32_t>(plan.tiles.size()) - plan.num_sgmv_tiles};
}

}  // namespace ort_lora
