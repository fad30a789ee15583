// LoraSGMV metadata checks (lora_sgmv_checks.h).
#include "lora_sgmv/lora_sgmv_checks.h"

#include <cmath>

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

void CheckCompEntry(const SgmvMetadata& m, int64_t e) {
  const int64_t seg = m.comp_segs[e], slot = m.comp_slots[e];
  const float w = m.comp_weights[e];
  if (seg < 0 || seg >= m.num_segments)
    Fail("comp_segs[", e, "] = ", seg, " must be in [0, ", m.num_segments, ") (S, the segments)");
  if (slot < 0 || slot >= m.num_slots)
    Fail("comp_slots[", e, "] = ", slot, " must be in [0, ", m.num_slots, ") (num_slots)");
  if (!std::isfinite(w)) Fail("comp_weights[", e, "] = ", w, " is not finite");
}

int64_t DoraOffset(const SgmvMetadata& m, int64_t slot) {
  return m.dora_offsets == nullptr ? -1 : m.dora_offsets[slot];
}

void CheckDoraOffsets(const SgmvMetadata& m, int64_t half) {
  if (m.dora_offsets == nullptr) return;
  for (int64_t s = 0; s < m.num_slots; ++s)
    if (m.dora_offsets[s] < -1 || m.dora_offsets[s] > 2 * half)
      Fail("dora_offsets[", s, "] = ", m.dora_offsets[s],
           " must be -1 (no DoRA row) or a pool element in [0, ", 2 * half, "]");
}

// A composed segment (two or more terms) must not hold a slot with a DoRA row.
void CheckDoraNotComposed(const SgmvMetadata& m, const SgmvTerms& t, int64_t seg) {
  const int64_t n = t.starts[seg + 1] - t.starts[seg];
  for (int64_t i = t.starts[seg]; n > 1 && i < t.starts[seg + 1]; ++i) {
    const int64_t slot = t.slots[i];
    if (DoraOffset(m, slot) >= 0)
      Fail("segment ", seg, " composes ", n, " adapters and slot ", slot, " is DoRA (dora_offsets[",
           slot, "] = ", DoraOffset(m, slot), "): DoRA adapters cannot be composed");
  }
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

// Address of a row of `len` pool elements at pool element `offset`, or null when those elements
// do not lie inside one of the halves (written so that no sum can overflow, whatever the
// offset). The per-row check of every call: inline, the error path apart (Row).
inline const void* RowOrNull(const SgmvPool& pool, int64_t offset, int64_t len) {
  const int64_t half = pool.half;
  if (offset >= 0 && offset < half && len <= half - offset)
    return static_cast<const char*>(pool.key_cache) + offset * pool.elem_size;
  if (offset >= half && offset - half < half && len <= 2 * half - offset)
    return static_cast<const char*>(pool.value_cache) + (offset - half) * pool.elem_size;
  if (len == 0 && offset >= 0 && offset <= 2 * half) return pool.key_cache;  // reads nothing
  return nullptr;
}

// Address of the row of `features` values at pool element `offset`; the pool elements it spans
// (SgmvRowElems) must lie inside one of the halves.
// The error names the row as name[slot, j], or name[slot] when j < 0.
const void* Row(const SgmvPool& pool, int64_t offset, int64_t features, const char* name,
                int64_t slot, int64_t j) {
  const int64_t half = pool.half;
  const SgmvRowLayout layout = SlotRowLayout(pool, slot);
  const int64_t len = SgmvRowElems(layout, features);  // pool elements
  if (const void* row = RowOrNull(pool, offset, len)) return row;
  std::ostringstream at;
  at << name << "[" << slot;
  if (j >= 0) at << ", " << j;
  at << "] = " << offset << " is an out-of-range page: a row of ";
  if (layout != SgmvRowLayout::kPoolType)
    Fail(at.str(), features,
         layout == SgmvRowLayout::kInt8Scaled     ? " int8 (scale first, "
         : layout == SgmvRowLayout::kFloat16Pairs ? " float16 ("
                                                  : " bfloat16 (",
         len, " pool elements) must lie inside key_cache [0, ", half, ") or value_cache [", half,
         ", ", 2 * half, ")");
  Fail(at.str(), len, " elements must lie inside key_cache [0, ", half, ") or value_cache [", half,
       ", ", 2 * half, ")");
}

// Appends the slot's rank A row pointers, then its rank B^T row pointers, checking each row.
void AddSlotRows(const SgmvMetadata& m, const SgmvPool& pool, int64_t slot, int64_t rank,
                 std::vector<const void*>& rows) {
  const int64_t* a = m.a_offsets + slot * m.max_rank;
  const int64_t* b = m.b_offsets + slot * m.max_rank;
  const SgmvRowLayout layout = SlotRowLayout(pool, slot);
  const int64_t a_len = SgmvRowElems(layout, m.in_features);
  const int64_t b_len = SgmvRowElems(layout, m.out_features);
  const size_t at = rows.size();
  rows.resize(at + 2 * rank);
  const void** out = rows.data() + at;
  for (int64_t j = 0; j < rank; ++j) {
    out[j] = RowOrNull(pool, a[j], a_len);
    if (out[j] == nullptr) Row(pool, a[j], m.in_features, "a_offsets", slot, j);  // throws
  }
  for (int64_t j = 0; j < rank; ++j) {
    out[rank + j] = RowOrNull(pool, b[j], b_len);
    if (out[rank + j] == nullptr) Row(pool, b[j], m.out_features, "b_offsets", slot, j);
  }
}

}  // namespace

