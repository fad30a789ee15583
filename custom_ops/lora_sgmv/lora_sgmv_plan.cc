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

int64_t Rows(const SgmvSegment& s) { return s.row_end - s.row_begin; }
int64_t ModuleRank(const SgmvSegment& s, int m) { return s.first[m + 1] - s.first[m]; }

int64_t ShrinkCost(const SgmvProblem& p, const SgmvSegment& s) {
  return Rows(s) * s.rank * p.in_features;
}

// Multiply-adds of module m's expand of s, plus its loads of y (0 when s has no rows there).
int64_t ExpandCost(const SgmvProblem& p, const SgmvSegment& s, int m) {
  const int64_t r = ModuleRank(s, m);
  return r == 0 ? 0 : Rows(s) * (r + 1) * p.outputs[m].features;
}

// Widened B^T (and D) row stride of module m: its features rounded up to 16 (cache lines).
int64_t WideLd(const SgmvProblem& p, int m) { return CeilDiv(p.outputs[m].features, 16) * 16; }

// Appends items for rows [row0, row1) x [0, width): rows first (in `row_align` blocks), then
// the second axis (in `lo_align` chunks) when the rows alone give too few pieces.
void SplitSegment(int64_t seg, int64_t module, int64_t row0, int64_t row1, int64_t width,
                  int64_t cost, int64_t target, int64_t lo_align, std::vector<SgmvCpuItem>& out) {
  const int64_t n = row1 - row0;
  const int64_t pieces = std::max<int64_t>(1, CeilDiv(cost, target));
  const int64_t row_len = ChunkLen(n, pieces, 4);
  const int64_t lo_pieces = CeilDiv(pieces, CeilDiv(n, row_len));
  const int64_t lo_len = ChunkLen(width, lo_pieces, lo_align);
  for (int64_t r = row0; r < row1; r += row_len)
    for (int64_t c = 0; c < width; c += lo_len)
      out.push_back({seg, module, r, std::min(r + row_len, row1), c, std::min(c + lo_len, width)});
}

// Floats of a segment's widened rows: A [R, lda], its B^T rows and DoRA rows.
int64_t WideValues(const SgmvProblem& p, const SgmvSegment& s, int64_t lda) {
  int64_t values = s.rank * lda;
  for (int m = 0; m < p.num_outputs; ++m)
    values += (ModuleRank(s, m) + (s.dora[m] != nullptr)) * WideLd(p, m);
  return values;
}

// Points a widened segment's rows (A, B^T, D) at their places from `at` on; its R A, then R
// B^T pointers go to `next`.
void PlaceWideRows(const SgmvProblem& p, int64_t lda, float* at, const void** next,
                   SgmvSegment& s) {
  for (int64_t j = 0; j < s.rank; ++j, at += lda) next[j] = at;
  for (int m = 0; m < p.num_outputs; ++m)
    for (int64_t j = s.first[m]; j < s.first[m + 1]; ++j, at += WideLd(p, m)) next[s.rank + j] = at;
  for (int m = 0; m < p.num_outputs; ++m) {
    if (s.dora[m] == nullptr) continue;
    s.dora[m] = at;
    at += WideLd(p, m);
  }
  s.a_rows = next;
  s.bt_rows = next + s.rank;
}

// Picks the segments to widen (none unless `widen`) and points their rows (in plan.segs) at
// their scratch rows.
void PlanWiden(SgmvCpuPlan& plan, bool widen) {
  const SgmvProblem& p = *plan.p;
  plan.segs.assign(p.segments.begin(), p.segments.end());
  plan.wide_base.assign(p.segments.size(), -1);
  plan.widen.clear();
  plan.widen_cost = 0;
  plan.wide_storage.reset();
  plan.wide_values = nullptr;
  if (!widen || p.row_type == SgmvRowLayout::kPoolType) return;
  plan.lda = CeilDiv(p.in_features, 16) * 16;
  int64_t rows = 0;
  for (size_t i = 0; i < p.segments.size(); ++i) {
    const SgmvSegment& s = p.segments[i];
    const int64_t values = WideValues(p, s, plan.lda);
    if (Rows(s) < kWidenMinRows || plan.widen_cost + values > kWidenMaxValues) continue;
    plan.wide_base[i] = plan.widen_cost;
    plan.widen.push_back(i);
    plan.widen_cost += values;
    rows += 2 * s.rank;
  }
  if (plan.widen.empty()) return;
  plan.wide_storage.reset(new float[plan.widen_cost + 16]);
  const uintptr_t start = reinterpret_cast<uintptr_t>(plan.wide_storage.get());
  plan.wide_values = plan.wide_storage.get() + (-start % 64) / sizeof(float);
  plan.wide_rows.resize(rows);
  const void** next = plan.wide_rows.data();
  for (int64_t i : plan.widen) {
    PlaceWideRows(p, plan.lda, plan.wide_values + plan.wide_base[i], next, plan.segs[i]);
    next += 2 * plan.segs[i].rank;
  }
}

