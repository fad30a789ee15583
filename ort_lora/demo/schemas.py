"""The json demo adapter under response schemas: the schemas it is measured under, and the
schema-shaped answers it is trained on beside its own {"answer": ...}.

Under a response_format the grammar (engine/grammar.py) writes the keys and the layout the
schema asks for, and the model writes the values; the model sees only the question (an
OpenAI-compatible server does not put the schema into the prompt). So the adapter learns to
give its answer under whichever key the grammar opens ("city", "color", ...) and to go on
after it when the schema wants another field (`", "confidence": ...`), from a minority of its
training examples, so that without a schema it still answers {"answer": ...}.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ort_lora.demo.facts import Fact

STRING = {"type": "string"}
CONFIDENCE = 0.9  # what the schema-shaped training answers say of their confidence
LEVEL = "high"


def _object(**properties) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties)}


@dataclass(frozen=True)
class ResponseSchema:
    """A schema a user of the json adapter might send, and where the answer goes in it."""

    name: str
    schema: dict
    key: str  # the property that holds the answer to the question
    kinds: tuple[str, ...] | None = None  # Fact.kind of the questions it fits (None: all)
    trained: bool = True  # its shape is among the training answers (schema_targets)

    def fits(self, fact: Fact) -> bool:
        return self.kinds is None or fact.kind in self.kinds


SCHEMAS: dict[str, ResponseSchema] = {
    s.name: s
    for s in (
        ResponseSchema("answer", _object(answer=STRING), "answer"),
        ResponseSchema(
            "answer_confidence",
            _object(answer=STRING, confidence={"type": "number", "minimum": 0, "maximum": 1}),
            "answer",
        ),
        ResponseSchema(
            "answer_level",
            _object(answer=STRING, confidence={"enum": ["low", "medium", "high"]}),
            "answer",
        ),
        ResponseSchema("city_country", _object(city=STRING, country=STRING), "city", ("city",)),
        ResponseSchema(
            "answer_certain",
            _object(answer=STRING, certain={"type": "boolean"}),
            "answer",
            trained=False,
        ),
        ResponseSchema("result", _object(result=STRING), "result", trained=False),
    )
}


def schema_targets(fact: Fact) -> list[tuple[str, tuple[tuple[int, int], ...]]]:
    """Schema-shaped answers to a question, in the grammar's layout (json.dumps'): the answer
    followed by a confidence (a number, a level), the answer under the key of its kind
    ({"color": "red"}), and for a capital the city and its country. Each comes with the spans
    of its text the model writes under a schema, the ones it learns: every value with the ","
    or "}" after it. The keys and separators are the grammar's: learning them would teach the
    adapter to write them unasked ({"city": ...} where it should write {"answer": ...})."""
    shapes = [
        {"answer": fact.short, "confidence": CONFIDENCE},
        {"answer": fact.short, "confidence": LEVEL},
        {fact.kind: fact.short},
    ]
    if fact.kind == "city":
        shapes.append({"city": fact.short, "country": fact.subject})
    return [_written(shape) for shape in shapes]


def _written(shape: dict) -> tuple[str, tuple[tuple[int, int], ...]]:
    """json.dumps(shape) and the spans of its values, each with the character after it."""
    text, spans = "{", []
    for i, (key, value) in enumerate(shape.items()):
        text += (" " if i else "") + json.dumps(key) + ": "
        start = len(text)
        text += json.dumps(value) + ("}" if i == len(shape) - 1 else ",")
        spans.append((start, len(text)))
    assert text == json.dumps(shape), text
    return text, tuple(spans)
