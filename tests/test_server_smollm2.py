"""The default model behind the server: SmolLM2-135M-Instruct (conftest's
`smollm2_default_export`: the int4 or float32 export, as `ort-lora serve` runs it) with the
bundled demo adapters, over the official `openai` client.

A mixed stream of 24 concurrent chat requests over all demo adapters: every adapter's task
succeeds (ort_lora.demo.tasks checker) at the same rate as when its requests are served alone.
"""

from __future__ import annotations

import asyncio

import openai
import pytest

pytestmark = pytest.mark.slow
NUM_REQUESTS = 24
MAX_TOKENS = 32


def _jobs(adapters) -> list[tuple[str, str]]:
    """(adapter, prompt) round-robin over the adapters, eval prompts of each task."""
    from ort_lora.demo.tasks import TASKS

    names = sorted(adapters)
    per = -(-NUM_REQUESTS // len(names))
    prompts = {n: TASKS[n].make_prompts(per, seed=0, split="eval") for n in names}
    return [(names[i % len(names)], prompts[names[i % len(names)]][i // len(names)])
            for i in range(NUM_REQUESTS)]  # fmt: skip


async def _chat(client, model: str, prompt: str) -> str:
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        stream=True,
    )
    return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


async def _run(url: str, jobs, concurrent: bool) -> list[str]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    if concurrent:
        return list(await asyncio.gather(*(_chat(client, m, p) for m, p in jobs)))
    return [await _chat(client, m, p) for m, p in jobs]


def test_models_list_demo_adapters(smollm2_server, demo_adapters):
    url, engine = smollm2_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    cards = {m.id: m for m in client.models.list().data}
    assert set(demo_adapters) <= set(cards)
    assert all(cards[a].parent == engine.model_name for a in demo_adapters)


def test_mixed_24_concurrent_same_success_as_alone(smollm2_server, demo_adapters):
    from ort_lora.demo.tasks import TASKS

    url, adapters = smollm2_server[0], demo_adapters
    jobs = _jobs(adapters)
    mixed = asyncio.run(_run(url, jobs, concurrent=True))
    report = []
    for name in sorted(adapters):
        mine = [(i, p) for i, (m, p) in enumerate(jobs) if m == name]
        alone = asyncio.run(_run(url, [(name, p) for _, p in mine], concurrent=True))
        ok_alone = sum(TASKS[name].check(p, a) for (_, p), a in zip(mine, alone, strict=True))
        ok_mixed = sum(TASKS[name].check(p, mixed[i]) for i, p in mine)
        same = sum(mixed[i] == a for (i, _), a in zip(mine, alone, strict=True))
        report.append(f"{name}: alone {ok_alone}/{len(mine)} mixed {ok_mixed}/{len(mine)} "
                      f"identical texts {same}/{len(mine)}")  # fmt: skip
        assert ok_mixed == ok_alone, report
        # Greedy decoding: batching with other adapters changes (almost) nothing.
        assert same >= len(mine) - 1, report
    print("\n".join(report))


def test_serve_without_model_dir_uses_default_model_and_demo_adapters(
    smollm2_default_export, demo_adapters, tmp_path
):
    """`ort-lora serve` with no MODEL_DIR: the cached default export (here: the fixture's,
    linked into a fresh ORT_LORA_CACHE) plus every demo adapter."""
    import httpx

    from ort_lora.bench.harness.servers import ServeProcess
    from ort_lora.server.default_model import DEFAULT_MODEL_NAME

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / DEFAULT_MODEL_NAME).symlink_to(smollm2_default_export)
    env = {"ORT_LORA_CACHE": str(tmp_path)}
    with ServeProcess(["--log-level", "warning"], env=env) as url:
        cards = {m["id"]: m for m in httpx.get(url + "/v1/models").json()["data"]}
        assert set(cards) == {DEFAULT_MODEL_NAME, *demo_adapters}
        assert all(cards[a]["parent"] == DEFAULT_MODEL_NAME for a in demo_adapters)
        name = sorted(demo_adapters)[0]
        body = {"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
