// The checks of LoraSGMV's LoRA metadata, one module for every provider: the CPU op
// (lora_sgmv_op.cc) and the CUDA host plan (cuda/sgmv_plan.cc, also built without ORT for the
// CPU emulator and the C entries). No ONNX Runtime or CUDA types. The op contract is in
// lora_sgmv_op.h; the input shapes are checked before (lora_sgmv_inputs.h, or the C caller).
//
// Contract, checked in this order; the first violation throws InputError (common/errors.h)
// naming the element and the expected range:
//   layer         in [0, num_layers)                                     CheckSgmvLayer
//   seg_starts    seg_starts[0] = 0 <= seg_starts[1] <= ... <= seg_starts[S] = T
//   seg_slots[s]  in [-1, num_slots)                                     ListSgmvTerms
//   composition entries e = 0 .. E-1:
//     comp_segs[e] in [0, S), comp_slots[e] in [0, num_slots), comp_weights[e] finite
//   dora_offsets[slot] in {-1} or [0, 2 half]; a slot with a DoRA row (>= 0) is the only term
//     of every segment it appears in (a DoRA adapter cannot be composed)
//   then segment by segment (s = 0 .. S-1), for a segment with rows:     CheckSgmvSegments
//     ranks[layer, slot] in [0, max_rank] and <= the provider's limit (SgmvRankLimit), for
//     each of its terms; the sum over its terms also <= the limit
//     the first time a slot of rank > 0 is used, rows j < rank of A then of B^T:
//       a_offsets[slot, j] / b_offsets[slot, j] = o: the row of in / out features at pool
//       element o lies wholly inside key_cache [0, half) or value_cache [half, 2 half);
//       a row spans the pool elements its slot's layout gives it (SgmvRowElems: n bfloat16
//       packed in a float32 pool span ceil(n / 2) of them). An empty
//       row (0 features) reads nothing: any o in [0, 2 half] will do.
//     a DoRA segment with an active term: its dora_offsets row of out features, likewise.
// Offsets of rows j >= rank, and DoRA rows of slots no active DoRA segment uses, are never read.
#pragma once

#include <cstdint>
#include <vector>

namespace ort_lora {

// Modules one LoraSGMV node may serve (attribute `modules`, CPU): q/k/v, the most that read one
// x. Every provider's op declares their inputs and outputs (ORT requires one input count for an
// op name); the CUDA op takes one module.
constexpr int kSgmvMaxModules = 3;

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
  int64_t out_features;  // the length of a row of B^T (and of a DoRA row)
  // Composition: E more (segment, slot, weight) terms; null pointers when E = 0.
  const int32_t* comp_segs;     // [E]
  const int32_t* comp_slots;    // [E]
  const float* comp_weights;    // [E]
  int64_t num_comp;             // E
  const int64_t* dora_offsets;  // [num_slots], or null: no slot has a DoRA row
};

// How a row of adapter values sits in pool elements (the op's attribute adapter_dtype).
enum class SgmvRowLayout : int {
  kPoolType = 0,       // one value per pool element, of the pool's own type
  kBFloat16Pairs = 1,  // CPU adapter_dtype 16: bfloat16 values, two per float32 pool element
  kInt8Scaled = 2,     // CPU adapter_dtype 3: the row's float32 scale, then its int8 values
                       // four per pool element (value = scale * q)
  kFloat16Pairs = 3,   // CPU adapter_dtype 10: IEEE float16 values, two per float32 element
};
constexpr int kSgmvRowLayouts = 4;

// Pool elements one row of `features` values spans.
inline int64_t SgmvRowElems(SgmvRowLayout layout, int64_t features) {
  switch (layout) {
    case SgmvRowLayout::kBFloat16Pairs:
    case SgmvRowLayout::kFloat16Pairs:
      return (features + 1) / 2;
    case SgmvRowLayout::kInt8Scaled:
      return features == 0 ? 0 : 1 + (features + 3) / 4;
    default:
      return features;
  }
}

