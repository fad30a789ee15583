// LoraSGMV CPU work plan (lora_sgmv_plan.h).
#include "lora_sgmv/lora_sgmv_plan.h"

#include <algorithm>

namespace ort_lora {
namespace {

// Each segment is split into pieces of about equal cost (multiply-adds).
constexpr int64_t kItemsPerPass = 64;      // enough items to balance any sane thread count
constexpr int64_t kMinItemCost = 1 << 15;  // below this, dispatch overhead dominates
constexpr int64_t kCopyItemFloats = 1 << 16;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Chunk length (a multiple of align, or all of n) that cuts n into about `pieces` chunks.
int64_t ChunkLen(int64_t n, int64_t pieces, int64_t align) {
  const int64_t len = CeilDiv(CeilDiv(n, std::max<int64_t>(pieces, 1)), align) * align;
  return std::min(std::max(len, align), n);
}

// Appends items for rows [row0, row1) x [0, width): rows first (in `row_align` blocks), then
// the second axis (in `lo_align` chunks) when the rows alone give too few pieces.
void SplitSegment(int64_t seg, int64_t row0, int64_t row1, int64_t width, int64_t cost,
                  int64_t target, int64_t lo_align, std::vector<SgmvCpuItem>& out) {
  const int64_t n = row1 - row0;
  const int64_t pieces = std::max<int64_t>(1, CeilDiv(cost, target));
  const int64_t row_len = ChunkLen(n, pieces, 4);
  const int64_t lo_pieces = CeilDiv(pieces, CeilDiv(n, row_len));
  const int64_t lo_len = ChunkLen(width, lo_pieces, lo_align);
  for (int64_t r = row0; r < row1; r += row_len)
    for (int64_t c = 0; c < width; c += lo_len)
      out.push_back({seg, r, std::min(r + row_len, row1), c, std::min(c + lo_len, width)});
}

// Picks the segments to widen and points their rows (in plan.segs) at their scratch rows.
void PlanWiden(SgmvCpuPlan& plan) {
  const SgmvProblem& p = *plan.p;
  plan.segs = p.segments;
  plan.wide_base.assign(p.segments.size(), -1);
  if (p.row_type == SgmvRowLayout::kPoolType) return;
  plan.lda = CeilDiv(p.in_features, 16) * 16;
  plan.ldb = CeilDiv(p.out_features, 16) * 16;
  int64_t rows = 0;
  for (size_t i = 0; i < p.segments.size(); ++i) {
    const SgmvSegment& s = p.segments[i];
    const int64_t values = s.rank * (plan.lda + plan.ldb) + (s.dora != nullptr) * plan.ldb;
    const bool must = p.row_type == SgmvRowLayout::kInt8Scaled && s.dora != nullptr;
    if (!must &&
        (s.row_end - s.row_begin < kWidenMinRows || plan.widen_cost + values > kWidenMaxValues))
      continue;
    plan.wide_base[i] = plan.widen_cost;
    plan.widen.push_back(i);
    plan.widen_cost += values;
    rows += 2 * s.rank;
  }
  plan.wide_storage.reset(new float[plan.widen_cost + 16]);
  const uintptr_t start = reinterpret_cast<uintptr_t>(plan.wide_storage.get());
  plan.wide_values = plan.wide_storage.get() + (-start % 64) / sizeof(float);
  plan.wide_rows.resize(rows);
  const void** next = plan.wide_rows.data();
  for (int64_t i : plan.widen) {
    SgmvSegment& s = plan.segs[i];
    const float* a = plan.wide_values + plan.wide_base[i];  // [r, lda]
    const float* bt = a + s.rank * plan.lda;                // [r, ldb], then D [ldb]
    for (int64_t j = 0; j < s.rank; ++j) next[j] = a + j * plan.lda;
    for (int64_t j = 0; j < s.rank; ++j) next[s.rank + j] = bt + j * plan.ldb;
    s.a_rows = next;
    s.bt_rows = next + s.rank;
    if (s.dora != nullptr) s.dora = bt + s.rank * plan.ldb;
    next += 2 * s.rank;
  }
}

float RowScale(const void* row) {
  float scale;
  __builtin_memcpy(&scale, row, sizeof(scale));
  return scale;
}

// int8 rows read directly (segments not widened): point them past their scales, and fold the
// scales of A row j and B^T row j into the segment's shrink scale j.
void PlanInt8(SgmvCpuPlan& plan) {
  const SgmvProblem& p = *plan.p;
  if (p.row_type != SgmvRowLayout::kInt8Scaled) return;
  int64_t total = 0;
  for (size_t i = 0; i < p.segments.size(); ++i)
    if (plan.wide_base[i] < 0) total += p.segments[i].rank;
  plan.int8_rows.resize(2 * total);
  plan.int8_scales.resize(total);
  const void** rows = plan.int8_rows.data();
  float* scales = plan.int8_scales.data();
  for (size_t i = 0; i < p.segments.size(); ++i) {
    if (plan.wide_base[i] >= 0) continue;
    SgmvSegment& s = plan.segs[i];
    for (int64_t j = 0; j < s.rank; ++j) {
      rows[j] = static_cast<const char*>(s.a_rows[j]) + sizeof(float);
      rows[s.rank + j] = static_cast<const char*>(s.bt_rows[j]) + sizeof(float);
      scales[j] = s.scales[j] * RowScale(s.a_rows[j]) * RowScale(s.bt_rows[j]);
    }
    s.a_rows = rows, s.bt_rows = rows + s.rank, s.scales = scales;
    rows += 2 * s.rank, scales += s.rank;
  }
}

void PlanShrink(SgmvCpuPlan& plan) {
  const SgmvProblem& p = *plan.p;
  int64_t total = 0;
  for (const SgmvSegment& s : p.segments)
    total += (s.row_end - s.row_begin) * s.rank * p.in_features;
  plan.shrink_cost = total;
  const int64_t target = std::max(kMinItemCost, total / kItemsPerPass);
  for (size_t i = 0; i < p.segments.size(); ++i) {
    const SgmvSegment& s = p.segments[i];
    const int64_t cost = (s.row_end - s.row_begin) * s.rank * p.in_features;
    SplitSegment(i, s.row_begin, s.row_end, s.rank, cost, target, 4, plan.shrink);
  }
}

void PlanExpand(SgmvCpuPlan& plan) {
  const SgmvProblem& p = *plan.p;
  const int64_t out = p.out_features;
  std::vector<const SgmvSegment*> order;
  int64_t total = 0;
  for (const SgmvSegment& s : p.segments) {
    order.push_back(&s);
    total += (s.row_end - s.row_begin) * (s.rank + 1) * out;
  }
  std::sort(order.begin(), order.end(),
            [](const SgmvSegment* a, const SgmvSegment* b) { return a->row_begin < b->row_begin; });
  plan.expand_cost = total + p.num_rows * out;  // + the copy of rows without an adapter
  const int64_t target = std::max(kMinItemCost, total / kItemsPerPass);
  const int64_t copy_rows = std::max<int64_t>(1, kCopyItemFloats / std::max<int64_t>(out, 1));
  int64_t row = 0;
  auto add_copy = [&](int64_t end) {
    for (; row < end; row += copy_rows)
      plan.expand.push_back({-1, row, std::min(row + copy_rows, end), 0, out});
  };
  for (const SgmvSegment* s : order) {
    add_copy(s->row_begin);
    const int64_t cost = (s->row_end - s->row_begin) * (s->rank + 1) * out;
    SplitSegment(s - p.segments.data(), s->row_begin, s->row_end, out, cost, target, 64,
                 plan.expand);
    row = s->row_end;
  }
  add_copy(p.num_rows);
}

// Groups of the fused pass (SgmvCpuGroup), when every segment has exactly one shrink item.
void PlanFused(SgmvCpuPlan& plan) {
  const int64_t segments = static_cast<int64_t>(plan.p->segments.size());
  if (segments < kFuseMinSegments || static_cast<int64_t>(plan.shrink.size()) != segments) return;
  std::vector<int64_t> shrink_of(segments, -1);
  for (size_t i = 0; i < plan.shrink.size(); ++i) {
    if (shrink_of[plan.shrink[i].seg] >= 0) return;  // two items of one segment
    shrink_of[plan.shrink[i].seg] = static_cast<int64_t>(i);
  }
  // Expand items come in row order, a segment's items together; a group per segment (with
  // its shrink item) and per copy item.
  const int64_t n = static_cast<int64_t>(plan.expand.size());
  for (int64_t e = 0; e < n;) {
    const int64_t seg = plan.expand[e].seg;
    int64_t end = e + 1;
    while (seg >= 0 && end < n && plan.expand[end].seg == seg) ++end;
    plan.fused.push_back({seg >= 0 ? shrink_of[seg] : -1, e, end});
    e = end;
  }
}

}  // namespace

SgmvCpuPlan PlanSgmvCpu(const SgmvProblem& problem) {
  SgmvCpuPlan plan;
  plan.p = &problem;
  int64_t v_size = 0;
  for (const SgmvSegment& s : problem.segments) {
    plan.v_base.push_back(v_size);
    v_size += (s.row_end - s.row_begin) * s.rank;
  }
  plan.v.resize(v_size);
  PlanWiden(plan);
  PlanInt8(plan);
  PlanShrink(plan);
  PlanExpand(plan);
  PlanFused(plan);
  return plan;
}

}  // namespace ort_lora
