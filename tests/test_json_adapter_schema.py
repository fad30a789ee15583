"""The json demo adapter under a response schema.

Without a model: a JSON schema's grammar writes json.dumps' layout and ends at the object's
"}"; the schema-shaped training answers teach values, never keys, and cover the schemas marked
trained. On the default model (conftest's `smollm2_default_export` and `demo_adapters`),
greedy, held-out prompts: the schema's object, valid (jsonschema), ending the output at its
"}" (finish_reason "stop"), with the answer the adapter gives without a schema.
scripts/eval_json_schema.py measures the same over the whole held-out split
(ort_lora/demo/adapters/schema_metrics.json)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from ort_lora.demo.schemas import SCHEMAS
from ort_lora.demo.tasks import TASKS, json_facts
from ort_lora.errors import RequestError
from ort_lora.sampling_params import StructuredOutputs

N_PROMPTS = 4
MAX_TOKENS = 48
STRING = {"type": "string"}
NAME = re.compile(r"[A-Z][a-z]+( [A-Z][a-z]+)*")  # a place: "Paris", "Buenos Aires"


def test_json_grammar_writes_json_dumps_layout_and_ends_at_the_brace(tiny_llama_export):
    """{"a": 1, "b": "x"} (", " and ": ", no other whitespace), the layout models write; the
    object's "}" completes the grammar (the completion stops): nothing may follow it."""
    from ort_lora import LLM

    llm = LLM(tiny_llama_export)
    tok, grammars = llm.get_tokenizer(), llm.engine.grammars
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": STRING},
              "required": ["a", "b"]}  # fmt: skip

    def advance(text: str) -> list[bool]:
        constraint = grammars.constraints_for(StructuredOutputs(json=schema))()
        return [constraint.advance(t) for t in tok.encode(text, add_special_tokens=False)]

    done = advance(json.dumps({"a": 1, "b": "x"}))
    assert done[-1] and not any(done[:-1])
    for other in ('{"a":1,"b":"x"}', '{"a": 1,"b": "x"}', '{ "a": 1, "b": "x"}',
                  '{"a": 1, "b": "x"} ', '{"a": 1, "b": "x"}\n'):  # fmt: skip
        with pytest.raises(RequestError, match="left its grammar"):
            advance(other)


def test_required_tool_calls_are_read_back_in_that_layout():
    """tool_choice "required": every call of the array the grammar writes (", " between them)
    is a tool call, the complete ones of an array max_tokens cut short too."""
    from ort_lora.server.structured import OutputSpec, tool_calls

    calls = [{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]
    text = json.dumps(calls)
    for cut, names in ((text, ["a", "b"]), (text[:-3], ["a"])):
        content, read = tool_calls(OutputSpec(tool_mode="required"), cut)
        assert content is None and [c["function"]["name"] for c in read] == names, cut


def test_variants_teach_values_not_keys():
    """Each schema-shaped training answer is a JSON object whose learned spans are exactly its
    values (each with the "," or "}" after it); they come from the train split only."""
    task = TASKS["json"]
    train = set(task.split_prompts("train"))
    for prompt in train:
        for target, spans in task.variants(prompt):
            value = json.loads(target)
            closers = [","] * (len(value) - 1) + ["}"]
            written = [json.dumps(v) + c for v, c in zip(value.values(), closers)]
            assert [target[a:b] for a, b in spans] == written, target
    variants = task.make_variant_examples(500, seed=0)
    assert {p for p, _ in variants} <= train and len({v.target for _, v in variants}) > 100


def test_trained_flags_tell_which_schemas_the_training_answers_fit():
    """A schema marked trained fits some training answer; one marked not, none."""
    task, facts = TASKS["json"], json_facts()
    targets = [json.loads(v.target) for p in task.split_prompts("train") for v in task.variants(p)]
    targets += [json.loads(t) for t in task.examples().values()]
    for s in SCHEMAS.values():
        fits = any(jsonschema.Draft202012Validator(s.schema).is_valid(t) for t in targets)
        assert fits == s.trained, s.name
    assert all(s.fits(facts[p]) for s in SCHEMAS.values() if s.kinds is None for p in facts)


def held_out(n: int, kind: str | None = None) -> list[str]:
    """The first n held-out json prompts (seeded order) with a text answer, of `kind` if given."""
    task, facts = TASKS["json"], json_facts()
    pool = task.make_prompts(len(task.split_prompts("eval")), seed=0, split="eval")
    fits = [p for p in pool if isinstance(facts[p].short, str) and kind in (None, facts[p].kind)]
    return fits[:n]


@pytest.fixture(scope="module")
def json_llm(smollm2_default_export, demo_adapters):
    from ort_lora import LLM
    from ort_lora.lora_request import LoRARequest

    llm = LLM(smollm2_default_export, max_loras=1, max_num_seqs=8)
    return llm, LoRARequest("json", 1, str(demo_adapters["json"]))


def answers(json_llm, prompts: list[str], schema: dict | None) -> list:
    from ort_lora.sampling_params import SamplingParams, StructuredOutputs

    llm, lora = json_llm
    constraint = None if schema is None else StructuredOutputs(json=schema)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=constraint)
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, lora)
    return [o.outputs[0] for o in outs]