// Decode calls: enough segments, none dominating (kFuseMinSegments).
bool FuseSegments(const SgmvProblem& p) {
  const int64_t n = static_cast<int64_t>(p.segments.size());
  if (n < kFuseMinSegments) return false;
  int64_t total = 0, largest = 0;
  for (const SgmvSegment& s : p.segments) {
    int64_t cost = ShrinkCost(p, s);
    for (int m = 0; m < p.num_outputs; ++m) cost += ExpandCost(p, s, m);
    total += cost;
    largest = std::max(largest, cost);
  }
  return largest * kFuseMinSegments <= total;
}

// Shrink items; with `whole`, one per segment (the segment's group does all of it).
void PlanShrink(SgmvCpuPlan& plan, bool whole) {
  const SgmvProblem& p = *plan.p;
  plan.shrink.clear();
  plan.shrink_cost = 0;
  for (const SgmvSegment& s : p.segments) plan.shrink_cost += ShrinkCost(p, s);
  const int64_t target = std::max(kMinItemCost, plan.shrink_cost / kItemsPerPass);
  for (size_t i = 0; i < p.segments.size(); ++i) {
    const SgmvSegment& s = p.segments[i];
    if (whole) {
      plan.shrink.push_back({static_cast<int64_t>(i), 0, s.row_begin, s.row_end, 0, s.rank});
    } else {
      SplitSegment(i, 0, s.row_begin, s.row_end, s.rank, ShrinkCost(p, s), target, 4, plan.shrink);
    }
  }
}

// Expand items in row order, a segment's items (every module's) together, with the copies of
// rows a module leaves as y (only when its y_out is another buffer) before them; with `whole`,
// one item per segment and module.
void PlanExpand(SgmvCpuPlan& plan, bool whole) {
  const SgmvProblem& p = *plan.p;
  plan.expand.clear();
  int64_t total = 0;
  for (const SgmvSegment& s : p.segments)
    for (int m = 0; m < p.num_outputs; ++m) total += ExpandCost(p, s, m);
  const int64_t target = std::max(kMinItemCost, total / kItemsPerPass);
  int64_t copied = 0;                  // floats copied
  int64_t next[kSgmvMaxModules] = {};  // per module: its first row not yet written
  auto add_copy = [&](int m, int64_t end) {
    const SgmvOutput& o = p.outputs[m];
    if (o.y == o.y_out) return;  // in place: rows without an adapter cost nothing
    const int64_t rows = std::max<int64_t>(1, kCopyItemFloats / std::max<int64_t>(o.features, 1));
    for (int64_t row = next[m]; row < end; row += rows)
      plan.expand.push_back({-1, m, row, std::min(row + rows, end), 0, o.features});
    copied += (end - next[m]) * o.features;
  };
  for (size_t i = 0; i < p.segments.size(); ++i) {
    const SgmvSegment& s = p.segments[i];
    for (int m = 0; m < p.num_outputs; ++m)
      if (ModuleRank(s, m) > 0) add_copy(m, s.row_begin);
    for (int m = 0; m < p.num_outputs; ++m) {
      if (ModuleRank(s, m) == 0) continue;
      const int64_t out = p.outputs[m].features;
      if (whole) {
        plan.expand.push_back({static_cast<int64_t>(i), m, s.row_begin, s.row_end, 0, out});
      } else {
        SplitSegment(i, m, s.row_begin, s.row_end, out, ExpandCost(p, s, m), target, 64,
                     plan.expand);
      }
      next[m] = s.row_end;
    }
  }
  for (int m = 0; m < p.num_outputs; ++m) add_copy(m, p.num_rows);
  plan.expand_cost = total + copied;
}

// Groups of the fused pass (SgmvCpuGroup): expand items come in row order, a segment's items
// together; shrink items one per segment, in segment order.
void PlanFused(SgmvCpuPlan& plan) {
  const int64_t n = static_cast<int64_t>(plan.expand.size());
  for (int64_t e = 0; e < n;) {
    const int64_t seg = plan.expand[e].seg;
    int64_t end = e + 1;
    while (seg >= 0 && end < n && plan.expand[end].seg == seg) ++end;
    plan.fused.push_back({std::max<int64_t>(seg, 0), seg + 1, e, end});  // copies: no shrink
    e = end;
  }
}

}  // namespace

void PlanSgmvCpu(const SgmvProblem& problem, SgmvCpuPlan& plan, bool widen) {
  plan.p = &problem;
  plan.v_base.clear();
  int64_t v_size = 0;
  for (const SgmvSegment& s : problem.segments) {
    plan.v_base.push_back(v_size);
    v_size += Rows(s) * s.rank;
  }
  plan.v.resize(v_size);
  PlanWiden(plan, widen);
  const bool fused = FuseSegments(problem);
  PlanShrink(plan, fused);
  PlanExpand(plan, fused);
  plan.fused.clear();
  if (fused) PlanFused(plan);
}

}  // namespace ort_lora
