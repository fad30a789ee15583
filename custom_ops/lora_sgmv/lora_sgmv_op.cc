#include "lora_sgmv/lora_sgmv_op.h"

#include "lora_sgmv/lora_sgmv_cpu.h"
#include "lora_sgmv/lora_sgmv_inputs.h"

namespace ort_lora {

namespace {

constexpr int64_t kMaxRank = 512;

void CheckSegStarts(const int32_t* starts, int64_t num_segments, int64_t num_rows) {
  if (starts[0] != 0) Fail("seg_starts[0] must be 0, got ", starts[0]);
  if (starts[num_segments] != num_rows)
    Fail("seg_starts[", num_segments, "] must be T = ", num_rows, " (the rows of x), got ",
         starts[num_segments]);
  for (int64_t s = 0; s < num_segments; ++s)
    if (starts[s + 1] < starts[s])
      Fail("seg_starts is non-monotonic: seg_starts[", s + 1, "] = ", starts[s + 1],
           " < seg_starts[", s, "] = ", starts[s]);
}

// The flat pool share of this layer: key_cache's elements, then value_cache's.
struct PoolShare {
  const float* key;
  const float* value;
  int64_t half;  // elements in each of key_cache and value_cache
  bool bf16;     // rows hold bfloat16 values, two per pool element

