"""The engine against the oracle: transformers + PEFT on the same weights and adapters.

One generate() call mixes the base model and three PEFT adapters (rank 4 on q,v; rank 8
all-linear with rank_pattern and alpha_pattern; rank 16 rslora on the MLP only) on a tiny
random Llama: prompt logprobs match PEFT's teacher-forced log-softmax within 1e-4 and greedy
tokens match PEFT's generate, for every request. Then isolation: each request alone equals
the same request inside a mixed batch of 16, also when a tiny pool forces preemptions.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ort_lora import LLM, LoRARequest, SamplingParams
from ort_lora.export.tiny import save_random_adapters

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from peft_cases import ALL_LINEAR  # noqa: E402

ADAPTERS = {
    "qv4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all8": dict(
        r=8,
        lora_alpha=16,
        target_modules=ALL_LINEAR,
        rank_pattern={"model.layers.1.self_attn.o_proj": 2, "down_proj": 6},
        alpha_pattern={"gate_proj": 4, "model.layers.0.self_attn.q_proj": 32},
    ),
    "mlp16": dict(
        r=16, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"], use_rslora=True
    ),
}
PROMPTS = [
    [5, 17, 99, 3, 42, 8, 77, 120, 64, 33, 21],
    [200, 150, 100, 50, 25, 12, 6, 3, 9, 27, 81, 243, 7, 14, 28, 56, 112, 224, 190],
    [7, 7, 7, 1, 9],
    [
        11,
        22,
        33,
        44,
        55,
        66,
        77,
        88,
        99,
        110,
        121,
        132,
        143,
        154,
        165,
        176,
        187,
        198,
        209,
        220,
        231,
        242,
        253,
        4,
    ],
]
MAX_NEW = 8


@pytest.fixture(scope="module")
def adapter_dirs(hf_model, tmp_path_factory):
    """The three PEFT adapters with random (non-zero) A and B, saved as safetensors."""
    return save_random_adapters(hf_model, tmp_path_factory.mktemp("peft_adapters"), ADAPTERS, 100)


def _fresh(hf_model):
    import copy

    return copy.deepcopy(hf_model)


def _peft_model(hf_model, adapter_dir):
    if adapter_dir is None:
        return hf_model
    return peft.PeftModel.from_pretrained(_fresh(hf_model), adapter_dir).eval()


def _oracle(model, prompt: list[int]) -> tuple[np.ndarray, list[int]]:
    """Teacher-forced log-softmax at every prompt position, and PEFT's greedy tokens."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1).numpy()  # [P, V]
        gen = model.generate(
            ids,
            max_new_tokens=MAX_NEW,
            do_sample=False,
            attention_mask=torch.ones_like(ids),
            pad_token_id=0,
        )
    return logp, gen[0, len(prompt) :].tolist()


def assert_greedy_matches(model, prompt: list[int], tokens, greedy: list[int], tol=1e-4):
    """Our greedy `tokens` after `prompt` equal PEFT's generate (`greedy`), or, where they part,
    each of ours is PEFT's most likely next token given the same prefix up to a tie within
    `tol` in logprob, which float rounding may break either way (models with final logit
    softcapping saturate into near-exact ties)."""
    tokens = list(tokens)
    if tokens != greedy:
        assert_greedy_choices(model, prompt, tokens, tol)


