"""The CUDA LoraSGMV kernels run on the CPU under the emulator, vs the numpy reference.

The kernel source custom_ops/cuda/lora_sgmv_kernels.cu, the host plan (sgmv_plan.cc) and the
SgmvArgs layout are the ones the device uses; tests/cuda_emu_build.py compiles them with g++
against the emulator (custom_ops/cuda/emu/). The emulator's own self-tests show it catches a
missing barrier, mismatched barriers and a bad shuffle, and that its host float16 / bfloat16
conversions round to nearest even. Skipped, saying the CUDA kernels were not checked, only where
no CUDA headers or g++ exist.
"""

from __future__ import annotations

import ctypes
import zlib

import numpy as np
import pytest
from cuda_emu_build import EmuLibrary, build_emu_library, missing_tools

from ort_lora.ops.lora_sgmv_ref import lora_sgmv, place_random_adapters, segment_terms
from ort_lora.runtime.cuda_sgmv import from_storage, to_storage

TOLERANCE = {"float16": 1e-3, "bfloat16": 1e-2}  # relative to the output's scale
SLOT_RANKS = [1, 7, 16, 33, 64, 0, 20]  # heterogeneous in one launch; slot 5 has rank 0
LAYOUTS = {  # segment lengths; every layout has empty segments and base-only rows
    "decode": [1, 1, 1, 0, 1, 1, 1, 1, 1],  # one-row tiles: BGMV
    "rows_2_4": [2, 3, 0, 4, 2, 3],  # multi-row BGMV tiles
    "prefill": [37, 0, 18, 21, 5],  # SGMV tiles + remainders (5: SGMV, 2: BGMV)
    "mixed": [20, 1, 0, 3, 34, 2, 17],
}


@pytest.fixture(scope="module")
def emu(tmp_path_factory) -> EmuLibrary:
    reason = missing_tools()
    if reason:
        pytest.skip(f"CUDA kernels NOT checked (emulator cannot be built): {reason}")
    return EmuLibrary(build_emu_library(tmp_path_factory.mktemp("cuda_emu")))


def make_case(rng, lengths: list[int], in_f: int, out_f: int, slot_ranks=SLOT_RANKS,
              dora_slots=()) -> dict:  # fmt: skip
    """Random adapters at unaligned pool offsets (and DoRA rows of dora_slots); random slots,
    one of them -1 (base only) and one of a rank-0 slot if there is one."""
    placed = place_random_adapters(rng, slot_ranks, in_f, out_f, dora_slots=list(dora_slots))
    ranked = [s for s, r in enumerate(slot_ranks) if r > 0]
    slots = [-1] + [s for s, r in enumerate(slot_ranks) if r == 0][:1]
    slots += [int(rng.choice(ranked)) for _ in lengths[len(slots) :]]
    slots = [int(s) for s in rng.permutation(slots)]
    num_layers, layer = 3, 1
    ranks = np.tile(np.asarray(slot_ranks, np.int32), (num_layers, 1))  # [L, slots]
    scales = rng.uniform(0.5, 2.0, (num_layers, len(slot_ranks))) * rng.choice([-1, 1])
    meta = {
        "seg_starts": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
        "seg_slots": np.asarray(slots, np.int32),
        "a_offsets": placed.a_offsets,
        "b_offsets": placed.b_offsets,
        "ranks": ranks,
        "scales": scales.astype(np.float32),
    }
    rows = sum(lengths)
    x = rng.standard_normal((rows, in_f)).astype(np.float32)  # [T, in]
    y = rng.standard_normal((rows, out_f)).astype(np.float32)  # [T, out]
    if dora_slots:
        meta["dora_offsets"] = placed.dora_offsets
    return {"meta": meta, "x": x, "y": y, "placed": placed, "layer": layer}


def add_composition(rng, case: dict, dora_slots: list[int]) -> None:
    """Composition entries on about half the segments of a ranked, non-DoRA slot: 1 or 2 more
    such slots each, weights in [-1, 1.5]; at least one on a segment with rows. Base-only and
    rank-0 segments stay as they are."""
    meta = case["meta"]
    lengths = np.diff(meta["seg_starts"])
    ranks = meta["ranks"][case["layer"]]
    plain = [s for s in range(len(ranks)) if ranks[s] > 0 and s not in dora_slots]
    entries = []
    for seg, slot in enumerate(meta["seg_slots"]):
        with_rows = any(lengths[e[0]] for e in entries)
        if slot not in plain or (with_rows and rng.random() < 0.5):
            continue
        for extra in rng.choice(plain, int(rng.integers(1, 3)), replace=False):
            entries.append((seg, int(extra), float(rng.uniform(-1.0, 1.5))))
    assert any(lengths[seg] for seg, _, _ in entries), "a composed segment must have rows"
    meta["comp_segs"] = np.asarray([e[0] for e in entries], np.int32)
    meta["comp_slots"] = np.asarray([e[1] for e in entries], np.int32)
    meta["comp_weights"] = np.asarray([e[2] for e in entries], np.float32)