  // Start of the row of `features` values at pool element `offset`; the pool elements it spans
  // (`features`, or ceil(features / 2) for bfloat16 rows) must lie inside one of the halves.
  const void* Row(int64_t offset, int64_t features, const char* name, int64_t slot,
                  int64_t j) const {
    const int64_t len = bf16 ? (features + 1) / 2 : features;  // pool elements
    // Written so that no sum can overflow, whatever the offset.
    if (offset >= 0 && offset < half && len <= half - offset) return key + offset;
    if (offset >= half && offset - half < half && len <= 2 * half - offset)
      return value + (offset - half);
    if (len == 0 && offset >= 0 && offset <= 2 * half) return key;  // empty rows read nothing
    if (bf16)
      Fail(name, "[", slot, ", ", j, "] = ", offset, " is an out-of-range page: a row of ",
           features, " bfloat16 (", len, " pool elements) must lie inside key_cache [0, ", half,
           ") or value_cache [", half, ", ", 2 * half, ")");
    Fail(name, "[", slot, ", ", j, "] = ", offset, " is an out-of-range page: a row of ", len,
         " elements must lie inside key_cache [0, ", half, ") or value_cache [", half, ", ",
         2 * half, ")");
  }
};

// The LoRA tables of one call, seen from one layer.
struct Tables {
  const int32_t* slots;  // [S]
  const int64_t* a_off;  // [num_slots, max_rank]
  const int64_t* b_off;  // [num_slots, max_rank]
  const int32_t* ranks;  // [num_slots], this layer's row
  const float* scales;   // [num_slots], this layer's row
  int64_t num_slots, max_rank;
};

Tables ReadTables(const LoraSgmvInputs& in, int64_t layer) {
  const int64_t num_slots = in.a_offsets.shape[0];
  return {in.seg_slots.value.GetTensorData<int32_t>(),
          in.a_offsets.value.GetTensorData<int64_t>(),
          in.b_offsets.value.GetTensorData<int64_t>(),
          in.ranks.value.GetTensorData<int32_t>() + layer * num_slots,
          in.scales.value.GetTensorData<float>() + layer * num_slots,
          num_slots,
          in.a_offsets.shape[1]};
}

int64_t CheckedRank(const Tables& t, int64_t layer, int64_t slot) {
  const int64_t rank = t.ranks[slot];
  if (rank < 0 || rank > t.max_rank)
    Fail("ranks[", layer, ", ", slot, "] = ", rank, " must be in [0, ", t.max_rank,
         "] (max_rank, a_offsets.shape[1])");
  if (rank > kMaxRank)
    Fail("ranks[", layer, ", ", slot, "] = ", rank, " is a rank over the limit ", kMaxRank);
  return rank;
}

// Appends the slot's rank A row pointers, then its rank B^T row pointers, checking each row.
void AddSlotRows(const Tables& t, const PoolShare& pool, int64_t slot, int64_t rank,
                 int64_t in_features, int64_t out_features, std::vector<const void*>& rows) {
  for (int64_t j = 0; j < rank; ++j)
    rows.push_back(pool.Row(t.a_off[slot * t.max_rank + j], in_features, "a_offsets", slot, j));
  for (int64_t j = 0; j < rank; ++j)
    rows.push_back(pool.Row(t.b_off[slot * t.max_rank + j], out_features, "b_offsets", slot, j));
}

// Validates slots, ranks and the offsets of every row a segment uses (once per slot) and
// fills problem.segments with the active segments; `rows` holds their row pointers.
void BuildSegments(const Tables& t, const PoolShare& pool, int64_t layer, const int32_t* starts,
                   int64_t num_segments, SgmvProblem& problem, std::vector<const void*>& rows) {
  std::vector<int64_t> slot_rows(t.num_slots, -1);  // where a slot's pointers start in rows
  std::vector<int64_t> active;                      // segment indices
  for (int64_t s = 0; s < num_segments; ++s) {
    const int64_t slot = t.slots[s];
    if (slot < -1 || slot >= t.num_slots)
      Fail("seg_slots[", s, "] = ", slot, " must be in [-1, ", t.num_slots, ") (num_slots)");
    if (slot < 0 || starts[s] == starts[s + 1]) continue;
    const int64_t rank = CheckedRank(t, layer, slot);
    if (rank == 0) continue;
    if (slot_rows[slot] < 0) {
      slot_rows[slot] = static_cast<int64_t>(rows.size());
      AddSlotRows(t, pool, slot, rank, problem.in_features, problem.out_features, rows);
    }
    active.push_back(s);
  }
  for (int64_t s : active) {  // rows no longer grows: its pointers are stable now
    const int64_t slot = t.slots[s];
    const void* const* base = rows.data() + slot_rows[slot];
    problem.segments.push_back(
        {starts[s], starts[s + 1], t.ranks[slot], t.scales[slot], base, base + t.ranks[slot]});
  }
}

void OrtParallelFor(void* runner, void (*fn)(void*, size_t), size_t total, void* data) {
  static_cast<const Ort::KernelContext*>(runner)->ParallelFor(fn, total, 0, data);
}

}  // namespace

LoraSgmvKernel::LoraSgmvKernel(const OrtApi&, const OrtKernelInfo* info) {
  Ort::ConstKernelInfo ki(info);
  layer_ = ki.GetAttribute<int64_t>("layer");
  if (layer_ < 0) Fail("attribute 'layer' must be >= 0, got ", layer_);
  const int64_t dtype = ReadAdapterDtype(ki, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
  if (dtype != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT &&
      dtype != ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16)
    Fail("attribute 'adapter_dtype' = ", dtype,
         " is not supported by the CPU op: it must be 1 (FLOAT, float32 rows) or 16 (BFLOAT16, "
         "bfloat16 rows in the float32 pool)");
  bf16_rows_ = dtype == ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
}

OrtStatusPtr LoraSgmvKernel::ComputeV2(OrtKernelContext* context) {
  return GuardCompute("LoraSGMV", [&] { Compute(context); });
}

void LoraSgmvKernel::Compute(OrtKernelContext* context) {
  Ort::KernelContext ctx(context);
  const LoraSgmvInputs in = ReadLoraSgmvInputs(ctx, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
  const int64_t num_layers = in.ranks.shape[0];
  if (layer_ >= num_layers)
    Fail("attribute 'layer' = ", layer_, " must be < num_layers = ", num_layers,
         " (ranks.shape[0])");
  const int64_t num_rows = in.y.shape[0];
  const int64_t num_segments = in.seg_slots.shape[0];
  const int32_t* starts = in.seg_starts.value.GetTensorData<int32_t>();
  CheckSegStarts(starts, num_segments, num_rows);

  const int64_t half = in.key_cache.value.GetTensorTypeAndShapeInfo().GetElementCount();
  const PoolShare pool{in.key_cache.value.GetTensorData<float>(),
                       in.value_cache.value.GetTensorData<float>(), half, bf16_rows_};
  SgmvProblem problem{in.x.value.GetTensorData<float>(),
                      in.y.value.GetTensorData<float>(),
                      nullptr,
                      num_rows,
                      in.x.shape[1],
                      in.y.shape[1],
                      bf16_rows_ ? SgmvRowType::kBFloat16 : SgmvRowType::kFloat32,
                      {}};
  std::vector<const void*> rows;
  BuildSegments(ReadTables(in, layer_), pool, layer_, starts, num_segments, problem, rows);
  problem.y_out = ctx.GetOutput(0, in.y.shape).GetTensorMutableData<float>();
  LoraSgmvCpu(problem, OrtParallelFor, &ctx);
}

OrtStatusPtr LoraSgmvOp::CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info,
                                        void** kernel) const {
  return GuardCompute("LoraSGMV", [&] { *kernel = new LoraSgmvKernel(api, info); });
}

ONNXTensorElementDataType LoraSgmvOp::GetInputType(size_t index) const {
  switch (index) {
    case kSegStarts:
    case kSegSlots:
    case kRanks:
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    case kAOffsets:
    case kBOffsets:
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    default:
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
}

}  // namespace ort_lora
