// The PagedAttention CPU kernel's work plan: which query rows go against which keys in each
// work item, and where long contexts are split over threads. Shared by the kernel
// (paged_attention_cpu.cc) and its plan (paged_attention_plan.cc). No ONNX Runtime types.
#pragma once

#include <cstdint>
#include <vector>

#include "paged_attention/paged_attention_cpu.h"

namespace ort_lora::paged_attention {

constexpr int64_t kRowsPerItem = 32;    // query rows (token x head) per work item, at most
constexpr int64_t kSegmentKeys = 256;   // keys whose softmax state is folded at once
constexpr int64_t kMinSplitKeys = 256;  // shortest context range worth its own work item
static_assert(kMinSplitKeys % kSegmentKeys == 0, "a split range is whole segments");
constexpr int64_t kTargetItems = 64;  // fewer items than this: split long contexts

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The segments of keys [lo, hi): the first one's index, and how many (segments are aligned to
// absolute positions, kSegmentKeys each).
inline int64_t FirstSegment(int64_t lo) { return lo / kSegmentKeys; }
inline int64_t Segments(int64_t lo, int64_t hi) {
  return (hi - 1) / kSegmentKeys - lo / kSegmentKeys + 1;
}

// Query tokens [q_begin, q_end) of sequence seq (all heads) against keys at positions
// [ctx_begin, ctx_end). partial < 0: the item sees the whole context and writes the
// output; else it writes rows [max, sum, acc[D]] of each of its segments at partials + partial.
struct WorkItem {
  int32_t seq, q_begin, q_end, ctx_begin, ctx_end;
  int64_t partial;
};

// Items [first, first + count) are the context splits of one (sequence, query chunk).
struct SplitGroup {
  int64_t first, count;
};

struct Plan {
  std::vector<WorkItem> items;
  std::vector<SplitGroup> splits;
  int64_t partial_floats = 0;  // the split items' segment rows, all together
};

// Work items: every (sequence, query chunk of kRowsPerItem rows), split over context ranges
// of whole segments when there are fewer than kTargetItems.
Plan MakePlan(const PagedAttentionArgs& a, int64_t group);

}  // namespace ort_lora::paged_attention
