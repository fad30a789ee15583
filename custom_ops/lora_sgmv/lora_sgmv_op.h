// LoraSGMV (domain ort_lora, CPU, float32): the Punica SGMV operator over pool pages, with
// weighted composition (several adapters over one segment's rows) and DoRA segments.
//
// Semantics (the numpy reference is ort_lora/ops/lora_sgmv_ref.py::lora_sgmv):
//   terms(s) = (seg_slots[s], 1) if seg_slots[s] >= 0, then (comp_slots[e], comp_weights[e])
//              for each composition entry e with comp_segs[e] = s, in order e
//   y_out = y; for each segment s, rows t in [seg_starts[s], seg_starts[s+1]):
//     for each term (slot, w) of s with r = ranks[layer, slot] > 0:
//       v[t, j]  = w * scales[layer, slot] * sum_k x[t, k] * A_j[k]    j < r  (shrink)
//       y_out[t] += sum_j v[t, j] * Bt_j                                      (expand)
//     DoRA: if s has ONE term, whose slot has dora_offsets[slot] >= 0, and r > 0:
//       y_out[t] *= 1 + D,  D = region[dora_offsets[slot] : + out]  (per output channel)
//   where A_j  = region[a_offsets[slot, j] : + in]   (row j of A, r x in)
//         Bt_j = region[b_offsets[slot, j] : + out]  (row j of B^T, r x out)
//   and region is this layer's pool share seen as one flat array: key_cache's elements
//   followed by value_cache's (offset o < numel(key_cache) reads key_cache, else value_cache).
//   D is DoRA's m / ||W + s B A||_row - 1 (stored minus one: its rounding to the row type then
//   errs on the small correction, not on the whole scale); y is W x without bias, so
//   y_out + bias is PEFT's DoRA output. A DoRA slot in a segment of two or more terms is an
//   error: DoRA adapters cannot be composed.
//
// Inputs                                           Output
//   0 y            float [T, out]                     0 y_out float [T, out], may be y's
//                                                       buffer (ORT decides: in place when
//                                                       only this node reads y; y_out's
//                                                       shape is inferred as y's)
//   1 x            float [T, in]
//   2 key_cache    float [num_pages, block_size, kv_heads, head_dim]
//   3 value_cache  float [num_pages, block_size, kv_heads, head_dim]
//   4 seg_starts   int32 [S + 1]   0 = s_0 <= s_1 <= ... <= s_S = T
//   5 seg_slots    int32 [S]       adapter slot of each segment (weight 1), -1 = none
//   6 a_offsets    int64 [num_slots, max_rank]
//   7 b_offsets    int64 [num_slots, max_rank]
//   8 ranks        int32 [num_layers, num_slots]   0 <= rank <= max_rank
//   9 scales       float [num_layers, num_slots]
//  10 comp_segs    int32 [E]   optional: the segment of each composition entry, in [0, S)
//  11 comp_slots   int32 [E]   optional: its adapter slot, in [0, num_slots)
//  12 comp_weights float [E]   optional: its weight, finite
//  13 dora_offsets int64 [num_slots] or [0]   optional: pool element of the slot's DoRA row
//                                             D [out], -1 = none; [0] or absent: no DoRA
//  Modules (attribute modules = M, 1 to 3; default 1): one call serves M modules that read the
//  same x (q/k/v, gate/up). Inputs 0..13 above are module 0's and the shared ones (x, the
//  caches, the segments, the composition entries); each further module m = 1 .. M-1 adds
//  14 + 6 (m - 1) + 0 y_m            float [T, out_m]
//                 + 1 a_offsets_m    int64 [num_slots, max_rank_m]
//                 + 2 b_offsets_m    int64 [num_slots, max_rank_m]
//                 + 3 ranks_m        int32 [num_layers_m, num_slots]
//                 + 4 scales_m       float [num_layers_m, num_slots]
//                 + 5 dora_offsets_m int64 [num_slots] or [0]   optional, as dora_offsets
//  and output m, y_out_m float [T, out_m] (may be y_m's buffer). Output m is exactly what a
//  one-module call with module m's y, tables and dora_offsets, and the shared inputs, gives
//  (ort_lora/ops/lora_sgmv_ref.py::lora_sgmv_modules): the call only shares the work, one
//  shrink of x against every module's A rows, and the fixed cost. A bad input of module m >= 1
//  is named <name>_m, a bad value in its tables "module m: ...".
//  Row types per slot (optional, after module 2's inputs: input 26, kRowTypes):
//  26 row_types    int32 [num_slots] or [0]   per slot, the ONNX element type of its A, B^T
//                                             and D rows, as attribute adapter_dtype below
//                                             (1, 16, 10 or 3), in place of the attribute;
//                                             [0] or absent: the attribute's for every slot
//  A segment may compose slots of different row types. The kernel runs one problem per row
//  type the call's terms use, in turn, each after the first adding to y_out in place: the
//  same sums in another order (float32 accumulation). A bad entry fails, naming it.
// Attributes:
//   layer (int) selects the row of ranks and scales (of every module).
//   modules (int, optional, 1 to 3; default 1): the number of modules, and of outputs.
//   adapter_dtype (int, optional; an ONNX TensorProto element type) is the type of the rows:
//     absent or 1 (FLOAT): A_j, Bt_j and D are float32 pool elements, as above.
//     16 (BFLOAT16): rows are bfloat16 packed two per float32 pool element. The row at pool
//       element o is the region seen as uint16 (little-endian: an element's first bfloat16 is
//       its low 16 bits), bfloat16 elements [2 o, 2 o + len), widened exactly (bits << 16);
//       it spans ceil(len / 2) pool elements, all inside key_cache or inside value_cache (an
//       odd len leaves one padding bfloat16, never read). Accumulation stays float32.
//     10 (FLOAT16): as 16, the values IEEE float16 (binary16), widened exactly.
//     3 (INT8): rows are int8 with one float32 scale per row. The row at pool element o is
//       scale = element o (float32), then int8 values q[0:len] from byte 4 (o + 1) of the
//       region (four per pool element, the first in the low byte; the last element padded);
//       value k = scale * q[k]. It spans 1 + ceil(len / 4) pool elements (0 when len = 0),
//       all inside key_cache or inside value_cache. Accumulation stays float32.
//     Any other value fails at kernel creation, naming the attribute and the allowed values.
// Limits: rank <= 512 (kMaxRank), also for the sum of a segment's terms. Bad inputs (shapes,
// non-monotonic seg_starts, slot or rank out of range, a used row outside key_cache / value_cache,
// a weight not finite, a composed DoRA slot) fail with an error naming them (the checks, shared
// with the CUDA op: lora_sgmv_checks.h); offsets of rows j >= rank are never read. A call whose
// segments have no term of nonzero rank (no composition entry, and every seg_slots entry -1 or
// a slot of rank 0 at the layer in every module: a step without adapters, or with adapters that
// leave these modules out) is y_out = y and reads only y, x, seg_slots, comp_segs and, where a
// slot is in use, the ranks; its other inputs are not checked. The kernel is lora_sgmv_cpu.h.
#pragma once

