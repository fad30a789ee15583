"""What every request body's fields are held to: the strict base model (`_Request`), bounded
types, the size of a structured-output constraint, valid Unicode, and the fields of the OpenAI
API or vLLM that ort-lora does not implement (UNSUPPORTED).

Every field is bounded, so that no value can reach the engine thread and fail there: integers
to what the engine holds (int64; seeds 0 .. 2^64 - 1, as vLLM), floats finite, strings valid
Unicode (no lone surrogates, anywhere in the body), sizes capped (limits.py: lists by
`max_length`, constraint sources by MAX_CONSTRAINT_CHARS). Types are strict: a number field
takes a JSON number (an integer field an integer), never `true` or `"1"`.

A check across fields raises RequestError (a ValueError) with the field it names: its `param`
reaches the 400 (errors.py), which never repeats the body.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from ort_lora.errors import RequestError
from ort_lora.sampling_params import MAX_INT
from ort_lora.server.limits import MAX_CONSTRAINT_CHARS

MAX_TOP_LOGPROBS = 20
MAX_N = 16
TOKEN_ID_KEY = re.compile(r"[0-9]{1,19}")  # ASCII digits only (str.isdigit takes "١٢")
# chat_template_kwargs the renderer sets itself (or Jinja's render takes): refused by name
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "add_generation_prompt", "template", "self", "tools", "documents"}
)

Int = Annotated[int, Field(ge=-MAX_INT, le=MAX_INT)]
TokenIds = list[Annotated[int, Field(ge=0, le=MAX_INT)]]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
Name = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
# OpenAI's metadata: at most 16 pairs, keys up to 64 characters, values up to 512
MAX_METADATA = 16
MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


def _constraint_chars(value) -> int:
    """A constraint's size as the grammar compiler reads it: a schema's characters as JSON
    text (about: separators are counted once), a regex or grammar, choices together. Counted
    only up to just past MAX_CONSTRAINT_CHARS, in Python (the event loop gets the GIL
    between steps; json.dumps of a 4 MiB schema would hold it)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(len(v) for v in value)
    total, stack = 0, [value]
    while stack and total <= MAX_CONSTRAINT_CHARS:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v) + 2
        elif isinstance(v, dict):
            total += 2 + 2 * len(v)
            stack += [*v.keys(), *v.values()]
        elif isinstance(v, list):
            total += 2 + len(v)
            stack += v
        else:
            total += 4  # a number, true, false or null
    return total


def _bounded_constraint(value):
    size = _constraint_chars(value)
    if size > MAX_CONSTRAINT_CHARS:
        raise ValueError(
            f"over {size - 1} characters; a constraint (JSON schema as JSON text, regex, grammar, "
            f"choices) may have at most {MAX_CONSTRAINT_CHARS}"
        )
    return value


# The source of a structured-output constraint (its compile time grows with its size)
Source = AfterValidator(_bounded_constraint)
# Fields of the OpenAI API / vLLM that ort-lora does not implement: any value but these is a
# 400 naming the field (never silently dropped).
UNSUPPORTED = {
    "suffix": (None, ""),
    "best_of": (None, 1),
    "functions": (None,),
    "function_call": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None, "none"),
    "verbosity": (None, "medium"),
    "moderation": (None,),
    "web_search_options": (None,),
    "min_tokens": (None, 0),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "truncate_prompt_tokens": (None,),
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    "structural_tag": (None,),
    "return_tokens_as_token_ids": (None, False),
    "continue_final_message": (None, False),
    "documents": (None,),
    "mm_processor_kwargs": (None,),
}


def _lone_surrogate(value, path: str) -> str | None:
    """The path of the first string (value or key) in `value` that holds a lone surrogate
    (not encodable text: JSON's "\\ud800" escapes allow them), or None. Paths are built
    only for the hit: a body may hold a million numbers."""
    stack = [(value, (path,))]
    while stack:
        v, at = stack.pop()
        if isinstance(v, str):
            if not _encodable(v):
                return "".join(_flatten(at))
        elif isinstance(v, dict):
            stack += [(k, (at, ".<key>")) for k in v if not _encodable(k)]
            stack += [(x, (at, f".{k}")) for k, x in v.items() if _walked(x)]
        elif isinstance(v, list) and not set(map(type, v)) <= _SCALARS:  # token ids: skipped
            stack += [(x, (at, i)) for i, x in enumerate(v) if _walked(x)]
    return None


_SCALARS = {int, float, bool, type(None)}


def _walked(value) -> bool:
    return isinstance(value, str | dict | list)


def _encodable(text) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _flatten(at) -> list[str]:
    parts = []
    while isinstance(at, tuple) and len(at) == 2:
        at, last = at
        parts.append(f"[{last}]" if isinstance(last, int) else last)
    return [at[0] if isinstance(at, tuple) else at, *reversed(parts)]


# The base of every request body and its parts: strict types, finite floats, unknown fields
# kept in `model_extra` (serving.py checks them), no lone surrogate anywhere.
class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        bad = _lone_surrogate(data, "body")
        if bad is not None:
            field = re.match(r"body\.([^.\[<]+)", bad)  # the top-level field it lies in
            raise RequestError(
                f"{bad} holds a lone UTF-16 surrogate: not valid Unicode text",
                field and field.group(1),
            )
        return data
