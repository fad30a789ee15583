// The attention pass's shared pieces (paged_attention_cpu.cc and the block form,
// attention_block.h): a call's state, a run of keys, a query row's softmax state. No ONNX
// Runtime types.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "paged_attention/paged_attention_cpu.h"

namespace ort_lora::paged_attention {

constexpr int64_t kTileKeys = 32;  // keys scored together: one softmax rescale per tile
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Shared state of one call.
struct Problem {
  const PagedAttentionArgs& a;
  int64_t group;                   // query heads per kv head
  int64_t row_stride;              // KVH * D: distance between consecutive K/V rows
  const float* q;                  // [T, H, D] rotated and scaled
  const float* k;                  // [T, KVH, D] rotated (the key input without rotary)
  float* partials;                 // split items' rows [max, sum, acc[D]]
  std::vector<int32_t> positions;  // [T] position of each new token
  std::vector<int32_t> slots;      // [T] cache slot of each new token, -1 = no write
};

// Rows [j, j + count) of keys and values, every kv head, contiguous (row_stride apart): a run
// inside one cache block, or of the new tokens' rows; `room` rows from k and v may be read (to
// the end of the block or of the new rows).
struct KeyRun {
  const float* k;
  const float* v;
  int64_t j, count, room;
};

// One segment's softmax state of a row: running max, running sum, accumulator row.
struct SoftmaxState {
  float m, l;
  float* acc;
};

}  // namespace ort_lora::paged_attention
