// Host part of the CUDA LoraSGMV: validation, plan, serialization. No CUDA runtime calls (the
// CPU emulator links this file; the upload and launch are in sgmv_run.cc).
#include "cuda/sgmv_plan.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>

namespace ort_lora {

namespace {

template <typename... Args>
[[noreturn]] void Bad(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  throw std::invalid_argument(os.str());
}

size_t AlignUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

void CheckSegStarts(const SgmvHostInputs& in) {
  const int32_t* s = in.seg_starts;
  if (s[0] != 0) Bad("seg_starts[0] must be 0, got ", s[0]);
  if (s[in.num_segments] != in.num_rows)
    Bad("seg_starts[", in.num_segments, "] must be T = ", in.num_rows, " (the rows of x), got ",
        s[in.num_segments]);
  for (int64_t i = 0; i < in.num_segments; ++i)
    if (s[i + 1] < s[i])
      Bad("seg_starts is non-monotonic: seg_starts[", i + 1, "] = ", s[i + 1], " < seg_starts[", i,
          "] = ", s[i]);
}

// Device address of the row of `len` elements at `offset`, which must lie in one pool half.
const void* RowPtr(const SgmvHostInputs& in, int64_t offset, int64_t len, const char* name,
                   int64_t slot, int64_t j) {
  const auto* key = static_cast<const uint8_t*>(in.key_cache);
  const auto* value = static_cast<const uint8_t*>(in.value_cache);
  if (offset >= 0 && offset < in.half && len <= in.half - offset)
    return key + offset * in.elem_size;
  if (offset >= in.half && offset - in.half < in.half && len <= 2 * in.half - offset)
    return value + (offset - in.half) * in.elem_size;
  Bad(name, "[", slot, ", ", j, "] = ", offset, " is an out-of-range page: a row of ", len,
      " elements must lie inside key_cache [0, ", in.half, ") or value_cache [", in.half, ", ",
      2 * in.half, ")");
}

int64_t CheckedRank(const SgmvHostInputs& in, int64_t slot) {
  const int64_t rank = in.ranks[in.layer * in.num_slots + slot];
  if (rank < 0 || rank > in.max_rank)
    Bad("ranks[", in.layer, ", ", slot, "] = ", rank, " must be in [0, ", in.max_rank,
        "] (max_rank, a_offsets.shape[1])");
  if (rank > kMaxCudaRank)
    Bad("ranks[", in.layer, ", ", slot, "] = ", rank, " is over the CUDA kernel's limit ",
        kMaxCudaRank);
  return rank;
}

// Appends the slot's A then B^T row pointers; returns where they start.
int32_t AddSlotRows(const SgmvHostInputs& in, int64_t slot, int64_t rank, SgmvPlan& plan) {
  const auto start = static_cast<int32_t>(plan.row_ptrs.size());
  for (int64_t j = 0; j < rank; ++j)
    plan.row_ptrs.push_back(
        RowPtr(in, in.a_offsets[slot * in.max_rank + j], in.in_features, "a_offsets", slot, j));
  for (int64_t j = 0; j < rank; ++j)
    plan.row_ptrs.push_back(
        RowPtr(in, in.b_offsets[slot * in.max_rank + j], in.out_features, "b_offsets", slot, j));
  return start;
}

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

SgmvPlan BuildSgmvPlan(const SgmvHostInputs& in) {
  if (in.layer < 0 || in.layer >= in.num_layers)
    Bad("attribute 'layer' = ", in.layer, " must be < num_layers = ", in.num_layers,
        " (ranks.shape[0])");
  if (in.num_rows > INT32_MAX) Bad("x has ", in.num_rows, " rows; the CUDA kernel takes < 2^31");
  CheckSegStarts(in);
  SgmvPlan plan;
  std::vector<int32_t> slot_rows(in.num_slots, -1);
  std::vector<SgmvTile> bgmv;
  for (int64_t s = 0; s < in.num_segments; ++s) {
    const int64_t slot = in.seg_slots[s];
    if (slot < -1 || slot >= in.num_slots)
      Bad("seg_slots[", s, "] = ", slot, " must be in [-1, ", in.num_slots, ") (num_slots)");
    if (slot < 0 || in.seg_starts[s] == in.seg_starts[s + 1]) continue;
    const int64_t rank = CheckedRank(in, slot);
    if (rank == 0) continue;
    if (slot_rows[slot] < 0) slot_rows[slot] = AddSlotRows(in, slot, rank, plan);
    const float scale = in.scales[in.layer * in.num_slots + slot];
    for (int32_t r = in.seg_starts[s]; r < in.seg_starts[s + 1]; r += kTileRows) {
      const int32_t n = std::min<int32_t>(kTileRows, in.seg_starts[s + 1] - r);
      const SgmvTile tile{r, n, static_cast<int32_t>(rank), slot_rows[slot], scale};
      (n <= kBgmvMaxRows ? bgmv : plan.tiles).push_back(tile);
    }
    plan.max_rank = std::max<int32_t>(plan.max_rank, static_cast<int32_t>(rank));
  }
  plan.num_sgmv_tiles = static_cast<int32_t>(plan.tiles.size());
  plan.tiles.insert(plan.tiles.end(), bgmv.begin(), bgmv.end());
  return plan;
}

std::string PlanForCEntry(int dtype, const SgmvHostInputs& in, SgmvPlan& plan) {
  if (dtype != static_cast<int>(SgmvDtype::kFloat16) &&
      dtype != static_cast<int>(SgmvDtype::kBFloat16))
    return "dtype must be 0 (float16) or 1 (bfloat16), got " + std::to_string(dtype);
  try {
    plan = BuildSgmvPlan(in);
  } catch (const std::invalid_argument& e) {
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
