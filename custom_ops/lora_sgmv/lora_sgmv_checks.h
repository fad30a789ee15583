// The checks of LoraSGMV's LoRA metadata, one module for every provider: the CPU op
// (lora_sgmv_op.cc) and the CUDA host plan (cuda/sgmv_plan.cc, also built without ORT for the
// CPU emulator and the C entries). No ONNX Runtime or CUDA types. The op contract is in
// lora_sgmv_op.h; the input shapes are checked before (lora_sgmv_inputs.h, or the C caller).
//
// Contract, checked in this order; the first violation throws InputError (common/errors.h)
// naming the element and the expected range:
//   layer         in [0, num_layers)                                     CheckSgmvLayer
//   seg_starts    seg_starts[0] = 0 <= seg_starts[1] <= ... <= seg_starts[S] = T
//   then segment by segment (s = 0 .. S-1):                              CheckSgmvSegments
//     seg_slots[s]       in [-1, num_slots)
//     the rest only for a segment with an adapter (slot >= 0) and rows:
//     ranks[layer, slot] in [0, max_rank] and <= the provider's limit (SgmvRankLimit)
//     the first time a slot is used, rows j < rank of A then of B^T:
//       a_offsets[slot, j] / b_offsets[slot, j] = o: the row of in / out features at pool
//       element o lies wholly inside key_cache [0, half) or value_cache [half, 2 half);
//       a row of n bfloat16 packed in a float32 pool spans ceil(n / 2) pool elements. An empty
//       row (0 features) reads nothing: any o in [0, 2 half] will do.
// Offsets of rows j >= rank are never read.
#pragma once

#include <cstdint>
#include <vector>

namespace ort_lora {

// The host-resident LoRA inputs of one call, as LoraSGMV defines them (lora_sgmv_op.h).
struct SgmvMetadata {
  const int32_t* seg_starts;  // [S + 1]
  const int32_t* seg_slots;   // [S]
  const int64_t* a_offsets;   // [num_slots, max_rank]
  const int64_t* b_offsets;   // [num_slots, max_rank]
  const int32_t* ranks;       // [num_layers, num_slots]
  const float* scales;        // [num_layers, num_slots]
  int64_t num_segments, num_slots, max_rank, num_layers, layer;
  int64_t num_rows;      // T, the rows of x and y
  int64_t in_features;   // the length of a row of A
  int64_t out_features;  // the length of a row of B^T
};

// The layer's pool share: key_cache (elements [0, half)), then value_cache ([half, 2 half)).
struct SgmvPool {
  const void* key_cache;
  const void* value_cache;
  int64_t half;       // elements in each of key_cache and value_cache
  int64_t elem_size;  // bytes per pool element (float32 on CPU, float16/bfloat16 on CUDA)
  bool bf16_rows;     // rows are bfloat16 packed two per pool element (CPU adapter_dtype 16)
};

// A provider's largest supported rank and the words its error uses for it:
// "ranks[l, s] = r is <what> <max>".
struct SgmvRankLimit {
  int64_t max;
  const char* what;
};

// A segment that runs its adapter: slot >= 0, rank > 0, at least one row.
struct SgmvActiveSegment {
  int64_t seg;        // index in seg_slots
  int64_t slot;       // its adapter slot
  int32_t row_begin;  // seg_starts[seg]: its first row of x and y
  int32_t row_end;    // seg_starts[seg + 1]: one past its last row
  int64_t rank;       // ranks[layer, slot], 1..limit
  float scale;        // scales[layer, slot]
  int64_t rows;       // index in `rows` of the slot's rank A row pointers, then its rank B^T ones
};

// Throws unless layer is in [0, num_layers).
void CheckSgmvLayer(const SgmvMetadata& m);

// Checks seg_starts and every segment (see above) and resolves the rows: appends, once per used
// slot, its A then B^T row pointers (pool addresses) to `rows`. Returns the active segments in
// segment order.
std::vector<SgmvActiveSegment> CheckSgmvSegments(const SgmvMetadata& m, const SgmvPool& pool,
                                                 const SgmvRankLimit& limit,
                                                 std::vector<const void*>& rows);

}  // namespace ort_lora
