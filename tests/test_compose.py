"""Weighted composition of adapters per request, below the engine: the registry's API
(`composition`, `lora_step_inputs(..., segments)`) and one session step on the tiny Llama
export against PEFT.

Oracle: PEFT's add_weighted_adapter(..., combination_type="cat"), which builds the exact
weighted sum of the adapters' deltas. A step whose sequences are composed (0.7 one + 0.3 two;
1.5 two - 0.5 one; 0.5 one alone), single-adapter (one; a DoRA adapter) and base gives every
sequence's prompt log-softmax within 1e-4 of PEFT, and each sequence's logits equal that
sequence run alone.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ort_lora import contract as C
from ort_lora.adapters import AdapterError, AdapterNotFoundError, AdapterRegistry
from ort_lora.export.tiny import save_random_adapters
from ort_lora.lora_request import LoRARequest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from peft_cases import COMPOSE_ADAPTERS  # noqa: E402
from test_adapters import ADAPTERS, make_adapter, manifest  # noqa: E402

PEFT_ADAPTERS = COMPOSE_ADAPTERS
IDS = {name: i + 1 for i, name in enumerate(PEFT_ADAPTERS)}
PAGES_PER_ADAPTER = 24  # pool pages set aside per adapter; KV pages come after


# --- the registry's API ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory):
    """Three plain adapters of test_adapters' tiny Llama shape."""
    root = tmp_path_factory.mktemp("plain")
    for seed, name in enumerate(("qv4", "all8", "mlp16rs")):
        make_adapter(root / name, seed, **ADAPTERS[name])
    return root


@pytest.fixture
def registry(lora_root):
    root = lora_root
    reg = AdapterRegistry(manifest())
    for aid, name in enumerate(("qv4", "all8", "mlp16rs"), start=1):
        reg.register(LoRARequest(name, aid, str(root / name)))
    return reg


def test_composition_resolves_names_and_ids(registry):
    assert registry.composition([("qv4", 0.7), (2, 0.3)]) == ((1, 0.7), (2, 0.3))
    assert registry.composition([("all8", -1)], max_loras=1) == ((2, -1.0),)


@pytest.mark.parametrize(
    "terms, max_loras, error, message",
    [
        ([], None, AdapterError, "a composition names no adapter"),
        ([("qv4", float("nan")), ("all8", 0.5)], None, AdapterError, "'qv4': weight nan is not"),
        ([("qv4", 0.5), ("all8", float("inf"))], None, AdapterError, "weight inf is not finite"),
        ([("qv4", "0.5")], None, AdapterError, "'qv4': weight '0.5' is not a number"),
        ([("qv4", True)], None, AdapterError, "weight True is not a number"),
        ([("qv4", 1.0), (1, 1.0)], None, AdapterError, "adapter '1' appears twice"),
        ([("qv4", 0.5), ("all8", 0.5), ("mlp16rs", 0.5)], 2, AdapterError,
         r"a composition of 3 adapters \(qv4, all8, mlp16rs\) exceeds max_loras = 2"),
        ([("qv4", 0.5), ("nope", 0.5)], None, AdapterNotFoundError, "adapter not found: 'nope'"),
    ],
)  # fmt: skip
def test_bad_compositions_are_refused_by_name(registry, terms, max_loras, error, message):
    with pytest.raises(error, match=message):
        registry.composition(terms, max_loras)


def test_an_adapter_being_unloaded_cannot_be_composed(registry):
    registry.add_user(2)
    registry.unload("all8")
    with pytest.raises(AdapterNotFoundError, match="'all8' \\(being unloaded\\)"):
        registry.composition([("qv4", 0.5), ("all8", 0.5)])


def test_an_export_without_composition_refuses_it(lora_root):
    root = lora_root
    reg = AdapterRegistry(dataclasses.replace(manifest(), lora_features=[]))
    reg.register(LoRARequest("qv4", 1, str(root / "qv4")))
    with pytest.raises(AdapterError, match="predates composition"):
        reg.composition([("qv4", 1.0)])
    step = reg.lora_step_inputs([(0, 1, (0, 1))], 48)
    assert C.LORA_COMP_SEGS not in step and C.lora_input_name("q_proj", "dora_offsets") not in step
    with pytest.raises(ValueError, match="no composition inputs"):
        reg.lora_step_inputs([(0, 1, (0, 1))], 48, segments=[[(0, 0.5)]])


def test_step_inputs_of_composed_segments(registry):
    """Plain segments keep their slot; composed ones (two adapters, or one at weight != 1) get
    slot -1 and one entry per adapter, in order; no segments: E = 0."""
    pages = [tuple(range(i * 8, i * 8 + registry.num_pages_needed(i + 1))) for i in range(3)]
    slots = [(s, s + 1, pages[s]) for s in range(3)]
    plain = registry.lora_step_inputs(slots, 48)
    assert plain[C.LORA_COMP_SEGS].shape == (0,) and plain[C.LORA_COMP_WEIGHTS].dtype == np.float32
    assert C.LORA_SEG_SLOTS not in plain  # the caller's (build_metadata) stand
    segments = [[], [(0, 1.0)], [(0, 0.7), (2, 0.3)], [(1, 0.5)], [(2, 1.0)]]
    step = registry.lora_step_inputs(slots, 48, segments)
    assert step[C.LORA_SEG_SLOTS].tolist() == [-1, 0, -1, -1, 2]
    assert step[C.LORA_COMP_SEGS].tolist() == [2, 2, 3]
    assert step[C.LORA_COMP_SLOTS].tolist() == [0, 2, 1]
    np.testing.assert_array_equal(step[C.LORA_COMP_WEIGHTS], np.float32([0.7, 0.3, 0.5]))
    assert step[C.LORA_SEG_SLOTS].dtype == np.int32 and step[C.LORA_COMP_SLOTS].dtype == np.int32
    for m in manifest().lora_targets:
        assert step[C.lora_input_name(m, "dora_offsets")].tolist() == [-1, -1, -1]
    assert registry.lora_step_inputs(slots, 48) is plain  # the cached step is left alone