def run_case(
    emu: EmuLibrary, dtype: str, case: dict, stream: int | None = None
) -> tuple[np.ndarray, np.ndarray, list]:
    """(got, want) float32 [T, out] and the 16-bit inputs (y, x, key, value)."""
    placed = case["placed"]
    inputs = [to_storage(a, dtype) for a in (case["y"], case["x"])]
    inputs += [to_storage(placed.key_cache, dtype), to_storage(placed.value_cache, dtype)]
    got = from_storage(emu.sgmv(dtype, *inputs, case["meta"], case["layer"], stream), dtype)
    f = [from_storage(a, dtype) for a in inputs]  # the rounded inputs, as the kernel sees them
    want = lora_sgmv(*f, **case["meta"], layer=case["layer"])
    return got, want, inputs


def lora_rows(meta: dict, layer: int) -> np.ndarray:
    """bool [T]: rows with an adapter of rank > 0 (the others must come back as y, bit-exact)."""
    starts = meta["seg_starts"]
    comp = [meta.get(k) for k in ("comp_segs", "comp_slots", "comp_weights")]
    mask = np.zeros(starts[-1], bool)
    for s, terms in enumerate(segment_terms(meta["seg_slots"], *comp)):
        if any(meta["ranks"][layer, slot] > 0 for slot, _ in terms):
            mask[starts[s] : starts[s + 1]] = True
    return mask


def check_case(emu: EmuLibrary, dtype: str, case: dict) -> None:
    """Kernels vs reference: base-only rows bit-exact, LoRA rows within the dtype's tolerance."""
    got, want, inputs = run_case(emu, dtype, case)
    assert np.isfinite(got).all(), "the kernels read pool, shared or scratch memory never written"
    lora = lora_rows(case["meta"], case["layer"])
    assert lora.any() and not lora.all(), "the layout must mix LoRA and base-only rows"
    y = from_storage(inputs[0], dtype)
    np.testing.assert_array_equal(got[~lora], y[~lora])
    atol = TOLERANCE[dtype] * np.abs(want).max()
    assert np.abs(want - y)[lora].max() > 20 * atol, "the LoRA delta must be far above the tol"
    np.testing.assert_allclose(got, want, rtol=0, atol=atol)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kernels_match_reference(emu, dtype, layout):
    rng = np.random.default_rng(zlib.crc32(repr((dtype, layout)).encode()))
    case = make_case(rng, LAYOUTS[layout], in_f=136, out_f=300)  # not multiples of 64 / 256
    offsets = np.concatenate([case["meta"]["a_offsets"].ravel(), case["meta"]["b_offsets"].ravel()])
    offsets = offsets[offsets >= 0]
    assert (offsets % 2 == 1).any(), "the case must have rows at odd element offsets"
    assert (offsets >= case["placed"].key_cache.size).any(), "and rows in value_cache"
    check_case(emu, dtype, case)