def assert_object_then_stop(out, schema: dict) -> dict:
    value = json.loads(out.text)  # the whole output: nothing before or after the object
    jsonschema.validate(value, schema)
    assert out.finish_reason == "stop" and out.text.endswith("}"), out
    return value


@pytest.mark.slow
def test_own_schema_gives_what_the_adapter_writes_unconstrained(json_llm):
    """{"answer": string}: the grammar's layout is the adapter's own, so it changes nothing."""
    prompts = held_out(N_PROMPTS)
    free = answers(json_llm, prompts, None)
    constrained = answers(json_llm, prompts, SCHEMAS["answer"].schema)
    for p, f, c in zip(prompts, free, constrained):
        assert TASKS["json"].check(p, f.text), (p, f.text)
        assert_object_then_stop(c, SCHEMAS["answer"].schema)
        assert c.text == f.text.strip(), p


@pytest.mark.slow
@pytest.mark.parametrize("name", ["answer_confidence", "answer_level", "answer_certain"])
def test_a_second_field_follows_the_same_answer(json_llm, name):
    """A schema that wants a field after the answer: the adapter closes its answer and goes
    on (no runaway string to max_tokens), and the answer is the one it gives unconstrained."""
    prompts = held_out(N_PROMPTS)
    free = [json.loads(o.text)["answer"] for o in answers(json_llm, prompts, None)]
    for p, a, out in zip(prompts, free, answers(json_llm, prompts, SCHEMAS[name].schema)):
        assert assert_object_then_stop(out, SCHEMAS[name].schema)["answer"] == a, (p, out.text)


@pytest.mark.slow
def test_other_keys_hold_the_answer(json_llm):
    """{"city", "country"} for capital questions: two names, the city not the country."""
    schema = SCHEMAS["city_country"].schema
    prompts = held_out(2, kind="city")
    for p, out in zip(prompts, answers(json_llm, prompts, schema)):
        value = assert_object_then_stop(out, schema)
        assert all(NAME.fullmatch(value[k]) for k in ("city", "country")), (p, out.text)
        assert value["city"] != json_facts()[p].subject, (p, out.text)


@pytest.mark.slow
def test_response_format_over_http(smollm2_server, demo_adapters):
    """The server's response_format json_schema: the object, finish_reason "stop"."""
    schema = SCHEMAS["answer_confidence"].schema
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    for prompt in held_out(2):
        body = {"model": "json", "messages": [{"role": "user", "content": prompt}],
                "response_format": fmt, "max_tokens": MAX_TOKENS, "temperature": 0}  # fmt: skip
        r = httpx.post(smollm2_server[0] + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
