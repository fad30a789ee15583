#include "paged_attention/paged_attention_op.h"

#include <cmath>
#include <vector>

#include "paged_attention/paged_attention_cpu.h"

namespace ort_lora {

namespace {

constexpr auto kF32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto kI32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
enum Input {
  kQuery,
  kKey,
  kValue,
  kKeyCache,
  kValueCache,
  kCuSeqlens,
  kPast,
  kBlockTable,
  kCos,
  kSin,
  kSlotMapping,
  kNumInputs
};

const int32_t* Int32Data(const InputView& v) {
  return v.present ? v.value.GetTensorData<int32_t>() : nullptr;
}

// cumulative_sequence_length: starts at 0, non-decreasing, ends at T; past_seqlens >= 0.
void CheckSequences(const PagedAttentionArgs& a) {
  const int32_t* cu = a.cu_seqlens;
  if (cu[0] != 0) Fail("input 'cumulative_sequence_length' must start at 0, got ", cu[0]);
  for (int64_t b = 0; b < a.num_seqs; ++b) {
    if (cu[b + 1] < cu[b])
      Fail("input 'cumulative_sequence_length' is non-monotonic: element ", b + 1, " (", cu[b + 1],
           ") < element ", b, " (", cu[b], ")");
    if (a.past_seqlens[b] < 0)
      Fail("input 'past_seqlens' element ", b, " is ", a.past_seqlens[b], "; expected >= 0");
  }
  if (cu[a.num_seqs] != a.num_tokens)
    Fail("input 'cumulative_sequence_length' must end at num_tokens (", a.num_tokens,
         " rows of 'query'), got ", cu[a.num_seqs]);
}

// Every block a sequence reads (its past) or writes (its new tokens, without slot_mapping) is
// in [0, num_blocks), and block_table is wide enough for past + new tokens.
void CheckBlocks(const PagedAttentionArgs& a, int64_t num_blocks) {
  for (int64_t b = 0; b < a.num_seqs; ++b) {
    const int64_t past = a.past_seqlens[b];
    const int64_t total = past + a.cu_seqlens[b + 1] - a.cu_seqlens[b];
    const int64_t needed = (total + a.block_size - 1) / a.block_size;
    if (needed > a.max_blocks)
      Fail("input 'block_table' has ", a.max_blocks, " columns; sequence ", b, " needs ", needed,
           " blocks for ", total, " tokens (past + new) of block_size ", a.block_size);
    const int64_t checked = a.slot_mapping ? (past + a.block_size - 1) / a.block_size : needed;
    for (int64_t i = 0; i < checked; ++i) {
      const int64_t id = a.block_table[b * a.max_blocks + i];
      if (id < 0 || id >= num_blocks)
        Fail("input 'block_table' [", b, ", ", i, "] = ", id, " is out of range [0, ", num_blocks,
             ") (num_blocks of 'key_cache')");
    }
  }
}

void CheckSlots(const PagedAttentionArgs& a, int64_t num_blocks) {
  const int64_t slots = num_blocks * a.block_size;
  for (int64_t t = 0; t < a.num_tokens; ++t)
    if (a.slot_mapping[t] < -1 || a.slot_mapping[t] >= slots)
      Fail("input 'slot_mapping' element ", t, " = ", a.slot_mapping[t], " is out of range [-1, ",
           slots, ") (num_blocks * block_size)");
}

// cos_cache / sin_cache have a row for the largest position of every sequence.
void CheckRotaryRows(const PagedAttentionArgs& a, int64_t rows) {
  for (int64_t b = 0; b < a.num_seqs; ++b) {
    const int64_t total = a.past_seqlens[b] + a.cu_seqlens[b + 1] - a.cu_seqlens[b];
    if (total > rows)
      Fail("input 'cos_cache' has ", rows, " rows (positions); sequence ", b,
           " needs positions up to ", total - 1, " (", total, " rows)");
  }
}

}  // namespace

PagedAttentionKernel::PagedAttentionKernel(const OrtApi&, const OrtKernelInfo* info) {
  Ort::ConstKernelInfo ki(info);
  num_heads_ = RequiredInt(ki, "num_heads");
  kv_num_heads_ = RequiredInt(ki, "kv_num_heads");
  scale_ = AttrOr<float>(ki, "scale", 0.0f);
  do_rotary_ = AttrOr<int64_t>(ki, "do_rotary", 0);
  rotary_interleaved_ = AttrOr<int64_t>(ki, "rotary_interleaved", 0);
  local_window_size_ = AttrOr<int64_t>(ki, "local_window_size", -1);
  softcap_ = AttrOr<float>(ki, "softcap", 0.0f);
  if (num_heads_ <= 0 || kv_num_heads_ <= 0 || num_heads_ % kv_num_heads_ != 0)
    Fail("num_heads (", num_heads_, ") must be a positive multiple of kv_num_heads (",
         kv_num_heads_, ")");
  if (local_window_size_ < -1)
    Fail("attribute 'local_window_size' must be -1 (unused) or >= 0, got ", local_window_size_);
  if (!(softcap_ >= 0.0f)) Fail("attribute 'softcap' must be >= 0 (0 = off), got ", softcap_);
  if (!std::isfinite(scale_)) Fail("attribute 'scale' must be finite, got ", scale_);
  if (do_rotary_ != 0 && do_rotary_ != 1)
    Fail("attribute 'do_rotary' must be 0 or 1, got ", do_rotary_);
}

OrtStatusPtr PagedAttentionKernel::ComputeV2(OrtKernelContext* context) {
  return GuardCompute("PagedAttention", [&] { Compute(context); });
}

// Ranks, dtypes and sizes of every input; the returned args point at the inputs' data.
PagedAttentionArgs PagedAttentionKernel::CheckShapes(const InputView* in) const {
  Expect(in[kQuery], "query", 2, kF32);
  Expect(in[kKey], "key", 2, kF32);
  Expect(in[kValue], "value", 2, kF32);
  Expect(in[kKeyCache], "key_cache", 4, kF32);
  Expect(in[kValueCache], "value_cache", 4, kF32);
  Expect(in[kCuSeqlens], "cumulative_sequence_length", 1, kI32);
  Expect(in[kPast], "past_seqlens", 1, kI32);
  Expect(in[kBlockTable], "block_table", 2, kI32);
  const auto& qs = in[kQuery].shape;
  if (qs[1] <= 0 || qs[1] % num_heads_ != 0)
    Fail("input 'query' dim 1 must be num_heads (", num_heads_, ") * head_size, got shape ",
         ShapeStr(qs));
  PagedAttentionArgs a{};
  a.num_tokens = qs[0];
  a.num_heads = num_heads_;
  a.kv_num_heads = kv_num_heads_;
  a.head_size = qs[1] / num_heads_;
  for (Input i : {kKey, kValue}) {
    const char* name = i == kKey ? "key" : "value";
    ExpectDim(in[i], name, 0, a.num_tokens, "num_tokens, rows of 'query'");
    ExpectDim(in[i], name, 1, kv_num_heads_ * a.head_size, "kv_num_heads * head_size");
  }
  ExpectDim(in[kKeyCache], "key_cache", 2, kv_num_heads_, "kv_num_heads");
  ExpectDim(in[kKeyCache], "key_cache", 3, a.head_size, "head_size");
  if (in[kKeyCache].shape[1] <= 0)
    Fail("input 'key_cache' dim 1 (block_size) must be > 0, got shape ",
         ShapeStr(in[kKeyCache].shape));
  if (in[kValueCache].shape != in[kKeyCache].shape)
    Fail("input 'value_cache' must have the shape of 'key_cache' ", ShapeStr(in[kKeyCache].shape),
         ", got ", ShapeStr(in[kValueCache].shape));
  a.block_size = in[kKeyCache].shape[1];
  a.num_seqs = in[kPast].shape[0];
  ExpectDim(in[kCuSeqlens], "cumulative_sequence_length", 0, a.num_seqs + 1,
            "batch_size + 1, batch_size from 'past_seqlens'");
  ExpectDim(in[kBlockTable], "block_table", 0, a.num_seqs, "batch_size");
  a.max_blocks = in[kBlockTable].shape[1];
  if (in[kSlotMapping].present) {
    Expect(in[kSlotMapping], "slot_mapping", 1, kI32);
    ExpectDim(in[kSlotMapping], "slot_mapping", 0, a.num_tokens, "num_tokens, rows of 'query'");
  }
  if (do_rotary_) CheckRotaryShapes(in, a);
  a.scale = scale_ != 0.0f ? scale_ : 1.0f / std::sqrt(static_cast<float>(a.head_size));
  a.softcap = softcap_;
  a.local_window = local_window_size_;
  a.query = in[kQuery].value.GetTensorData<float>();
  a.key = in[kKey].value.GetTensorData<float>();
  a.value = in[kValue].value.GetTensorData<float>();
  // The caches are updated in place: the engine binds one pool and never copies it.
  a.key_cache = const_cast<float*>(in[kKeyCache].value.GetTensorData<float>());
  a.value_cache = const_cast<float*>(in[kValueCache].value.GetTensorData<float>());
  a.cu_seqlens = Int32Data(in[kCuSeqlens]);
  a.past_seqlens = Int32Data(in[kPast]);
  a.block_table = Int32Data(in[kBlockTable]);
  a.slot_mapping = Int32Data(in[kSlotMapping]);
  return a;
}

// cos_cache / sin_cache: present, [max_pos, rotary_dim / 2] with rotary_dim <= head_size.
void PagedAttentionKernel::CheckRotaryShapes(const InputView* in, PagedAttentionArgs& a) const {
  Expect(in[kCos], "cos_cache", 2, kF32);
  Expect(in[kSin], "sin_cache", 2, kF32);
  const auto& cs = in[kCos].shape;
  if (cs[1] <= 0 || 2 * cs[1] > a.head_size)
    Fail("input 'cos_cache' dim 1 (rotary_dim / 2) must be in [1, head_size / 2 = ",
         a.head_size / 2, "], got shape ", ShapeStr(cs));
  if (in[kSin].shape != cs)
    Fail("input 'sin_cache' must have the shape of 'cos_cache' ", ShapeStr(cs), ", got ",
         ShapeStr(in[kSin].shape));
  a.rotary_half = cs[1];
  a.rotary_interleaved = rotary_interleaved_ != 0;
  a.cos_cache = in[kCos].value.GetTensorData<float>();
  a.sin_cache = in[kSin].value.GetTensorData<float>();
}

void PagedAttentionKernel::Compute(OrtKernelContext* context) {
  Ort::KernelContext ctx(context);
  if (ctx.GetOutputCount() > 1)
    Fail("outputs 'key_cache_out' and 'value_cache_out' are not supported on CPU (the caches ",
         "are updated in place); the node must have only the 'output' output, it has ",
         ctx.GetOutputCount());
  InputView in[kNumInputs];  // in place: a decode step's calls allocate nothing here
  for (size_t i = 0; i < kNumInputs; ++i) in[i] = GetInput(ctx, i);
  PagedAttentionArgs a = CheckShapes(in);
  CheckSequences(a);
  CheckBlocks(a, in[kKeyCache].shape[0]);
  if (a.slot_mapping) CheckSlots(a, in[kKeyCache].shape[0]);
  if (a.rotary_half) CheckRotaryRows(a, in[kCos].shape[0]);
  const int64_t output_shape[2] = {a.num_tokens, a.num_heads * a.head_size};
  a.output = ctx.GetOutput(0, output_shape, 2).GetTensorMutableData<float>();
  PagedAttentionCpu(a, OrtParallelFor(ctx));
}

OrtStatusPtr PagedAttentionOp::CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info,
                                              void** kernel) const {
  return GuardCompute("PagedAttention", [&] { *kernel = new PagedAttentionKernel(api, info); });
}

ONNXTensorElementDataType PagedAttentionOp::GetInputType(size_t index) const {
  return (index >= 5 && index <= 7) || index == 10 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32
                                                   : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}

OrtCustomOpInputOutputCharacteristic PagedAttentionOp::GetInputCharacteristic(size_t index) const {
  return index >= 8 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
}

}  // namespace ort_lora