def test_every_rank_and_tile_kind_in_one_launch(emu):
    """All slots, decode and prefill segments together: SGMV and BGMV tiles of every rank."""
    rng = np.random.default_rng(11)
    lengths = [1, 18, 3, 35, 2, 17, 4, 1, 0, 21, 1, 6, 1]
    case = make_case(rng, lengths, in_f=72, out_f=264)
    case["meta"]["seg_slots"] = np.asarray([0, 1, 2, 3, 4, 5, -1, 6, 0, 1, 2, 3, 4], np.int32)
    check_case(emu, "float16", case)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_largest_rank(emu, dtype):
    """Rank 512 (kMaxCudaRank: ExpandTiles' shared v is full) next to rank 3, decode + prefill."""
    rng = np.random.default_rng(zlib.crc32(dtype.encode()))
    case = make_case(rng, [1, 17, 2, 0, 3], in_f=40, out_f=36, slot_ranks=[512, 3])
    case["meta"]["seg_slots"] = np.asarray([0, 0, -1, 1, 0], np.int32)
    check_case(emu, dtype, case)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dora_and_composed_tiles_match_reference(emu, dtype, layout, rng):
    """Two DoRA slots (alone in their segments) and composed segments of 2-3 weighted
    adapters, with plain, rank-0 and base-only segments: SGMV and BGMV tiles of each."""
    dora = [1, 4]  # ranks 7 and 64
    case = make_case(rng, LAYOUTS[layout], in_f=136, out_f=300, dora_slots=dora)
    meta = case["meta"]
    lengths = np.diff(meta["seg_starts"])
    with_rows = rng.permutation(np.flatnonzero(lengths))  # >= 4 in every layout
    plain = [0, 2, 3, 6]
    slots = np.asarray(rng.choice([-1, 5, *plain], len(lengths)), np.int32)  # empty: any
    slots[with_rows] = [1, 4, -1, rng.choice(plain)] + list(
        rng.choice([5, *plain], len(with_rows) - 4)
    )
    meta["seg_slots"] = slots  # rows of each DoRA slot, base rows, a plain segment to compose
    add_composition(rng, case, dora)
    check_case(emu, dtype, case)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_composed_segment_at_the_largest_rank(emu, dtype, rng):
    """256 + 256 = 512 composed (ExpandTiles' shared v full across two terms; segment 0 by
    composition entries alone) next to a DoRA rank-3 segment, decode and prefill tiles."""
    case = make_case(rng, [1, 17, 2, 0, 3], in_f=40, out_f=36, slot_ranks=[256, 256, 3],
                     dora_slots=[2])  # fmt: skip
    meta = case["meta"]
    meta["seg_slots"] = np.asarray([-1, 1, -1, 2, 2], np.int32)  # segment 0: composed only
    meta["comp_segs"] = np.asarray([0, 1, 0], np.int32)
    meta["comp_slots"] = np.asarray([1, 0, 0], np.int32)
    meta["comp_weights"] = np.asarray([0.5, -0.75, 1.25], np.float32)
    check_case(emu, dtype, case)
    meta["comp_slots"] = np.asarray([1, 1, 0], np.int32)  # segment 1: 256 twice, one slot
    check_case(emu, dtype, case)


def test_a_rank_over_the_kernel_limit_is_a_clear_error(emu):
    rng = np.random.default_rng(8)
    case = make_case(rng, [2, 1], in_f=16, out_f=16, slot_ranks=[513])
    message = r"ranks\[1, 0\] = 513 is over the CUDA kernel's limit 512"
    with pytest.raises(ValueError, match=message):
        run_case(emu, "float16", case)


def test_emulator_stack_and_shared_memory(emu):
    """Fiber stacks are far from full; the poisoned section holds the kernels' shared arrays."""
    rng = np.random.default_rng(3)
    run_case(emu, "bfloat16", make_case(rng, [19, 2, 1], in_f=100, out_f=40))
    stats = emu.stats()
    assert stats["switches"] > 0
    assert 0 < stats["stack_used"] < stats["stack_bytes"] // 4, stats
    # ShrinkSgmv xs + as (2 x 16 x 65 floats), ExpandTiles vs (16 x 512 floats), x 2 dtypes.
    assert emu.lib.ort_lora_emu_shared_bytes() >= 2 * (2 * 16 * 65 + 16 * 512) * 4


BAD_INPUTS = [
    ("a_offsets", lambda m: m["a_offsets"].__setitem__((0, 0), 10**9), r"a_offsets\[0, 0\]"),
    ("b_offsets", lambda m: m["b_offsets"].__setitem__((3, 5), -4), r"b_offsets\[3, 5\] = -4"),
    ("seg_starts", lambda m: m["seg_starts"].__setitem__(2, 0), r"seg_starts is non-monotonic"),
    ("seg_slots", lambda m: m["seg_slots"].__setitem__(0, 7), r"seg_slots\[0\] = 7 must be in"),
    ("ranks", lambda m: m["ranks"].__setitem__((1, 3), 65), r"ranks\[1, 3\] = 65 must be in"),
]


