"""LoraSGMV serving several modules in one call (attribute modules) vs the numpy reference.

A node with modules = M reads one x and writes M outputs, module m's from its own y, offsets,
ranks, scales and DoRA rows (ort_lora/ops/lora_sgmv_ref.py::lora_sgmv_modules). The cases mix,
in one call, modules of different widths (q/k/v-like: 96, 32, 32 outputs) and ranks, slots
that target only some of the modules (rank 0 elsewhere), base rows, DoRA slots (in some
modules only), composed segments, decode and prefill segments, for each adapter-row type. Each
output also equals, bit for bit, the one-module node given that module's inputs: the fused
call shares the work, never changes a sum. Every case draws fresh random data (the `rng`
fixture); the pool is NaN outside the adapter rows. Last, the CPU export emits one node for
q/k/v and one for gate/up, and the CUDA export one per module.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from rerun_with import assert_passes_with

import ort_lora
from ort_lora.ops.lora_sgmv_ref import (
    ADAPTER_DTYPES,
    ModuleTables,
    lora_sgmv,
    lora_sgmv_modules,
    place_random_adapters,
)

F32, I32, I64 = TensorProto.FLOAT, TensorProto.INT32, TensorProto.INT64
SHARED = [("x", F32, 2), ("key_cache", F32, 4), ("value_cache", F32, 4),
          ("seg_starts", I32, 1), ("seg_slots", I32, 1)]  # fmt: skip
COMP = [("comp_segs", I32, 1), ("comp_slots", I32, 1), ("comp_weights", F32, 1)]
TABLES = [("a_offsets", I64, 2), ("b_offsets", I64, 2), ("ranks", I32, 2), ("scales", F32, 2),
          ("dora_offsets", I64, 1)]  # fmt: skip
ATTRS = {t: {"adapter_dtype": code} if t != "float32" else {} for t, code in ADAPTER_DTYPES.items()}
DTYPES = list(ATTRS)
RTOL = 1e-5  # float32 accumulation vs the float64 reference on the same stored row values


def node_inputs(modules: int) -> list[str]:
    """The node's input names: module 0's and the shared ones in the op's order, then modules
    1.. as y_m, a_offsets_m, b_offsets_m, ranks_m, scales_m, dora_offsets_m."""
    names = ["y_0", "x", "key_cache", "value_cache", "seg_starts", "seg_slots"]
    names += [f"{n}_0" for n, _, _ in TABLES[:4]] + [n for n, _, _ in COMP] + ["dora_offsets_0"]
    for m in range(1, modules):
        names += [f"y_{m}"] + [f"{n}_{m}" for n, _, _ in TABLES]
    return names


def graph_inputs(modules: int, y_from_node: bool = False) -> list:
    types = {n: (t, r) for n, t, r in SHARED + COMP}
    for m in range(modules):
        types |= {f"{n}_{m}": (t, r) for n, t, r in TABLES}
        types[f"{'y_in' if y_from_node else 'y'}_{m}"] = (F32, 2)
    return [helper.make_tensor_value_info(n, t, [None] * r) for n, (t, r) in types.items()]


def make_session(count: int, dtype: str, y_from_node: bool = False, **attrs):
    """A LoraSGMV node of `count` modules; y_from_node: each y_m = 2 * y_in_m comes from a
    Mul node and each output is doubled again (intermediate tensors: ORT may run in place)."""
    nodes, outs = [], [f"y_out_{m}" for m in range(count)]
    if y_from_node:
        nodes = [helper.make_node("Mul", [f"y_in_{m}", "two"], [f"y_{m}"]) for m in range(count)]
        outs = [f"y_mid_{m}" for m in range(count)]
    attrs = {"modules": count} | ATTRS[dtype] | attrs
    nodes.append(helper.make_node("LoraSGMV", node_inputs(count), outs,
                                  domain=ort_lora.OPS_DOMAIN, layer=0, **attrs))  # fmt: skip
    if y_from_node:
        nodes += [helper.make_node("Mul", [o, "two"], [f"y_out_{m}"]) for m, o in enumerate(outs)]
    two = helper.make_tensor("two", F32, [], [2.0])
    outputs = [helper.make_tensor_value_info(f"y_out_{m}", F32, [None, None])
               for m in range(count)]  # fmt: skip
    graph = helper.make_graph(nodes, "lora_sgmv_modules", graph_inputs(count, y_from_node),
                              outputs, initializer=[two])  # fmt: skip
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(ort_lora.OPS_DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    opts = ort_lora.session_options(intra_op_num_threads=2)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def shift(offsets: np.ndarray, half: int, key_before: int, total_half: int, value_before: int):
    """Offsets into one module's pool share moved into the concatenated share (-1 stays)."""
    out = offsets.copy()
    key, value = (offsets >= 0) & (offsets < half), offsets >= half
    out[key] += key_before
    out[value] += total_half - half + value_before
    return out