void CheckSgmvLayer(const SgmvMetadata& m) {
  if (m.layer < 0 || m.layer >= m.num_layers)
    Fail("attribute 'layer' = ", m.layer, " must be < num_layers = ", m.num_layers,
         " (ranks.shape[0])");
}

SgmvTerms ListSgmvTerms(const SgmvMetadata& m) {
  SgmvTerms t;
  ListSgmvTerms(m, t);
  return t;
}

void ListSgmvTerms(const SgmvMetadata& m, SgmvTerms& t) {
  CheckSegStarts(m);
  // t.starts[s + 1] counts segment s's terms first, then becomes the prefix sum
  t.starts.assign(m.num_segments + 1, 0);
  int64_t* count = t.starts.data() + 1;
  for (int64_t s = 0; s < m.num_segments; ++s) count[s] = CheckedSlot(m, s) >= 0;
  for (int64_t e = 0; e < m.num_comp; ++e) {
    CheckCompEntry(m, e);
    ++count[m.comp_segs[e]];
  }
  for (int64_t s = 0; s < m.num_segments; ++s) t.starts[s + 1] += t.starts[s];
  t.slots.resize(t.starts[m.num_segments]);
  t.weights.resize(t.slots.size());
  if (m.num_comp == 0) {  // one term per segment with a slot: no composition to interleave
    for (int64_t s = 0; s < m.num_segments; ++s)
      if (m.seg_slots[s] >= 0) t.slots[t.starts[s]] = m.seg_slots[s], t.weights[t.starts[s]] = 1;
  } else {
    std::vector<int64_t> next(t.starts.begin(), t.starts.end() - 1);
    for (int64_t s = 0; s < m.num_segments; ++s)
      if (m.seg_slots[s] >= 0) t.slots[next[s]] = m.seg_slots[s], t.weights[next[s]++] = 1.0f;
    for (int64_t e = 0; e < m.num_comp; ++e) {
      const int64_t i = next[m.comp_segs[e]]++;
      t.slots[i] = m.comp_slots[e], t.weights[i] = m.comp_weights[e];
    }
  }
  t.dora.assign(m.num_segments, false);
  for (int64_t s = 0; s < m.num_segments; ++s) {
    const int64_t n = t.starts[s + 1] - t.starts[s];
    if (m.dora_offsets == nullptr || n == 0) continue;
    CheckDoraNotComposed(m, t, s);
    t.dora[s] = n == 1 && DoraOffset(m, t.slots[t.starts[s]]) >= 0;
  }
}

SgmvCheckedCall CheckSgmvSegments(const SgmvMetadata& m, const SgmvTerms& terms,
                                  const SgmvPool& pool, const SgmvRankLimit& limit) {
  SgmvCheckedCall call;
  CheckSgmvSegments(m, terms, pool, limit, call);
  return call;
}

void CheckSgmvSegments(const SgmvMetadata& m, const SgmvTerms& terms, const SgmvPool& pool,
                       const SgmvRankLimit& limit, SgmvCheckedCall& call) {
  CheckDoraOffsets(m, pool.half);
  call.segments.clear(), call.terms.clear(), call.rows.clear();
  std::vector<int64_t>& slot_rows = call.slot_rows;  // where a slot's pointers start in rows
  slot_rows.assign(m.num_slots, -1);
  for (int64_t s = 0; s < m.num_segments; ++s) {
    if (m.seg_starts[s] == m.seg_starts[s + 1]) continue;
    SgmvActiveSegment seg{
        s, m.seg_starts[s], m.seg_starts[s + 1], 0, static_cast<int64_t>(call.terms.size()),
        0, nullptr};
    for (int64_t i = terms.starts[s]; i < terms.starts[s + 1]; ++i) {
      const int64_t slot = terms.slots[i], rank = CheckedRank(m, limit, slot);
      if (rank == 0) continue;
      if (slot_rows[slot] < 0) {
        slot_rows[slot] = static_cast<int64_t>(call.rows.size());
        AddSlotRows(m, pool, slot, rank, call.rows);
      }
      const float scale = m.scales[m.layer * m.num_slots + slot] * terms.weights[i];
      call.terms.push_back({slot, rank, scale, slot_rows[slot]});
      seg.rank += rank, ++seg.num_terms;
    }
    if (seg.num_terms == 0) continue;
    if (seg.rank > limit.max)
      Fail("segment ", s, " composes adapters of total rank ", seg.rank, " at layer ", m.layer,
           ", ", limit.what, " ", limit.max);
    if (terms.dora[s]) {
      const int64_t slot = terms.slots[terms.starts[s]];
      seg.dora = Row(pool, m.dora_offsets[slot], m.out_features, "dora_offsets", slot, -1);
    }
    call.segments.push_back(seg);
  }
}

}  // namespace ort_lora