@pytest.mark.parametrize("name,corrupt,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_invalid_metadata_is_a_clear_error(emu, name, corrupt, message):
    rng = np.random.default_rng(7)
    case = make_case(rng, [2, 1, 3], in_f=64, out_f=64)
    case["meta"]["seg_slots"] = np.asarray([0, 3, 4], np.int32)
    corrupt(case["meta"])
    with pytest.raises(ValueError, match=message):
        run_case(emu, "float16", case)


COMPOSED_BAD_INPUTS = [
    ("weight", lambda m: m["comp_weights"].__setitem__(1, np.inf),
     r"comp_weights\[1\] = inf is not finite"),
    ("segment", lambda m: m["comp_segs"].__setitem__(0, 3), r"comp_segs\[0\] = 3 must be in"),
    ("dora_composed", lambda m: m["comp_segs"].__setitem__(0, 2),
     r"segment 2 composes 2 adapters and slot 4 is DoRA"),
    ("dora_row", lambda m: m["dora_offsets"].__setitem__(4, 10**9),
     r"dora_offsets\[4\] = 1000000000 must be -1"),
]  # fmt: skip


@pytest.mark.parametrize("name,corrupt,message", COMPOSED_BAD_INPUTS,
                         ids=[b[0] for b in COMPOSED_BAD_INPUTS])  # fmt: skip
def test_invalid_composition_or_dora_is_a_clear_error(emu, name, corrupt, message, rng):
    case = make_case(rng, [2, 1, 3], in_f=64, out_f=64, dora_slots=[4])
    meta = case["meta"]
    meta["seg_slots"] = np.asarray([4, 3, 4], np.int32)
    meta["comp_segs"] = np.asarray([1, 1], np.int32)
    meta["comp_slots"] = np.asarray([0, 2], np.int32)
    meta["comp_weights"] = np.asarray([0.5, 0.25], np.float32)
    corrupt(meta)
    with pytest.raises(ValueError, match=message):
        run_case(emu, "float16", case)


def test_a_composed_rank_over_the_kernel_limit_is_a_clear_error(emu, rng):
    """Each adapter within the limit, their sum (300 + 300) over it (ExpandTiles' shared v)."""
    case = make_case(rng, [2, 1], in_f=16, out_f=16, slot_ranks=[300, 300])
    case["meta"]["seg_slots"] = np.asarray([0, -1], np.int32)
    case["meta"] |= {
        "comp_segs": np.asarray([0], np.int32),
        "comp_slots": np.asarray([1], np.int32),
        "comp_weights": np.asarray([1.0], np.float32),
    }
    message = r"segment 0 composes adapters of total rank 600 at layer 1, over the CUDA kernel's"
    with pytest.raises(ValueError, match=message):
        run_case(emu, "float16", case)


def test_bad_dtype_is_a_clear_error(emu):
    i64, null = ctypes.c_int64(0), ctypes.c_void_p()
    args = [null] * 5 + [i64, null, null, i64, null, null, i64, i64, null, null] + [i64] * 5
    args += [null, null, null, i64, null]  # no composition entries, no DoRA rows
    rc = emu.lib.ort_lora_emu_sgmv(ctypes.c_int(2), *args, null)
    assert rc == -1 and emu.error(rc) == "dtype must be 0 (float16) or 1 (bfloat16), got 2"


# --- the host run (sgmv_run.cc) over the emulated runtime: streams, uploads, scratch ----------

MODULES = {"q_proj": (72, 40), "v_proj": (72, 24), "down_proj": (100, 72)}  # (in, out)
STEP_LAYERS = 3


def step_cases(rng, lengths: list[int]) -> dict:
    """One step's LoraSGMV calls: per module (in, out) its own adapters and tables, the same for
    every layer; per layer its own pool values (the module's rows scaled by 1 + layer, NaN
    elsewhere) and its own ranks (slot 2, segment 2, has rank 0 at layer 1) and scales.
    lengths: at least 3 segments, the third with rows."""
    slot_ranks = [5, 16, 3]
    slots = np.asarray([(0, 1, 2, -1)[i % 4] for i in range(len(lengths))], np.int32)
    cases = {}
    for name, (in_f, out_f) in MODULES.items():
        placed = place_random_adapters(rng, slot_ranks, in_f, out_f)
        ranks = np.tile(np.asarray(slot_ranks, np.int32), (STEP_LAYERS, 1))
        ranks[1, 2] = 0
        meta = {
            "seg_starts": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
            "seg_slots": slots,
            "a_offsets": placed.a_offsets,
            "b_offsets": placed.b_offsets,
            "ranks": ranks,
            "scales": rng.uniform(0.5, 2.0, (STEP_LAYERS, 3)).astype(np.float32),
        }
        pools = [(placed.key_cache * (1 + i), placed.value_cache * (1 + i)) for i in range(3)]
        rows = sum(lengths)
        x = rng.standard_normal((rows, in_f)).astype(np.float32)
        y = rng.standard_normal((rows, out_f)).astype(np.float32)
        cases[name] = {"meta": meta, "pools": pools, "x": x, "y": y}
    return cases


def run_step(emu, cases: dict, stream: int, in_place_layer: int = 1) -> None:
    """Every (layer, module) call of a step on `stream`, each checked against the reference;
    the calls of layer `in_place_layer` pass y as y_out."""
    for layer in range(STEP_LAYERS):
        for c in cases.values():
            key, value = c["pools"][layer]
            inputs = [to_storage(a, "float16") for a in (c["y"], c["x"], key, value)]
            got = emu.sgmv("float16", *inputs, c["meta"], layer, stream=stream,
                           in_place=layer == in_place_layer)  # fmt: skip
            f = [from_storage(a, "float16") for a in inputs]
            want = lora_sgmv(*f, **c["meta"], layer=layer)
            atol = TOLERANCE["float16"] * np.abs(want).max()
            np.testing.assert_allclose(from_storage(got, "float16"), want, rtol=0, atol=atol)


def stats_delta(emu, before: dict) -> dict:
    return {k: v - before[k] for k, v in emu.sgmv_stats().items()}


def test_a_step_uploads_each_module_plan_once(emu):
    """Every layer of one module in one step reuses the plan uploaded by the first: one upload
    per module and step, each layer's own pool, ranks and scales still applied (results checked
    per call). In-place calls (y_out is y) copy nothing. Two steps fit the stream's plan slots:
    no upload waits for an earlier copy (events here stay pending until synchronized)."""
    rng = np.random.default_rng(21)
    stream = 0x7A000
    emu.runtime_reset(pending_events=True)
    before = emu.sgmv_stats()
    run_step(emu, step_cases(rng, [3, 1, 18, 0, 2]), stream)
    step = stats_delta(emu, before)
    calls = len(MODULES) * STEP_LAYERS
    assert step == {"uploads": len(MODULES), "reused": calls - len(MODULES), "host_waits": 0,
                    "y_copies": calls - len(MODULES)}  # fmt: skip
    assert emu.calls("cudaMemcpyAsync H2D", stream) == len(MODULES)
    assert emu.calls("cudaMemcpyAsync D2D", stream) == calls - len(MODULES)
    run_step(emu, step_cases(rng, [1, 1, 1, 2, 1]), stream)  # the next step: new tables
    two = stats_delta(emu, before)
    assert two["uploads"] == 2 * len(MODULES) and two["host_waits"] == 0
    emu.release(stream)


def test_scratch_and_uploads_stay_on_the_callers_stream_and_are_freed(emu):
    """The plan uploads and the v scratch are allocated and queued on the call's stream
    (stream-ordered: cudaMallocAsync / cudaFreeAsync, no ORT allocator, no other stream);
    releasing the stream frees all of it: device memory, pinned slots and events."""
    rng = np.random.default_rng(22)
    stream = 0x7B000
    live = emu.live()
    emu.runtime_reset()
    run_step(emu, step_cases(rng, [20, 1, 3]), stream)
    for call in ("cudaMallocAsync", "cudaMemcpyAsync H2D", "cudaMemcpyAsync D2D",
                 "cudaEventRecord"):  # fmt: skip
        assert emu.calls(call) == emu.calls(call, stream) > 0, call
    assert emu.live() != live
    emu.release(stream)
    assert emu.calls("cudaStreamSynchronize", stream) == 1
    assert emu.calls("cudaFreeAsync") == emu.calls("cudaFreeAsync", stream) > 0
    assert emu.live() == live
    emu.release(stream)  # a stream with nothing kept: no-op


def test_a_reused_slot_waits_only_for_its_own_copy(emu):
    """More distinct plans than the stream keeps (16): the 17th upload takes the oldest slot,
    and only then does the host wait, for that slot's copy; every result stays right."""
    rng = np.random.default_rng(23)
    stream = 0x7C000
    emu.runtime_reset(pending_events=True)
    before = emu.sgmv_stats()
    for i in range(17):
        case = make_case(rng, [2, 17, 1], in_f=24, out_f=40, slot_ranks=[3, 4 + i % 5])
        case["meta"]["seg_slots"] = np.asarray([0, 1, -1], np.int32)
        got, want, _ = run_case(emu, "float16", case, stream=stream)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * np.abs(want).max())
        assert stats_delta(emu, before)["host_waits"] == (i == 16)
    assert stats_delta(emu, before)["uploads"] == 17
    emu.release(stream)


