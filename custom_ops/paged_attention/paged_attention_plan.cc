#include "paged_attention/paged_attention_plan.h"

#include <algorithm>
#include <utility>

namespace ort_lora::paged_attention {

Plan MakePlan(const PagedAttentionArgs& a, int64_t group) {
  const int64_t chunk = std::max<int64_t>(1, kRowsPerItem / group);
  Plan plan;
  int64_t longest = 0;
  for (int64_t b = 0; b < a.num_seqs; ++b) {
    const int64_t n = a.cu_seqlens[b + 1] - a.cu_seqlens[b], past = a.past_seqlens[b];
    for (int64_t q0 = 0; q0 < n; q0 += chunk) {
      const int64_t q1 = std::min(n, q0 + chunk), hi = past + q1;
      const int64_t lo = a.local_window >= 0 ? std::max<int64_t>(0, past + q0 - a.local_window) : 0;
      longest = std::max(longest, hi - lo);
      plan.items.push_back({static_cast<int32_t>(b), static_cast<int32_t>(q0),
                            static_cast<int32_t>(q1), static_cast<int32_t>(lo),
                            static_cast<int32_t>(hi), -1});
    }
  }
  const int64_t base = static_cast<int64_t>(plan.items.size());
  if (base == 0 || base >= kTargetItems) return plan;
  const int64_t split =
      std::max(kMinSplitKeys, CeilDiv(longest * base, kTargetItems)) / kSegmentKeys * kSegmentKeys;
  std::vector<WorkItem> items;
  for (const WorkItem& w : plan.items) {
    const int64_t first = w.ctx_begin / split, parts = (w.ctx_end - 1) / split - first + 1;
    if (parts > 1) plan.splits.push_back({static_cast<int64_t>(items.size()), parts});
    for (int64_t s = 0; s < parts; ++s) {
      WorkItem part = w;
      part.ctx_begin = static_cast<int32_t>(std::max<int64_t>(w.ctx_begin, (first + s) * split));
      part.ctx_end = static_cast<int32_t>(std::min<int64_t>(w.ctx_end, (first + s + 1) * split));
      if (parts > 1) {
        part.partial = plan.partial_floats;
        plan.partial_floats += Segments(part.ctx_begin, part.ctx_end) * (w.q_end - w.q_begin) *
                               a.num_heads * (a.head_size + 2);
      }
      items.push_back(part);
    }
  }
  plan.items = std::move(items);
  return plan;
}

}  // namespace ort_lora::paged_attention
