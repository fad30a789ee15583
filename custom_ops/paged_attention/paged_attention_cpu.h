// The PagedAttention CPU kernel (float32) behind a launcher with no ORT types.
// Semantics: ort_lora/ops/paged_attention_ref.py. The caller has validated every shape, index
// and length (paged_attention_op.cc); the kernel trusts them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/parallel_for.h"

namespace ort_lora {

struct PagedAttentionArgs {
  int64_t num_tokens;    // T, new tokens of all sequences, packed
  int64_t num_seqs;      // B
  int64_t num_heads;     // H
  int64_t kv_num_heads;  // KVH, divides H
  int64_t head_size;     // D
  int64_t block_size;    // cache rows per block
  int64_t max_blocks;    // width of block_table
  int64_t rotary_half;   // cos_cache.shape[1] = rotary_dim / 2; 0 = no rotary
  bool rotary_interleaved;
  float scale;                  // resolved: never 0
  float softcap;                // 0 = off
  int64_t local_window;         // -1 = off
  const float* query;           // [T, H * D]
  const float* key;             // [T, KVH * D]
  const float* value;           // [T, KVH * D]
  float* key_cache;             // [num_blocks, block_size, KVH, D], written in place
  float* value_cache;           // [num_blocks, block_size, KVH, D], written in place
  const int32_t* cu_seqlens;    // [B + 1]
  const int32_t* past_seqlens;  // [B]
  const int32_t* block_table;   // [B, max_blocks]
  const float* cos_cache;       // [max_pos, rotary_half], null without rotary
  const float* sin_cache;       // [max_pos, rotary_half], null without rotary
  const int32_t* slot_mapping;  // [T], null = derived from block_table
  float* output;                // [T, H * D]
};

// Attention of the new tokens over their cached and new keys, then the K/V cache writes.
void PagedAttentionCpu(const PagedAttentionArgs& args, const ParallelFor& parallel_for);

}  // namespace ort_lora