// The layer's pool share: key_cache (elements [0, half)), then value_cache ([half, 2 half)).
struct SgmvPool {
  const void* key_cache;
  const void* value_cache;
  int64_t half;        // elements in each of key_cache and value_cache
  int64_t elem_size;   // bytes per pool element (float32 on CPU, float16/bfloat16 on CUDA)
  SgmvRowLayout rows;  // how a row's values sit in pool elements
  const SgmvRowLayout* slot_rows = nullptr;  // [num_slots]: each slot's own, in place of rows
};

// How slot `slot`'s rows sit in the pool's elements.
inline SgmvRowLayout SlotRowLayout(const SgmvPool& pool, int64_t slot) {
  return pool.slot_rows == nullptr ? pool.rows : pool.slot_rows[slot];
}

// A provider's largest supported rank and the words its error uses for it:
// "ranks[l, s] = r is <what> <max>".
struct SgmvRankLimit {
  int64_t max;
  const char* what;
};

// Every segment's adapters: segment s's terms are [starts[s], starts[s + 1]) of slots and
// weights: seg_slots[s] (weight 1) if >= 0, then its composition entries in input order.
// A segment is DoRA when it has exactly one term and that slot has a DoRA row.
struct SgmvTerms {
  std::vector<int64_t> starts;  // [S + 1]
  std::vector<int32_t> slots;
  std::vector<float> weights;
  std::vector<bool> dora;  // [S]
};

// One adapter of an active segment at the layer: rank > 0.
struct SgmvActiveTerm {
  int64_t slot;
  int64_t rank;  // ranks[layer, slot], 1..limit
  float scale;   // scales[layer, slot] * the term's weight
  int64_t rows;  // index in `rows` of the slot's rank A row pointers, then its rank B^T ones
};

// A segment with rows and at least one term of rank > 0 at the layer.
struct SgmvActiveSegment {
  int64_t seg;         // index in seg_slots
  int32_t row_begin;   // seg_starts[seg]: its first row of x and y
  int32_t row_end;     // seg_starts[seg + 1]: one past its last row
  int64_t rank;        // the sum of its active terms' ranks, 1..limit
  int64_t first_term;  // its active terms: [first_term, first_term + num_terms) of terms
  int64_t num_terms;   // >= 1
  const void* dora;    // a DoRA segment's row of out features (pool address), else null
};

struct SgmvCheckedCall {
  std::vector<SgmvActiveSegment> segments;  // in segment order
  std::vector<SgmvActiveTerm> terms;
  std::vector<const void*> rows;   // per used slot: its A then its B^T row pointers
  std::vector<int64_t> slot_rows;  // scratch: per slot, where its pointers start in rows
};

// Throws unless layer is in [0, num_layers).
void CheckSgmvLayer(const SgmvMetadata& m);

// Checks seg_starts, seg_slots, the composition entries and the DoRA rule (see above), and
// lists every segment's terms. Independent of the layer and the pool.
SgmvTerms ListSgmvTerms(const SgmvMetadata& m);
// The same into `out`, whose vectors keep their capacity from one call to the next (no heap
// allocation per call once they have grown).
void ListSgmvTerms(const SgmvMetadata& m, SgmvTerms& out);

// Checks every segment with rows at m.layer (ranks, rows) and resolves the rows: once per used
// slot, its A then B^T row pointers (pool addresses).
SgmvCheckedCall CheckSgmvSegments(const SgmvMetadata& m, const SgmvTerms& terms,
                                  const SgmvPool& pool, const SgmvRankLimit& limit);
// The same into `out` (reused as ListSgmvTerms' `out` is).
void CheckSgmvSegments(const SgmvMetadata& m, const SgmvTerms& terms, const SgmvPool& pool,
                       const SgmvRankLimit& limit, SgmvCheckedCall& out);

}  // namespace ort_lora