def place_modules(rng, dtype, slot_ranks, in_f, outs, dora_slots):
    """Adapters of every module in one pool: module m's rows (ranks slot_ranks[m][slot], DoRA
    rows for dora_slots[m]) placed as place_random_adapters does, the modules' pools then
    concatenated page-wise (keys after keys, values after values) and the offsets moved."""
    placed = [
        place_random_adapters(rng, ranks, in_f, out, adapter_dtype=dtype, dora_slots=dora)
        for ranks, out, dora in zip(slot_ranks, outs, dora_slots, strict=True)
    ]
    halves = [p.key_cache.size for p in placed]
    total, before = sum(halves), np.cumsum([0, *halves])
    tables = []
    for m, p in enumerate(placed):
        move = dict(half=halves[m], key_before=before[m], total_half=total, value_before=before[m])
        tables.append((shift(p.a_offsets, **move), shift(p.b_offsets, **move),
                       shift(p.dora_offsets, **move)))  # fmt: skip
    key = np.concatenate([p.key_cache for p in placed])
    value = np.concatenate([p.value_cache for p in placed])
    return key, value, tables


def make_case(rng, dtype, seg_lens, seg_slots, slot_ranks, outs=(96, 32, 32), in_f=64,
              comp=(), dora_slots=None):  # fmt: skip
    """Feeds of a node with len(outs) modules; slot_ranks[m][slot] is module m's rank of each
    slot (0: the slot's adapter does not target the module)."""
    modules = len(outs)
    dora_slots = dora_slots or [[] for _ in outs]
    key, value, tables = place_modules(rng, dtype, slot_ranks, in_f, outs, dora_slots)
    rows = int(sum(seg_lens))
    segs, slots, weights = zip(*comp) if comp else ((), (), ())
    feeds = {
        "x": rng.standard_normal((rows, in_f)).astype(np.float32),
        "key_cache": key,
        "value_cache": value,
        "seg_starts": np.concatenate([[0], np.cumsum(seg_lens)]).astype(np.int32),
        "seg_slots": np.array(seg_slots, np.int32),
        "comp_segs": np.array(segs, np.int32),
        "comp_slots": np.array(slots, np.int32),
        "comp_weights": np.array(weights, np.float32),
    }
    for m in range(modules):
        a, b, d = tables[m]
        ranks = np.array([slot_ranks[m]], np.int32)
        feeds |= {
            f"y_{m}": rng.standard_normal((rows, outs[m])).astype(np.float32),
            f"a_offsets_{m}": a,
            f"b_offsets_{m}": b,
            f"ranks_{m}": ranks,
            f"scales_{m}": rng.uniform(0.25, 2.0, ranks.shape).astype(np.float32),
            f"dora_offsets_{m}": d if dora_slots[m] else np.zeros(0, np.int64),
        }
    return feeds


def reference(feeds, modules, dtype):
    tables = [
        ModuleTables(*(feeds[f"{n}_{m}"] for n in ("y", *(n for n, _, _ in TABLES))))
        for m in range(modules)
    ]
    shared = {n: feeds[n] for n, _, _ in SHARED + COMP}
    return lora_sgmv_modules(tables, **shared, layer=0, adapter_dtype=dtype)


