// Host part of the CUDA LoraSGMV: validation, plan, serialization. No CUDA runtime calls (the
// upload and launch are in sgmv_run.cc).
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

template <typename T>
void Put(std::vector<uint8_t>& out, size_t at, const T* data, int64_t count) {
  if (count > 0) std::memcpy(out.data() + at, data, static_cast<size_t>(count) * sizeof(T));
}

int64_t DoraCount(const SgmvMetadata& m) { return m.dora_offsets == nullptr ? 0 : m.num_slots; }

}  // namespace

SgmvPlan::Layout SgmvPlan::GetLayout() const {
  const auto offsets = static_cast<size_t>(meta.num_slots * meta.max_rank) * sizeof(int64_t);
  const auto per_layer = static_cast<size_t>(meta.num_layers * meta.num_slots) * 4;
  Layout l{};
  l.a_offsets = 0;
  l.b_offsets = l.a_offsets + offsets;
  l.dora_offsets = l.b_offsets + offsets;
  l.ranks = l.dora_offsets + static_cast<size_t>(DoraCount(meta)) * sizeof(int64_t);
  l.scales = AlignUp(l.ranks + per_layer, 8);
  l.terms = AlignUp(l.scales + per_layer, 8);
  l.tiles = AlignUp(l.terms + terms.size() * sizeof(SgmvTerm), 8);
  l.bytes = l.tiles + tiles.size() * sizeof(SgmvTile);
  return l;
}

void SgmvPlan::Serialize(std::vector<uint8_t>& out) const {
  const Layout l = GetLayout();
  out.assign(l.bytes, 0);
  const int64_t offsets = meta.num_slots * meta.max_rank,
                per_layer = meta.num_layers * meta.num_slots;
  Put(out, l.a_offsets, meta.a_offsets, offsets);
  Put(out, l.b_offsets, meta.b_offsets, offsets);
  Put(out, l.dora_offsets, meta.dora_offsets, DoraCount(meta));
  Put(out, l.ranks, meta.ranks, per_layer);
  Put(out, l.scales, meta.scales, per_layer);
  Put(out, l.terms, terms.data(), static_cast<int64_t>(terms.size()));
  Put(out, l.tiles, tiles.data(), static_cast<int64_t>(tiles.size()));
}

size_t SgmvPlan::VBytes() const {
  return static_cast<size_t>(meta.num_rows) * layer_max_rank * sizeof(float);
}

SgmvPlan BuildSgmvPlan(const SgmvMetadata& m, const SgmvPool& pool) {
  CheckSgmvLayer(m);
  if (m.num_rows > INT32_MAX) Fail("x has ", m.num_rows, " rows; the CUDA kernel takes < 2^31");
  if (m.num_layers > INT32_MAX || m.num_slots > INT32_MAX || m.max_rank > INT32_MAX)
    Fail("ranks has shape [", m.num_layers, ", ", m.num_slots, "] and a_offsets [", m.num_slots,
         ", ", m.max_rank, "]; the CUDA kernel takes dims < 2^31");
  SgmvPlan plan;
  plan.meta = m;
  const SgmvTerms terms = ListSgmvTerms(m);
  // The checks resolve the rows too; the kernels resolve the offsets themselves.
  for (const SgmvActiveSegment& a : CheckSgmvSegments(m, terms, pool, kRankLimit).segments)
    plan.layer_max_rank = std::max(plan.layer_max_rank, static_cast<int32_t>(a.rank));
  for (size_t i = 0; i < terms.slots.size(); ++i)
    plan.terms.push_back(SgmvTerm{terms.slots[i], terms.weights[i]});
  // Tiles for every segment with terms and rows, also those whose rank is 0 at this layer (the
  // kernels skip them): the tiles, like the tables, are then the same for every layer.
  std::vector<SgmvTile> bgmv;
  for (int64_t s = 0; s < m.num_segments; ++s) {
    const int32_t begin = m.seg_starts[s], end = m.seg_starts[s + 1];
    const auto first = static_cast<int32_t>(terms.starts[s]);
    const auto count = static_cast<int32_t>(terms.starts[s + 1] - terms.starts[s]);
    if (count == 0 || begin == end) continue;
    for (int32_t r = begin; r < end; r += kTileRows) {
      const int32_t n = std::min<int32_t>(kTileRows, end - r);
      (n <= kBgmvMaxRows ? bgmv : plan.tiles).push_back(SgmvTile{r, n, first, count});
    }
  }
  plan.num_sgmv_tiles = static_cast<int32_t>(plan.tiles.size());
  plan.tiles.insert(plan.tiles.end(), bgmv.begin(), bgmv.end());
  return plan;
}

SgmvArgs PlanArgs(const SgmvPlan& plan, const void* device_plan, float* v, const SgmvPool& pool,
                  const void* x, void* y_out) {
  const auto* base = static_cast<const uint8_t*>(device_plan);
  const SgmvPlan::Layout l = plan.GetLayout();
  const SgmvMetadata& m = plan.meta;
  return SgmvArgs{
      x,
      y_out,
      v,
      pool.key_cache,
      pool.value_cache,
      pool.half,
      reinterpret_cast<const SgmvTile*>(base + l.tiles),
      reinterpret_cast<const SgmvTerm*>(base + l.terms),
      reinterpret_cast<const int64_t*>(base + l.a_offsets),
      reinterpret_cast<const int64_t*>(base + l.b_offsets),
      m.dora_offsets == nullptr ? nullptr : reinterpret_cast<const int64_t*>(base + l.dora_offsets),
      reinterpret_cast<const int32_t*>(base + l.ranks),
      reinterpret_cast<const float*>(base + l.scales),
      m.in_features,
      m.out_features,
      static_cast<int32_t>(m.layer),
      static_cast<int32_t>(m.num_slots),
      static_cast<int32_t>(m.max_rank),
      plan.layer_max_rank,
      plan.num_sgmv_tiles,
      static_cast<int32_t>(plan.tiles.size()) - plan.num_sgmv_tiles};
}

}  // namespace ort_lora
