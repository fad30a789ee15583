// LoraSGMV metadata checks (lora_sgmv_checks.h).
#include "lora_sgmv/lora_sgmv_checks.h"

#include "common/errors.h"

namespace ort_lora {

namespace {

void CheckSegStarts(const SgmvMetadata& m) {
  const int32_t* s = m.seg_starts;
  if (s[0] != 0) Fail("seg_starts[0] must be 0, got ", s[0]);
  if (s[m.num_segments] != m.num_rows)
    Fail("seg_starts[", m.num_segments, "] must be T = ", m.num_rows, " (the rows of x), got ",
         s[m.num_segments]);
  for (int64_t i = 0; i < m.num_segments; ++i)
    if (s[i + 1] < s[i])
      Fail("seg_starts is non-monotonic: seg_starts[", i + 1, "] = ", s[i + 1], " < seg_starts[", i,
           "] = ", s[i]);
}

int64_t CheckedSlot(const SgmvMetadata& m, int64_t seg) {
  const int64_t slot = m.seg_slots[seg];
  if (slot < -1 || slot >= m.num_slots)
    Fail("seg_slots[", seg, "] = ", slot, " must be in [-1, ", m.num_slots, ") (num_slots)");
  return slot;
}

int64_t CheckedRank(const SgmvMetadata& m, const SgmvRankLimit& limit, int64_t slot) {
  const int64_t rank = m.ranks[m.layer * m.num_slots + slot];
  if (rank < 0 || rank > m.max_rank)
    Fail("ranks[", m.layer, ", ", slot, "] = ", rank, " must be in [0, ", m.max_rank,
         "] (max_rank, a_offsets.shape[1])");
  if (rank > limit.max)
    Fail("ranks[", m.layer, ", ", slot, "] = ", rank, " is ", limit.what, " ", limit.max);
  return rank;
}

// Address of the row of `features` values at pool element `offset`; the pool elements it spans
// (`features`, or ceil(features / 2) for bfloat16 rows) must lie inside one of the halves.
const void* Row(const SgmvPool& pool, int64_t offset, int64_t features, const char* name,
                int64_t slot, int64_t j) {
  const auto* key = static_cast<const char*>(pool.key_cache);
  const auto* value = static_cast<const char*>(pool.value_cache);
  const int64_t half = pool.half;
  const int64_t len = pool.bf16_rows ? (features + 1) / 2 : features;  // pool elements
  // Written so that no sum can overflow, whatever the offset.
  if (offset >= 0 && offset < half && len <= half - offset) return key + offset * pool.elem_size;
  if (offset >= half && offset - half < half && len <= 2 * half - offset)
    return value + (offset - half) * pool.elem_size;
  if (len == 0 && offset >= 0 && offset <= 2 * half) return key;  // empty rows read nothing
  if (pool.bf16_rows)
    Fail(name, "[", slot, ", ", j, "] = ", offset, " is an out-of-range page: a row of ", features,
         " bfloat16 (", len, " pool elements) must lie inside key_cache [0, ", half,
         ") or value_cache [", half, ", ", 2 * half, ")");
  Fail(name, "[", slot, ", ", j, "] = ", offset, " is an out-of-range page: a row of ", len,
       " elements must lie inside key_cache [0, ", half, ") or value_cache [", half, ", ", 2 * half,
       ")");
}

// Appends the slot's rank A row pointers, then its rank B^T row pointers, checking each row.
void AddSlotRows(const SgmvMetadata& m, const SgmvPool& pool, int64_t slot, int64_t rank,
                 std::vector<const void*>& rows) {
  const int64_t* a = m.a_offsets + slot * m.max_rank;
  const int64_t* b = m.b_offsets + slot * m.max_rank;
  for (int64_t j = 0; j < rank; ++j)
    rows.push_back(Row(pool, a[j], m.in_features, "a_offsets", slot, j));
  for (int64_t j = 0; j < rank; ++j)
    rows.push_back(Row(pool, b[j], m.out_features, "b_offsets", slot, j));
}

}  // namespace

void CheckSgmvLayer(const SgmvMetadata& m) {
  if (m.layer < 0 || m.layer >= m.num_layers)
    Fail("attribute 'layer' = ", m.layer, " must be < num_layers = ", m.num_layers,
         " (ranks.shape[0])");
}

std::vector<SgmvActiveSegment> CheckSgmvSegments(const SgmvMetadata& m, const SgmvPool& pool,
                                                 const SgmvRankLimit& limit,
                                                 std::vector<const void*>& rows) {
  CheckSegStarts(m);
  std::vector<int64_t> slot_rows(m.num_slots, -1);  // where a slot's pointers start in rows
  std::vector<SgmvActiveSegment> active;
  for (int64_t s = 0; s < m.num_segments; ++s) {
    const int64_t slot = CheckedSlot(m, s);
    if (slot < 0 || m.seg_starts[s] == m.seg_starts[s + 1]) continue;
    const int64_t rank = CheckedRank(m, limit, slot);
    if (rank == 0) continue;
    if (slot_rows[slot] < 0) {
      slot_rows[slot] = static_cast<int64_t>(rows.size());
      AddSlotRows(m, pool, slot, rank, rows);
    }
    active.push_back({s, slot, m.seg_starts[s], m.seg_starts[s + 1], rank,
                      m.scales[m.layer * m.num_slots + slot], slot_rows[slot]});
  }
  return active;
}

}  // namespace ort_lora