#include "common/ort_common.h"
#include "lora_sgmv/lora_sgmv_checks.h"
#include "lora_sgmv/lora_sgmv_inputs.h"
#include "lora_sgmv/lora_sgmv_types.h"

namespace ort_lora {

struct LoraSgmvKernel {
  LoraSgmvKernel(const OrtApi& api, const OrtKernelInfo* info);
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

 private:
  void Compute(OrtKernelContext* context);
  int64_t layer_;
  int modules_;         // attribute modules: outputs of the node
  SgmvRowLayout rows_;  // attribute adapter_dtype: 1 float32, 16 bfloat16, 10 float16, 3 int8
};

struct LoraSgmvOp : Ort::CustomOpBase<LoraSgmvOp, LoraSgmvKernel, true> {
  // y_out_m may reuse y_m's buffer (the projection's output, read by nothing else): then rows
  // without an adapter cost nothing (no y -> y_out copy), and the others are updated in place.
  LoraSgmvOp();
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const;
  const char* GetName() const { return "LoraSGMV"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  // Inputs and output as lora_sgmv_inputs.h describes them, T = float32: every provider's 14,
  // then modules 1 and 2's and row_types (all optional).
  size_t GetInputTypeCount() const { return kNumLoraSgmvOpInputs; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return LoraSgmvModulesInputType(index, kElementType);
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return LoraSgmvInputCharacteristic(index);
  }
  size_t GetOutputTypeCount() const { return kSgmvMaxModules; }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t index) const {
    return index == 0 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }
  ONNXTensorElementDataType GetOutputType(size_t) const { return kElementType; }

 private:
  static constexpr ONNXTensorElementDataType kElementType = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
};

}  // namespace ort_lora