def one_module(feeds, m, dtype):
    """Output of module m through a one-module node (the 14-input LoraSGMV)."""
    names = [n for n, _, _ in SHARED + COMP]
    renamed = {n: feeds[n] for n in names} | {"y_0": feeds[f"y_{m}"]}
    renamed |= {f"{n}_0": feeds[f"{n}_{m}"] for n, _, _ in TABLES}
    return make_session(1, dtype).run(None, renamed)[0]


def check(feeds, modules, dtype):
    got = make_session(modules, dtype).run(None, feeds)
    for m, (g, ref) in enumerate(zip(got, reference(feeds, modules, dtype), strict=True)):
        scale = float(np.abs(ref).max()) if ref.size else 1.0
        np.testing.assert_allclose(g, ref, rtol=RTOL, atol=RTOL * scale, err_msg=f"module {m}")
        np.testing.assert_array_equal(g, one_module(feeds, m, dtype), err_msg=f"module {m}")
    return got


# (seg_lens, seg_slots, per-module slot ranks, composition (segment, slot, weight), per-module
# DoRA slots). Slot 1 targets only module 0 and 2; slot 3 only module 1; slot 2 is DoRA in
# modules 0 and 1 but plain LoRA in module 2.
LAYOUTS = {
    "decode": ([1] * 12, [0, 1, 2, 3, -1, 0, 1, 2, 3, -1, 4, 4],
               [[8, 4, 16, 0, 2], [8, 0, 16, 4, 2], [8, 4, 16, 0, 2]], (), [[], [], []]),
    "decode_dora_composed": ([1] * 9, [0, 1, 2, -1, 3, 0, 4, -1, 1],
                             [[8, 4, 16, 0, 2], [8, 0, 16, 4, 2], [8, 4, 16, 0, 2]],
                             [(3, 0, 0.7), (3, 4, 0.3), (7, 1, -0.5)], [[2], [2], []]),
    "prefill": ([17, 9, 33, 12], [1, -1, 0, 2],
                [[8, 4, 16, 0, 2], [8, 0, 16, 4, 2], [8, 4, 16, 0, 2]],
                [(1, 0, 0.6), (1, 4, 0.4)], [[2], [2], []]),
    "no_adapter": ([1, 1, 4], [-1, -1, -1],
                   [[16, 4, 8, 0, 1], [16, 0, 8, 4, 1], [16, 4, 8, 0, 1]], (), [[], [], []]),
    "rank_0_slots": ([1, 1, 4], [1, -1, 1],  # slot 1: rank 0 in every module (y passes)
                     [[16, 0], [16, 0], [16, 0]], (), [[], [], []]),
    "mixed": ([1, 20, 0, 3, 11, 1, 2], [3, 0, -1, -1, -1, 2, 1],
              [[16, 4, 8, 0, 1], [16, 0, 8, 4, 1], [16, 4, 8, 0, 1]],
              [(3, 3, 0.8), (4, 0, 0.25), (4, 4, 0.5), (2, 0, 2.0)], [[2], [2], [2]]),
}  # fmt: skip


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_three_modules_match_the_reference_and_one_module_calls(dtype, layout, rng):
    seg_lens, seg_slots, ranks, comp, dora = LAYOUTS[layout]
    feeds = make_case(rng, dtype, seg_lens, seg_slots, ranks, comp=comp, dora_slots=dora)
    check(feeds, 3, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_modules_of_other_widths(dtype, rng):
    """gate/up-like: two modules of 160 outputs from 96 inputs, every segment length."""
    seg_lens, seg_slots = [1, 2, 5, 9, 3, 1, 1, 1, 1, 1], [0, 1, 2, 3, 0, -1, 1, 2, 3, 0]
    ranks = [[4, 16, 1, 8], [4, 16, 3, 0]]
    feeds = make_case(rng, dtype, seg_lens, seg_slots, ranks, outs=(160, 160), in_f=96)
    check(feeds, 2, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_only_one_module_has_adapter_rows(dtype, rng):
    """Modules 0 and 2 have rank 0 for every slot: their outputs are y, module 1's is not."""
    ranks = [[0, 0], [8, 4], [0, 0]]
    feeds = make_case(rng, dtype, [3, 1, 4, 1, 1], [0, 1, -1, 0, 1], ranks)
    got = check(feeds, 3, dtype)
    np.testing.assert_array_equal(got[0], feeds["y_0"])
    np.testing.assert_array_equal(got[2], feeds["y_2"])
    assert np.abs(got[1] - feeds["y_1"]).max() > 0.01


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_base_rows(dtype, rng):
    feeds = make_case(rng, dtype, [5, 3], [-1, -1], [[4, 8], [4, 8], [4, 8]])
    for m, got in enumerate(check(feeds, 3, dtype)):
        np.testing.assert_array_equal(got, feeds[f"y_{m}"])


@pytest.mark.parametrize(
    "layout", ["decode_dora_composed", "prefill", "mixed", "no_adapter", "rank_0_slots"]
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_y_produced_by_other_nodes(dtype, layout, rng):
    """y_m = 2 * y_in_m and every output doubled again: intermediate tensors, so ORT may run
    each output in place over its y (MayInplace for every module)."""
    seg_lens, seg_slots, ranks, comp, dora = LAYOUTS[layout]
    feeds = make_case(rng, dtype, seg_lens, seg_slots, ranks, comp=comp, dora_slots=dora)
    want = reference(feeds, 3, dtype)
    for m in range(3):
        feeds[f"y_in_{m}"] = feeds.pop(f"y_{m}") / 2
    got = make_session(3, dtype, y_from_node=True).run(None, feeds)
    for m in range(3):
        scale = float(np.abs(want[m]).max())
        np.testing.assert_allclose(got[m] / 2, want[m], rtol=RTOL, atol=RTOL * scale)


def test_reference_is_lora_sgmv_per_module(rng):
    feeds = make_case(rng, "float32", [2, 3], [0, 1], [[4, 2], [0, 8], [1, 1]])
    ref = reference(feeds, 3, "float32")
    shared = {n: feeds[n] for n, _, _ in SHARED}
    for m in range(3):
        tables = {n: feeds[f"{n}_{m}"] for n, _, _ in TABLES}
        np.testing.assert_array_equal(ref[m], lora_sgmv(feeds[f"y_{m}"], **shared, **tables,
                                                        layer=0))  # fmt: skip


@pytest.mark.parametrize("isa", ["avx2", "baseline"])
def test_narrower_isa_kernels(isa):
    """The AVX2 and baseline kernels (forced with ORT_LORA_SGMV_ISA) pass the value tests."""
    cases = "match_the_reference or widths or only_one_module or produced_by"
    assert_passes_with(__file__, cases, "ORT_LORA_SGMV_ISA", isa)


# ---- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize("modules", [0, 4, -1])
def test_modules_attribute_out_of_range(modules):
    with pytest.raises(Exception, match=rf"attribute 'modules' must be in \[1, 3\], got {modules}"):
        make_session(2, "float32", modules=modules)


def valid_feeds(rng):
    return make_case(rng, "float32", [2, 1, 3], [0, -1, 1], [[4, 2], [2, 4], [4, 4]])


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda f: f.update(y_1=f["y_1"][:-1]), r"input 'y_1' dim 0 must be 6 \(T, the rows of x"),
        (lambda f: f.update(a_offsets_2=f["a_offsets_2"][:1]), r"input 'a_offsets_2' dim 0"),
        (lambda f: f.update(b_offsets_1=f["b_offsets_1"][:, :1]), r"input 'b_offsets_1' dim 1"),
        (lambda f: f.update(scales_2=f["scales_2"][:, :1]), r"input 'scales_2' dim 1"),
        (lambda f: f.update(dora_offsets_1=np.zeros(5, np.int64)), r"input 'dora_offsets_1' dim 0"),
        (lambda f: f["ranks_1"].__setitem__((0, 1), 9), r"module 1: ranks\[0, 1\] = 9 must be in"),
        (lambda f: f["a_offsets_2"].__setitem__((0, 1), -3),
         r"module 2: a_offsets\[0, 1\] = -3 is an out-of-range page"),
        (lambda f: f["ranks_0"].__setitem__((0, 0), -1), r"LoraSGMV: ranks\[0, 0\] = -1"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)  # fmt: skip
def test_bad_module_inputs_are_named(mutate, match, rng):
    feeds = valid_feeds(rng)
    mutate(feeds)
    with pytest.raises(Exception, match=match):
        make_session(3, "float32").run(None, feeds)


def test_a_call_without_adapter_rows_checks_every_y(rng):
    """No segment with a slot: only y_m, x and the slots are read, each y_m still checked."""
    feeds = make_case(rng, "float32", [2, 1, 3], [-1, -1, -1], [[4, 2], [2, 4], [4, 4]])
    feeds["y_2"] = feeds["y_2"][:-1]
    with pytest.raises(Exception, match=r"input 'y_2' dim 0 must be 6 \(T, the rows of x"):
        make_session(3, "float32").run(None, feeds)


def test_outputs_must_match_the_modules_attribute(rng):
    """A node of 3 modules' inputs with attribute modules = 2 (and 2 outputs) is refused."""
    feeds = valid_feeds(rng)
    node = helper.make_node("LoraSGMV", node_inputs(3), ["o0", "o1"],
                            domain=ort_lora.OPS_DOMAIN, layer=0, modules=2)  # fmt: skip
    outputs = [helper.make_tensor_value_info(o, F32, [None, None]) for o in ("o0", "o1")]
    graph = helper.make_graph([node], "g", graph_inputs(3), outputs)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(ort_lora.OPS_DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    sess = ort.InferenceSession(model.SerializeToString(), ort_lora.session_options())
    with pytest.raises(Exception, match=r"attribute 'modules' = 2 takes at most 20 inputs"):
        sess.run(None, feeds)


# ---- the export --------------------------------------------------------------------------------


def lora_nodes(model_dir) -> list:
    graph = onnx.load(str(model_dir / "model.onnx"), load_external_data=False).graph
    return [n for n in graph.node if n.op_type == "LoraSGMV"]


def test_cpu_export_shares_a_node_between_modules_that_read_one_x(tiny_llama_export):
    """Per layer: q/k/v in one node, o, gate/up in one node, down; each module's tables in its
    place, its y the output of its own projection."""
    nodes = lora_nodes(tiny_llama_export)
    assert len(nodes) == 4 * 2  # 2 layers
    modules = {}
    for node in nodes:
        attrs = {a.name: a.i for a in node.attribute}
        count = attrs.get("modules", 1)
        assert len(node.output) == count
        names = [node.input[6]] + [node.input[14 + 6 * (m - 1) + 1] for m in range(1, count)]
        modules.setdefault(attrs["layer"], []).append([n.split("_")[1] for n in names])
    expected = [["q", "k", "v"], ["o"], ["gate", "up"], ["down"]]
    assert modules == {0: expected, 1: expected}


def test_cuda_export_keeps_a_node_per_module(tiny_llama_checkpoint, tmp_path):
    """The CUDA op takes one module: a --device cuda export has 7 one-module nodes a layer."""
    from ort_lora.export import export_model

    out = export_model(tiny_llama_checkpoint, tmp_path / "out", dtype="float16", device="cuda",
                       block_size=16, progress=False)  # fmt: skip
    nodes = lora_nodes(out)
    assert len(nodes) == 7 * 2
    assert all(len(n.output) == 1 and len(n.input) == 14 for n in nodes)
    assert not any(a.name == "modules" for n in nodes for a in n.attribute)
