#include "lora_sgmv/lora_sgmv_op.h"

#include <algorithm>

#include "lora_sgmv/lora_sgmv_cpu.h"
#include "lora_sgmv/lora_sgmv_inputs.h"

namespace ort_lora {

namespace {

constexpr int64_t kMaxRank = 512;
constexpr SgmvRankLimit kRankLimit{kMaxRank, "a rank over the limit"};

// Input index of module m's y (module 0: input 0).
size_t ModuleYInput(size_t m) { return m == 0 ? kY : LoraSgmvModuleInputIndex(m, kModuleY); }

// What one call works with, kept by the calling thread from call to call so that the vectors
// keep their capacity (a decode step's calls then allocate nothing here).
struct CallScratch {
  SgmvTerms terms[kSgmvMaxModules];
  SgmvCheckedCall calls[kSgmvMaxModules];
  std::vector<SgmvRowLayout> slot_rows;  // per slot, from row_types
  std::vector<const void*> rows;         // the problem's segments point into rows and scales
  std::vector<float> scales;
  SgmvProblem problem;
};

CallScratch& CallerScratch() {
  thread_local CallScratch scratch;
  return scratch;
}

// The active segments of every module, merged by segment (each call's are in segment order):
// the next segment active in some module, as each module's index of it in its call's segments
// (-1: not active there) in `at`; false when none is left.
bool NextSegment(const SgmvCheckedCall* calls, int modules, size_t* next, int64_t* at) {
  int64_t seg = -1;
  for (int m = 0; m < modules; ++m)
    if (next[m] < calls[m].segments.size()) {
      const int64_t s = calls[m].segments[next[m]].seg;
      seg = seg < 0 ? s : std::min(seg, s);
    }
  if (seg < 0) return false;
  for (int m = 0; m < modules; ++m) {
    const bool here = next[m] < calls[m].segments.size() && calls[m].segments[next[m]].seg == seg;
    at[m] = here ? static_cast<int64_t>(next[m]++) : -1;
  }
  return true;
}

// Which terms go into a kernel problem: with per-slot row layouts (row_types), those of slots
// whose rows are laid out as `only`; without (slot_rows null), every term.
struct TermFilter {
  const SgmvRowLayout* slot_rows;
  SgmvRowLayout only;
  bool operator()(const SgmvActiveTerm& t) const {
    return slot_rows == nullptr || slot_rows[t.slot] == only;
  }
};

// The summed rank of the segment's terms that `take` takes.
int64_t TakenRank(const SgmvCheckedCall& call, const SgmvActiveSegment& a, const TermFilter& take) {
  int64_t rank = 0;
  for (int64_t i = a.first_term; i < a.first_term + a.num_terms; ++i)
    if (take(call.terms[i])) rank += call.terms[i].rank;
  return rank;
}

// Writes a module's part of one segment: the A and B^T row pointers of the terms `take` takes
// (at a_rows[j], bt_rows[j] from j on) and A row scales.
void AddModuleRows(const SgmvCheckedCall& call, const SgmvActiveSegment& a, const TermFilter& take,
                   int64_t j, const void** a_rows, const void** bt_rows, float* scales) {
  for (int64_t i = a.first_term; i < a.first_term + a.num_terms; ++i) {
    const SgmvActiveTerm& t = call.terms[i];
    if (!take(t)) continue;
    const void* const* slot_rows = call.rows.data() + t.rows;
    for (int64_t k = 0; k < t.rank; ++k, ++j)
      a_rows[j] = slot_rows[k], bt_rows[j] = slot_rows[t.rank + k], scales[j] = t.scale;
  }
}

// The kernel's segments: the active ones of every module's checked call, merged, with the terms
// `take` takes. A segment's A and B^T row pointers are its modules' rows, module after module,
// each module's its terms' back to back (rank = the sum of their ranks), each A row with its
// term's scale * weight; a segment none of whose terms is taken is left out.
void AddSegments(const SgmvCheckedCall* calls, int modules, const TermFilter& take,
                 CallScratch& sc) {
  size_t total = 0;
  for (int m = 0; m < modules; ++m)
    for (const SgmvActiveSegment& a : calls[m].segments) total += TakenRank(calls[m], a, take);
  sc.rows.resize(2 * total), sc.scales.resize(total);
  SgmvProblem& problem = sc.problem;
  problem.segments.clear();
  size_t next[kSgmvMaxModules] = {}, used = 0;
  int64_t at[kSgmvMaxModules];
  while (NextSegment(calls, modules, next, at)) {
    SgmvSegment seg{};
    for (int m = 0; m < modules; ++m) {
      seg.first[m + 1] = seg.first[m];
      if (at[m] < 0) continue;
      const SgmvActiveSegment& a = calls[m].segments[at[m]];
      const int64_t rank = TakenRank(calls[m], a, take);
      if (rank == 0) {
        at[m] = -1;
        continue;
      }
      seg.row_begin = a.row_begin, seg.row_end = a.row_end, seg.dora[m] = a.dora;
      seg.first[m + 1] += rank;
    }
    seg.rank = seg.first[modules];
    if (seg.rank == 0) continue;
    const void** a_rows = sc.rows.data() + 2 * used;
    const void** bt_rows = a_rows + seg.rank;
    float* scales = sc.scales.data() + used;
    for (int m = 0; m < modules; ++m)
      if (at[m] >= 0)
        AddModuleRows(calls[m], calls[m].segments[at[m]], take, seg.first[m], a_rows, bt_rows,
                      scales);
    seg.a_rows = a_rows, seg.bt_rows = bt_rows, seg.scales = scales;
    problem.segments.push_back(seg);
    used += seg.rank;
  }
}

// Checks module m's tables (in: its inputs, as ReadLoraSgmvModuleInputs gives them) and
// resolves its rows into sc.calls[m]; errors of modules m >= 1 name the module.
void CheckModule(const LoraSgmvInputs& in, int64_t layer, SgmvRowLayout rows,
                 const SgmvRowLayout* slot_rows, int m, CallScratch& sc) {
  try {
    const SgmvMetadata meta = ReadSgmvMetadata(in, layer);
    CheckSgmvLayer(meta);
    ListSgmvTerms(meta, sc.terms[m]);
    SgmvPool pool = ReadSgmvPool(in, sizeof(float), rows);
    pool.slot_rows = slot_rows;
    CheckSgmvSegments(meta, sc.terms[m], pool, kRankLimit, sc.calls[m]);
  } catch (const InputError& e) {
    if (m == 0) throw;
    Fail("module ", m, ": ", e.what());
  }
}

// The layout in the float32 pool of rows of ONNX element type `dtype` (attribute adapter_dtype,
// a row_types entry); false when the CPU op has none for it.
bool RowLayoutOf(int64_t dtype, SgmvRowLayout* layout) {
  switch (dtype) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT:
      return *layout = SgmvRowLayout::kPoolType, true;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16:
      return *layout = SgmvRowLayout::kBFloat16Pairs, true;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16:
      return *layout = SgmvRowLayout::kFloat16Pairs, true;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8:
      return *layout = SgmvRowLayout::kInt8Scaled, true;
    default:
      return false;
  }
}

// Each slot's row layout from input row_types, into `out`; null when the node has no row_types
// or an empty one (every slot's rows are of the attribute's type).
const SgmvRowLayout* ReadRowTypes(const Ort::KernelContext& ctx, int64_t num_slots,
                                  std::vector<SgmvRowLayout>& out) {
  const InputView types = GetOptionalInput(ctx, kRowTypes);
  if (!types.present) return nullptr;
  Expect(types, "row_types", 1, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32);
  if (types.shape[0] == 0) return nullptr;
  ExpectDim(types, "row_types", 0, num_slots,
            "num_slots, as a_offsets, or 0: every slot's rows of the attribute adapter_dtype");
  const int32_t* type = types.value.GetTensorData<int32_t>();
  out.resize(num_slots);
  for (int64_t s = 0; s < num_slots; ++s)
    if (!RowLayoutOf(type[s], &out[s]))
      Fail("row_types[", s, "] = ", type[s],
           " must be 1 (float32), 16 (bfloat16), 10 (float16) or 3 (int8)");
  return out.data();
}

// Runs the checked call: one kernel problem, or with per-slot layouts one per layout its terms
// use, in turn, each after the first adding to y_out in place (a segment whose terms have
// different layouts gets each layout's terms in that layout's problem).
void RunProblems(CallScratch& sc, int modules, SgmvRowLayout rows, const SgmvRowLayout* slot_rows,
                 const ParallelFor& parallel_for) {
  SgmvProblem& problem = sc.problem;
  bool used[kSgmvRowLayouts] = {};  // by SgmvRowLayout
  if (slot_rows != nullptr)
    for (int m = 0; m < modules; ++m)
      for (const SgmvActiveTerm& t : sc.calls[m].terms)
        used[static_cast<int>(slot_rows[t.slot])] = true;
  if (std::none_of(used, used + kSgmvRowLayouts, [](bool u) { return u; })) {
    problem.row_type = rows;  // no term: y_out = y
    AddSegments(sc.calls, modules, {nullptr, rows}, sc);
    return LoraSgmvCpu(problem, parallel_for);
  }
  for (int layout = 0; layout < kSgmvRowLayouts; ++layout) {
    if (!used[layout]) continue;
    problem.row_type = static_cast<SgmvRowLayout>(layout);
    AddSegments(sc.calls, modules, {slot_rows, problem.row_type}, sc);
    LoraSgmvCpu(problem, parallel_for);
    for (int m = 0; m < modules; ++m) problem.outputs[m].y = problem.outputs[m].y_out;
  }
}

// Whether no segment of the call has a term of nonzero rank: no composition entry, and every
// segment's slot -1 or one of rank 0 at this layer in every module (an adapter without these
// modules: PEFT's default q_proj/v_proj adapters at o, gate/up and down). Such a call skips
// reading the other inputs: each input's shape asked of ORT costs about a quarter of a
// microsecond inside a decode step, and the 74 inputs of a layer's four calls took 5-8 % of a
// one-request decode step. Anything out of range is left to the full checks.
bool HasNoTerms(const Ort::KernelContext& ctx, int64_t layer, int modules) {
  const InputView slots = GetInput(ctx, kSegSlots);
  if (slots.shape.size() != 1 || slots.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32) return false;
  const InputView comp = GetOptionalInput(ctx, kCompSegs);
  if (comp.present && (comp.shape.size() != 1 || comp.shape[0] != 0)) return false;
  const int32_t *first = slots.value.GetTensorData<int32_t>(), *last = first + slots.shape[0];
  if (std::all_of(first, last, [](int32_t slot) { return slot == -1; })) return true;
  for (int m = 0; m < modules; ++m) {
    const InputView ranks =
        GetOptionalInput(ctx, m == 0 ? kRanks : LoraSgmvModuleInputIndex(m, kModuleRanks));
    if (ranks.shape.size() != 2 || ranks.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 ||
        layer >= ranks.shape[0])
      return false;
    const int32_t* at_layer = ranks.value.GetTensorData<int32_t>() + layer * ranks.shape[1];
    for (const int32_t* slot = first; slot != last; ++slot)
      if (*slot != -1 && (*slot < 0 || *slot >= ranks.shape[1] || at_layer[*slot] != 0))
        return false;
  }
  return true;
}

// y_out_m = y_m for every module, y_m and x checked (rank, type, rows), no other input read: a
// call without terms (HasNoTerms). In place (ORT's choice) it writes nothing.
void CopyThrough(Ort::KernelContext& ctx, int modules) {
  const InputView x = GetInput(ctx, kX);
  Expect(x, "x", 2, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
  static constexpr const char* kYNames[kSgmvMaxModules] = {"y", "y_1", "y_2"};
  for (int m = 0; m < modules; ++m) {
    const InputView y = GetOptionalInput(ctx, ModuleYInput(m));
    Expect(y, kYNames[m], 2, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
    if (m == 0)
      ExpectDim(x, "x", 0, y.shape[0], "T, the rows of y");
    else
      ExpectDim(y, kYNames[m], 0, x.shape[0], "T, the rows of x");
    const float* in = y.value.GetTensorData<float>();
    float* out = ctx.GetOutput(m, y.shape.data(), y.shape.size()).GetTensorMutableData<float>();
    if (out != in) std::copy(in, in + y.shape[0] * y.shape[1], out);
  }
}

// Output m has y_m's type and shape (when ORT knows each of y_m's dims; otherwise it stays
// unknown, never an error: the kernel's own checks report bad inputs at run time). The schema
// is shared with the CUDA op, whose y is float16 or bfloat16.
OrtStatusPtr InferOutputs(const OrtCustomOp*, OrtShapeInferContext* c) {
  const OrtApi& api = Ort::GetApi();
  Ort::ShapeInferContext ctx(&api, c);
  for (size_t m = 0; m < kSgmvMaxModules; ++m) {
    try {
      const size_t y = ModuleYInput(m);
      if (ctx.GetInputCount() <= y || !FullyKnown(ctx.GetInputShape(y))) continue;
      OrtTensorTypeAndShapeInfo* input = nullptr;  // owned by ctx
      Ort::ThrowOnError(api.ShapeInferContext_GetInputTypeShape(c, y, &input));
      ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
      Ort::ThrowOnError(api.GetTensorElementType(input, &type));
      SetInferredShape(c, m, ctx.GetInputShape(y), type);
    } catch (const std::exception&) {  // an absent input or output: nothing to infer
    }
  }
  return nullptr;
}

}  // namespace

LoraSgmvOp::LoraSgmvOp() {
  GetMayInplace = [](int** input_index, int** output_index) -> size_t {
    *input_index = new int[kSgmvMaxModules];
    *output_index = new int[kSgmvMaxModules];
    for (int m = 0; m < kSgmvMaxModules; ++m)
      (*input_index)[m] = static_cast<int>(ModuleYInput(m)), (*output_index)[m] = m;
    return kSgmvMaxModules;
  };
  ReleaseMayInplace = [](int* input_index, int* output_index) {
    delete[] input_index;
    delete[] output_index;
  };
  InferOutputShapeFn = InferOutputs;
}

LoraSgmvKernel::LoraSgmvKernel(const OrtApi&, const OrtKernelInfo* info) {
  Ort::ConstKernelInfo ki(info);
  layer_ = ki.GetAttribute<int64_t>("layer");
  if (layer_ < 0) Fail("attribute 'layer' must be >= 0, got ", layer_);
  const int64_t modules = AttrOr<int64_t>(ki, "modules", 1);
  if (modules < 1 || modules > kSgmvMaxModules)
    Fail("attribute 'modules' must be in [1, ", kSgmvMaxModules, "], got ", modules);
  modules_ = static_cast<int>(modules);
  const int64_t dtype = ReadAdapterDtype(ki, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
  if (!RowLayoutOf(dtype, &rows_))
    Fail("attribute 'adapter_dtype' = ", dtype,
         " is not supported by the CPU op: it must be 1 (FLOAT, float32 rows), 16 (BFLOAT16, "
         "bfloat16 rows in the float32 pool), 10 (FLOAT16, float16 rows in the float32 pool) "
         "or 3 (INT8, int8 rows with a float32 scale each)");
}

OrtStatusPtr LoraSgmvKernel::ComputeV2(OrtKernelContext* context) {
  return GuardCompute("LoraSGMV", [&] { Compute(context); });
}

void LoraSgmvKernel::Compute(OrtKernelContext* context) {
  Ort::KernelContext ctx(context);
  const size_t inputs = LoraSgmvModuleInputIndex(modules_, kModuleY);  // past the last module's
  const size_t count = ctx.GetInputCount();
  bool extra = count > kNumLoraSgmvOpInputs;  // or a further module's input present
  for (size_t i = inputs; i < std::min(count, kRowTypes); ++i) extra |= ctx.GetInput(i) != nullptr;
  if (extra || ctx.GetOutputCount() != static_cast<size_t>(modules_))
    Fail("the node has ", count, " inputs and ", ctx.GetOutputCount(),
         " outputs; attribute 'modules' = ", modules_, " takes at most ", inputs,
         " inputs (then row_types, input ", kRowTypes, ") and ", modules_, " outputs");
  if (HasNoTerms(ctx, layer_, modules_)) return CopyThrough(ctx, modules_);
  CallScratch& sc = CallerScratch();
  const LoraSgmvInputs in = ReadLoraSgmvInputs(ctx, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
  SgmvProblem& problem = sc.problem;
  problem.x = in.x.value.GetTensorData<float>();
  problem.num_rows = in.x.shape[0];
  problem.in_features = in.x.shape[1];
  problem.num_outputs = modules_;
  const SgmvRowLayout* slot_rows = ReadRowTypes(ctx, in.a_offsets.shape[0], sc.slot_rows);
  for (int m = 0; m < modules_; ++m) {
    LoraSgmvInputs further;
    const LoraSgmvInputs& mod =
        m == 0 ? in : (further = ReadLoraSgmvModuleInputs(ctx, in, m, in.x.type));
    CheckModule(mod, layer_, rows_, slot_rows, m, sc);
    problem.outputs[m] = {mod.y.value.GetTensorData<float>(), nullptr, mod.y.shape[1]};
  }
  for (int m = 0; m < modules_; ++m) {
    const int64_t shape[2] = {problem.num_rows, problem.outputs[m].features};
    problem.outputs[m].y_out = ctx.GetOutput(m, shape, 2).GetTensorMutableData<float>();
  }
  RunProblems(sc, modules_, rows_, slot_rows, OrtParallelFor(ctx));
}

OrtStatusPtr LoraSgmvOp::CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info,
                                        void** kernel) const {
  return GuardCompute("LoraSGMV", [&] { *kernel = new LoraSgmvKernel(api, info); });
}

}  // namespace ort_lora
