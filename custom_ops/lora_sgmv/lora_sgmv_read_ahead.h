// Read-ahead of adapter rows across a decode group (SgmvCpuGroup): while a segment's shrink
// and expand run, the rows they will read next are asked for a few cache lines at a time
// (software prefetch into L2): the segment's B^T rows (its expand's, after the shrink), then
// the next group's A rows (its shrink's). A decode call is bound by reading its rows from
// memory; without this the kernel waits for each row in turn and its time is about its
// in-cache time plus the rows' time from memory. Used by lora_sgmv_cpu.cc only.
#pragma once

#include <cstdint>

#include "lora_sgmv/lora_sgmv_plan.h"

namespace ort_lora {

class RowReadAhead {
 public:
  // The queue of group `group` of plan.fused: its segment's B^T rows, module by module, then
  // the A rows of the next group's segment (a group of copies has none).
  RowReadAhead(const SgmvCpuPlan& plan, size_t group) {
    const SgmvProblem& p = *plan.p;
    const int64_t seg = Segment(plan, group);
    if (seg >= 0) {
      const SgmvSegment& s = plan.segs[seg];
      for (int m = 0; m < p.num_outputs; ++m)
        Add(s.bt_rows + s.first[m], s.first[m + 1] - s.first[m],
            RowBytes(plan, seg, p.outputs[m].features));
    }
    const int64_t next = group + 1 < plan.fused.size() ? Segment(plan, group + 1) : -1;
    if (next >= 0)
      Add(plan.segs[next].a_rows, plan.segs[next].rank, RowBytes(plan, next, p.in_features));
  }

  // Asks for the queue's next `lines` cache lines (fewer when it runs out). Callers ask for as
  // many lines as they are about to read themselves, a tile's step at a time: the queue then
  // stays about one group ahead of the kernel (measured on a Zen 4 EPYC: a group's lines in
  // one burst before it, twice as many lines, or lines into L1 as the kernel's own read-ahead
  // does were each slower; bench/bench_lora_step.py).
  void Issue(int64_t lines) {
    for (; lines > 0 && span_ < spans_; --lines) {
      const Rows& r = rows_[span_];
      __builtin_prefetch(static_cast<const char*>(r.rows[row_]) + offset_, 0, 2);
      offset_ += 64;
      if (offset_ < r.bytes) continue;
      offset_ = 0;
      if (++row_ == r.count) row_ = 0, ++span_;
    }
  }

 private:
  struct Rows {
    const void* const* rows;
    int64_t count, bytes;
  };

  static int64_t Segment(const SgmvCpuPlan& plan, size_t group) {
    const SgmvCpuGroup& g = plan.fused[group];
    return g.shrink_end > g.shrink_begin ? plan.shrink[g.shrink_begin].seg : -1;
  }

  // Bytes of one of segment seg's rows of `features` values: float32 once widened.
  static int64_t RowBytes(const SgmvCpuPlan& plan, int64_t seg, int64_t features) {
    const bool wide = plan.wide_base[seg] >= 0;
    return static_cast<int64_t>(sizeof(float)) *
           (wide ? features : SgmvRowElems(plan.p->row_type, features));
  }

  void Add(const void* const* rows, int64_t count, int64_t bytes) {
    if (count > 0 && bytes > 0) rows_[spans_++] = {rows, count, bytes};
  }

  Rows rows_[kSgmvMaxModules + 1];
  int spans_ = 0, span_ = 0;
  int64_t row_ = 0, offset_ = 0;
};

}  // namespace ort_lora