def assert_greedy_choices(model, prompt: list[int], tokens: list[int], tol: float = 1e-4):
    """Each of `tokens`, generated greedily after `prompt`, is PEFT's most likely next token
    given the same prefix, or within `tol` of it in logprob."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1).numpy()
    for i, token in enumerate(tokens):
        row = logp[len(prompt) - 1 + i]
        assert row[token] >= row.max() - tol, (
            f"token {i}: {token} at logprob {row[token]:.6f}, PEFT's best "
            f"{int(row.argmax())} at {row.max():.6f}"
        )


@pytest.fixture(scope="module")
def requests(adapter_dirs):
    names = [None, *ADAPTERS]
    return [(p, names[i % len(names)]) for i, p in enumerate(PROMPTS * 2)]


def _lora(name, adapter_dirs):
    if name is None:
        return None
    return LoRARequest(name, list(ADAPTERS).index(name) + 1, str(adapter_dirs[name]))


@pytest.mark.parametrize("adapter_dtype", ["auto", "float32", "bfloat16", "float16", "int8"])
@pytest.mark.parametrize(
    "limits",
    [
        dict(max_loras=4),
        # one adapter at a time, two sequences: requests wait, and their adapters are put
        # into free pages ahead of admission (prefetch), then used from there
        dict(max_loras=1, max_num_seqs=2, prefetch_adapters=True),
    ],
)
def test_mixed_batch_matches_peft(
    tiny_row_exports, hf_model, adapter_dirs, requests, limits, adapter_dtype
):
    """bfloat16, float16 and int8 rows are checked against PEFT whose LoRA weights are rounded
    the same way (adapter_rows.served; float32 arithmetic on both sides), to the same
    tolerance; auto (the default) serves these float32 adapters in float32 rows."""
    from peft_cases import assert_matches_peft, served_lora

    llm = LLM(tiny_row_exports[adapter_dtype], num_pages=256, **limits)
    assert llm.engine.manifest.adapter_dtype == {"float32": None}.get(adapter_dtype, adapter_dtype)
    models = {None: hf_model}
    models |= {
        n: served_lora(_peft_model(hf_model, adapter_dirs[n]), adapter_dtype) for n in ADAPTERS
    }
    loras = [_lora(n, adapter_dirs) for _, n in requests]
    assert_matches_peft(llm, requests, loras, models, MAX_NEW)
    stats = llm.engine.pool.stats()
    prefetched = stats.adapter_loads - stats.adapter_misses  # loads no admission waited for
    assert (prefetched > 0) == bool(limits.get("prefetch_adapters"))


def _saved_as(src: Path, dst: Path, dtype: str) -> Path:
    """A copy of adapter directory src with its weights saved in dtype; bfloat16: its A rows
    scaled by 2^-14 and B by 2^14 first (the same delta), so that some values of A lie where
    float16 has too few bits for them."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = dst / "adapter_model.safetensors"
    tensors = load_file(weights)
    if dtype == "bfloat16":
        tensors = {k: v * (2.0**-14 if "lora_A" in k else 2.0**14) for k, v in tensors.items()}
    save_file({k: v.to(getattr(torch, dtype)) for k, v in tensors.items()}, weights)
    return dst


@pytest.mark.parametrize("export", ["float16", "auto"])
def test_16bit_rows_serve_16bit_adapters_exactly(
    tiny_row_exports, hf_model, adapter_dirs, requests, tmp_path, export
):
    """Adapters saved in float16 or bfloat16 (as many are): 16-bit rows hold their values
    exactly, so the engine matches PEFT on the files as they are, nothing rounded on either
    side. The float16 export with every adapter saved in float16; the default (auto) export
    with one adapter saved in float16, one in bfloat16 and one in float32, served in one batch
    from rows of those three types."""
    from peft_cases import assert_matches_peft, peft_models

    saved = dict.fromkeys(ADAPTERS, "float16")
    if export == "auto":
        saved = {"qv4": "float16", "all8": "bfloat16", "mlp16": "float32"}
    dirs = {n: _saved_as(adapter_dirs[n], tmp_path / n, t) for n, t in saved.items()}
    llm = LLM(tiny_row_exports[export], num_pages=256)
    loras = [_lora(n, dirs) for _, n in requests]
    assert_matches_peft(llm, requests, loras, peft_models(hf_model, dirs, ADAPTERS), MAX_NEW)
    rows = {n: llm.engine.registry.row_type(n) for n in ADAPTERS}
    assert rows == {n: None if t == "float32" else t for n, t in saved.items()}


def test_adapters_change_the_output(tiny_llama_export, adapter_dirs):
    llm = LLM(tiny_llama_export, num_pages=256)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    names = [None, *ADAPTERS]
    outs = llm.generate(
        [{"prompt_token_ids": PROMPTS[1]}] * len(names),
        params,
        lora_request=[_lora(n, adapter_dirs) for n in names],
    )
    tokens = [tuple(o.outputs[0].token_ids) for o in outs]
    assert len(set(tokens)) == len(names), "every adapter must change the greedy output"