def test_a_null_stream_is_refused(emu):
    """The legacy default stream is not ordered with ORT's compute stream: refused, by name."""
    case = make_case(np.random.default_rng(24), [2, 1], in_f=16, out_f=16)
    with pytest.raises(ValueError, match="the CUDA stream is null"):
        run_case(emu, "float16", case, stream=0)


# --- the emulator itself ---------------------------------------------------------------------


def test_barrier_orders_shared_memory_and_a_missing_one_shows(emu):
    rng = np.random.default_rng(1)
    blocks, n = 2, 96
    data = rng.standard_normal(blocks * n).astype(np.float32)
    want = data.reshape(blocks, n)[:, ::-1].ravel()
    rc, out = emu.selftest(0, data, blocks, n)
    assert rc == 0, emu.error(rc)
    np.testing.assert_array_equal(out, want)
    rc, out = emu.selftest(1, data, blocks, n)  # no __syncthreads
    assert rc == 0, emu.error(rc)
    # Thread t runs before thread n-1-t for t < n/2: it reads the poison (NaN) in every block.
    early = np.tile(np.arange(n) < n // 2, blocks)
    assert np.isnan(out[early]).all(), "a read before the write must see the poison"
    np.testing.assert_array_equal(out[~early], want[~early])


def test_warp_shuffle_reduction(emu):
    rng = np.random.default_rng(2)
    data = rng.integers(-1000, 1000, 3 * 64).astype(np.float32)  # exact sums
    rc, out = emu.selftest(2, data, 3, 64)
    assert rc == 0, emu.error(rc)
    np.testing.assert_array_equal(out[:6], data.reshape(6, 32).sum(axis=1))


def test_mismatched_barriers_are_a_deadlock_error(emu):
    rc, _ = emu.selftest(3, np.zeros(64, np.float32), 1, 64)
    assert rc != 0
    msg = emu.error(rc)
    assert "MismatchedBarriers block (0, 0, 0): deadlock" in msg, msg
    assert "33 threads wait at __syncthreads, 31 at __shfl_xor_sync" in msg, msg


def test_shuffle_from_an_exited_lane_is_an_error(emu):
    rc, _ = emu.selftest(4, np.zeros(32, np.float32), 1, 32)
    assert rc != 0
    assert "ShuffleFromExitedLane" in emu.error(rc) and "source lane 1" in emu.error(rc)
    rc, out = emu.selftest(2, np.ones(32, np.float32), 1, 32)  # the next launch runs again
    assert rc == 0 and out[0] == 32


def rounding_inputs(rng) -> np.ndarray:
    """float32: random magnitudes, exact ties for float16 and bfloat16, specials, subnormals."""
    normal = rng.standard_normal(4000) * np.exp2(rng.integers(-30, 20, 4000))
    h = rng.integers(1, 0x7BFF, 2000).astype(np.uint16).view(np.float16).astype(np.float32)
    h_next = np.nextafter(h.astype(np.float16), np.float16(np.inf)).astype(np.float32)
    top = rng.integers(0, 0x7F80, 2000).astype(np.uint32) | rng.choice([0, 0x8000], 2000)
    bf = (top << 16 | 0x8000).view(np.float32)  # finite, exactly between two bfloat16
    specials = [0.0, -0.0, np.inf, -np.inf, 65519.0, 65520.0, 1e-8, 6e-8, 3e38, -3.4e38]
    values = [normal, (h + h_next) / 2, bf, np.asarray(specials)]
    return np.concatenate(values).astype(np.float32)


def test_host_conversions_round_to_nearest_even(emu):
    torch = pytest.importorskip("torch")
    values = rounding_inputs(np.random.default_rng(4))
    bits, back = emu.round("float16", values)
    with np.errstate(over="ignore"):  # values past 65504 round to inf, as they should
        want = values.astype(np.float16)
    np.testing.assert_array_equal(bits, want.view(np.uint16))
    np.testing.assert_array_equal(back, want.astype(np.float32))
    bits, back = emu.round("bfloat16", values)
    want = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(bits, want)
    np.testing.assert_array_equal(back, (want.astype(np.uint32) << 16).view(np.float32))