# --- one step through the session against PEFT ------------------------------------------------


@pytest.fixture(scope="module")
def adapter_dirs(hf_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("compose")
    save_random_adapters(hf_model, root, PEFT_ADAPTERS, seed=500)
    return root


def peft_logits(hf_model, root, terms: list[tuple[str, float]], prompt: list[int]) -> np.ndarray:
    """PEFT's logits [P, vocab]: the base, one adapter, or add_weighted_adapter(cat)."""
    import copy

    model = copy.deepcopy(hf_model)
    if terms:
        first = terms[0][0]
        model = peft.PeftModel.from_pretrained(model, root / first, adapter_name=first)
        for name, _ in terms[1:]:
            model.load_adapter(root / name, adapter_name=name)
        if len(terms) > 1 or terms[0][1] != 1.0:
            names, weights = zip(*terms)
            model.add_weighted_adapter(list(names), list(weights), "mix", combination_type="cat")
            model.set_adapter("mix")
    with torch.no_grad():
        return model.eval()(torch.tensor([prompt])).logits[0].numpy()


# (adapter terms, prompt) per sequence of the step
SEQUENCES = [
    ([("one", 0.7), ("two", 0.3)], [5, 17, 99, 3, 42, 8, 77, 120, 64, 33, 21]),
    ([("one", 1.0)], [200, 150, 100, 50, 25, 12, 6]),
    ([], [7, 7, 7, 1, 9]),
    ([("two", 1.5), ("one", -0.5)], [11, 22, 33, 44, 55, 66, 77, 88, 99]),
    ([("dora", 1.0)], [3, 9, 27, 81, 243, 4, 8, 16]),
    ([("one", 0.5)], [60, 61, 62, 63, 64, 65]),
]


def run_step(session, registry, pages, sequences, block_size):
    """Logits of every prompt row of `sequences`, one segment per sequence, KV in pages past
    the adapters'."""
    from ort_lora.engine.step_plan import base_plan, build_metadata

    slot_of = {name: slot for slot, name in enumerate(PEFT_ADAPTERS)}
    seqs, next_page = [], len(PEFT_ADAPTERS) * PAGES_PER_ADAPTER
    for _, prompt in sequences:
        blocks = list(range(next_page, next_page + -(-len(prompt) // block_size)))
        next_page += len(blocks)
        seqs.append((prompt, 0, blocks, range(len(prompt))))
    inputs = build_metadata(base_plan(*seqs, block_size=block_size), block_size)
    inputs[C.LORA_SEG_STARTS] = inputs[C.CU_SEQLENS]  # one segment per sequence
    slots = [(slot_of[n], IDS[n], pages[n]) for n in PEFT_ADAPTERS]
    segments = [[(slot_of[n], w) for n, w in terms] for terms, _ in sequences]
    inputs |= registry.lora_step_inputs(slots, session.num_pages, segments)
    return session.run(inputs)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_composed_single_dora_and_base_rows_match_peft(tiny_llama_export, hf_model, adapter_dirs):
    from ort_lora.runtime import ModelSession

    session = ModelSession(tiny_llama_export, num_pages=96, intra_op_num_threads=2)
    registry = AdapterRegistry(session.manifest)  # DoRA reads the export's own weights
    pages = {}
    for i, name in enumerate(PEFT_ADAPTERS):
        registry.register(LoRARequest(name, IDS[name], str(adapter_dirs / name)))
        first = PAGES_PER_ADAPTER * i
        pages[name] = tuple(range(first, first + registry.num_pages_needed(name)))
        assert len(pages[name]) <= PAGES_PER_ADAPTER
        registry.write_to_pool(name, pages[name], session.pool)
    with pytest.raises(AdapterError, match="'dora' is a DoRA adapter: DoRA adapters cannot be"):
        registry.composition([("one", 0.5), ("dora", 0.5)])
    bs = session.manifest.block_size
    mixed = run_step(session, registry, pages, SEQUENCES, bs)  # [rows, vocab]
    row = 0
    for terms, prompt in SEQUENCES:
        ours = mixed[row : row + len(prompt)]
        want = peft_logits(hf_model, adapter_dirs, terms, prompt)
        diff = np.abs(log_softmax(ours) - log_softmax(want)).max()
        assert diff < 1e-4, f"{terms}: prompt log-softmax differs from PEFT by {diff:.2e}"
        print(f"{terms}: largest |log-softmax - PEFT| {diff:.2e}")
        alone = run_step(session, registry, pages, [(terms, prompt)], bs)
        np.testing.assert_allclose(ours, alone, atol=1e-5, rtol=0, err_msg=f"{terms} alone")
        row += len(prompt)
    composed = mixed[: len(SEQUENCES[0][1])]
    only_one = peft_logits(hf_model, adapter_dirs, [("one", 1.0)], SEQUENCES[0][1])
    assert np.abs(composed - only_one).max() > 1e-2, "two's share must change the output"