@pytest.mark.parametrize("num_pages", [256, 24])
def test_isolation_alone_equals_mixed(tiny_llama_export, adapter_dirs, num_pages):
    """Each request alone == the same request in a mixed batch of 16 (tiny pool: preempts)."""
    rng = np.random.default_rng(7)
    names = [None, *ADAPTERS]
    reqs = [(rng.integers(3, 256, rng.integers(4, 30)).tolist(), names[i % 4]) for i in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(
        tiny_llama_export,
        num_pages=num_pages,
        max_num_seqs=16,
        max_loras=4,
        max_num_batched_tokens=64,
    )
    mixed = llm.generate(
        [{"prompt_token_ids": p} for p, _ in reqs],
        params,
        lora_request=[_lora(n, adapter_dirs) for _, n in reqs],
    )
    if num_pages == 24:
        assert llm.engine.scheduler.num_preemptions > 0, "the tiny pool should force preemption"
    _assert_same_as_alone(tiny_llama_export, adapter_dirs, reqs, mixed, params)
    stats = llm.engine.pool.stats()
    assert stats.kv_pages == 0 and stats.adapter_pages_pinned == 0


def test_no_step_touches_a_page_a_copy_lands_in(tiny_llama_export, adapter_dirs):
    """Adapter copies timed as on a GPU (the CUDA session's PrefetchTracker, fake events): a
    step waits for every copy but the prefetches issued with it, the rest stay in flight. No
    step writes KV into, or reads an adapter from, a page whose copy has not landed. A tight
    pool with prefetch makes evictions hand adapter pages to KV; outputs equal running alone."""
    from ort_lora import contract as C
    from ort_lora.runtime.prefetch import Load, PrefetchTracker

    rng = np.random.default_rng(5)
    names = [*ADAPTERS, None]
    reqs = [(rng.integers(3, 256, 20).tolist(), names[i % 4]) for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM(tiny_llama_export, num_pages=24, max_loras=1, max_num_seqs=3,
              max_num_batched_tokens=64, prefetch_adapters=True)  # fmt: skip
    engine, session = llm.engine, llm.engine.runner.session
    copies, plans, reused, loaded = PrefetchTracker(), [], [], set()
    schedule, load, run = engine.scheduler.schedule, session.load_adapter, session.run

    def recording_schedule():
        plans.append(schedule())
        return plans[-1]

    def timed_load(adapter_id, pages, write, prefetch=False):
        copies.begin(Load(adapter_id, tuple(pages), object(), None, prefetch))
        return load(adapter_id, pages, write, prefetch)

    def timed_run(inputs, **kw):
        waited = set(copies.events_for_step())
        copies.retire(lambda event: event in waited)
        landing = {p for ld in copies.inflight for p in ld.pages}
        kv = set((inputs[C.SLOT_MAPPING] // engine.manifest.block_size).tolist())
        read = {p for a in plans[-1].adapters for p in a.pages}
        assert not (kv | read) & landing, "a step touches a page a copy still lands in"
        reused.append(bool(kv & loaded))  # an evicted adapter's page holds KV now
        loaded.update(p for a in plans[-1].loads + plans[-1].prefetch for p in a.pages)
        return run(inputs, **kw)

    engine.scheduler.schedule, session.load_adapter, session.run = (
        recording_schedule, timed_load, timed_run,
    )  # fmt: skip
    outs = llm.generate(
        [{"prompt_token_ids": p} for p, _ in reqs],
        params,
        lora_request=[_lora(n, adapter_dirs) for _, n in reqs],
    )
    assert any(p.prefetch for p in plans) and any(reused)
    _assert_same_as_alone(tiny_llama_export, adapter_dirs, reqs, outs, params)


def _assert_same_as_alone(model_dir, adapter_dirs, reqs, outs, params) -> None:
    """Each (prompt, adapter name) request's tokens equal running it alone in a roomy pool."""
    alone = LLM(model_dir, num_pages=256)
    for (prompt, name), out in zip(reqs, outs, strict=True):
        ref = alone.generate(
            {"prompt_token_ids": prompt}, params, lora_request=_lora(name, adapter_dirs)
        )[0]
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids, f"request on {name}"


def test_an_adapter_that_fails_to_load_ends_only_its_requests(
    tiny_llama_export, adapter_dirs, tmp_path
):
    """An adapter file damaged after registration (the host cache holds one adapter, so the
    pool load rereads it from disk) fails that adapter's requests with an error naming it;
    the other requests finish with the tokens they get alone, and the engine keeps serving."""
    import asyncio
    import shutil

    from ort_lora.adapters import AdapterError
    from ort_lora.engine.async_engine import AsyncEngine

    broken = tmp_path / "qv4"
    shutil.copytree(adapter_dirs["qv4"], broken)
    loras = [None, LoRARequest("qv4", 1, str(broken)), _lora("all8", adapter_dirs)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    alone = LLM(tiny_llama_export, num_pages=256)
    want = [
        alone.generate({"prompt_token_ids": p}, params, lora_request=lo)[0].outputs[0].token_ids
        for p, lo in zip(PROMPTS, loras)
        if lo is None or lo.lora_name != "qv4"
    ]

    async def run(engine, prompt, lora):
        try:
            outs = [o async for o in engine.generate(prompt, params, lora_request=lora)]
        except AdapterError as e:
            return e
        return outs[-1].outputs[0].token_ids

    async def main():
        engine = AsyncEngine.from_model_dir(  # not preloaded: the first step rereads qv4
            tiny_llama_export, num_pages=256, max_loras=1, max_cpu_loras=1, preload_adapters=False
        )
        for lora in loras[1:]:
            engine.add_lora(lora)
        (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
        await engine.start()
        try:
            got = await asyncio.gather(*(run(engine, p, lo) for p, lo in zip(PROMPTS, loras)))
            again = await run(engine, PROMPTS[2], loras[2])  # still serving
            stats = engine.engine.pool.stats()
        finally:
            await engine.stop()
        return got, again, stats

    (base, failed, all8), again, stats = asyncio.run(main())
    assert isinstance(failed, AdapterError)
    assert "adapter 'qv4' could not be loaded" in str(failed) and "safetensors" in str(failed)
    assert [base, all8] == want and again == want[1]
    assert stats.kv_pages == 0 and stats.adapter_pages_pinned == 0

    shutil.copytree(adapter_dirs["qv4"], broken, dirs_exist_ok=True)
    llm = LLM(tiny_llama_export, num_pages=256, max_loras=1, max_cpu_loras=1,
              preload_adapters=False)  # fmt: skip
    for lora in loras[1:]:
        llm.engine.add_lora(lora)
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    with pytest.raises(AdapterError, match="adapter 'qv4' could not be loaded"):
        llm.generate(prompts, params, lora_request=loras)  # the offline API: all or nothing
    assert llm.generate(prompts[0], params)[0].outputs[0].token_ids == want[0]


def test_registered_adapters_are_preloaded_into_free_pages(tiny_llama_export, adapter_dirs):
    """add_lora copies each adapter into free pool pages (idle, evicting nothing), so the
    requests' steps load none; the tokens are those of an engine that loads them on first use.
    A pool too small for all of them preloads what fits; KV blocks take an idle adapter's
    pages back; remove_lora frees a preloaded adapter's pages."""
    from ort_lora.engine.invariants import assert_invariants

    def check(engine):
        assert_invariants(engine.pool, engine.registry, engine.scheduler, engine.tracker)

    loras = [_lora(n, adapter_dirs) for n in ADAPTERS]
    ids = [lo.lora_int_id for lo in loras]
    reqs = [(PROMPTS[i % len(PROMPTS)], loras[i % len(loras)]) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    tokens = {}
    for preload in (True, False):
        llm = LLM(tiny_llama_export, num_pages=256, max_cpu_loras=1, preload_adapters=preload)
        pool = llm.engine.pool
        for lora in loras:
            llm.engine.add_lora(lora)
        assert [pool.is_resident(a) for a in ids] == [preload] * len(ids)
        assert pool.stats().adapter_pages_pinned == 0
        loads = pool.stats().adapter_loads
        outs = llm.generate(
            [{"prompt_token_ids": p} for p, _ in reqs], params, lora_request=[r for _, r in reqs]
        )
        stats = pool.stats()
        assert (stats.adapter_loads == loads, stats.adapter_misses == 0) == (preload, preload)
        check(llm.engine)
        tokens[preload] = [o.outputs[0].token_ids for o in outs]
    assert tokens[True] == tokens[False]

    engine = LLM(tiny_llama_export, num_pages=256).engine  # a CPU pool keeps no host copies
    for lora in loras:
        engine.add_lora(lora)
    assert engine.registry.cached_ids() == [] and engine.registry.stats["loads"] == len(loras)
    for lora in loras[1:]:
        engine.remove_lora(lora.lora_name)
    size = len(engine.pool.adapter_pages(ids[0]))
    engine.remove_lora(loras[0].lora_name)
    assert not engine.pool.is_resident(ids[0]) and engine.pool.stats().free_pages == 256

    small = LLM(tiny_llama_export, num_pages=size + 1).engine  # room for one adapter
    for lora in loras:
        small.add_lora(lora)
    assert [small.pool.is_resident(a) for a in ids] == [True] + [False] * (len(ids) - 1)
    assert small.pool.stats().adapter_evictions == 0
    small.add_request("r", PROMPTS[1], SamplingParams(max_tokens=1), None)  # 3 KV blocks
    while small.has_unfinished_requests():
        small.step()
        check(small)
    assert not small.pool.is_resident(ids[0]) and small.pool.stats().adapter_evictions == 1
