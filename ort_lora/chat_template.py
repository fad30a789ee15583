"""Chat templates: where a model (or an adapter) keeps its template, and rendering it.

Templates render in a sandboxed jinja2 environment configured the way transformers does
(trim_blocks, lstrip_blocks, loopcontrols, `raise_exception`, `strftime_now`, a `tojson` that
does not escape HTML, `{% generation %}` blocks), so rendered prompts match it exactly.

A template may come from a request (the server allows that only with
--trust-request-chat-template), so every render is bounded (template_bounds.py): at most
MAX_TEMPLATE_OPS operations, MAX_TEMPLATE_SECONDS of time, no value (string, list) longer
than MAX_TEMPLATE_CHARS and no integer over MAX_TEMPLATE_INT_BITS, and at most
MAX_TEMPLATE_CHARS of output, which must be valid Unicode (no lone surrogate). Past a bound,
or on any template error, the render stops with a ChatTemplateError that says which.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
import jinja2.ext

from ort_lora.template_bounds import MAX_TEMPLATE_CHARS, budget, check_size
from ort_lora.template_sandbox import new_environment

CONFIG_FILE = "tokenizer_config.json"
# Where a model or adapter directory keeps its chat template, in the order looked at.
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", CONFIG_FILE)


class ChatTemplateError(ValueError):
    """The chat template is missing, rejected the messages (its `raise_exception`), failed,
    or went past a bound of the render."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders
    its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _strftime_now(fmt):
    text = datetime.now().strftime(fmt)
    check_size(len(text), "strftime_now")
    return text


@lru_cache(maxsize=32)
def _compile_template(source: str) -> jinja2.Template:
    env = new_environment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_chat_template(
    source: str, messages: list[dict], add_generation_prompt: bool, context: dict
) -> str:
    """The prompt text; ChatTemplateError on a template error, past a bound, or when the
    text is not valid Unicode (a lone surrogate: no tokenizer could encode it)."""
    try:
        template = _compile_template(source)
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {_short(exc)}") from exc
    except RecursionError as exc:
        raise ChatTemplateError("chat template does not compile: nested too deeply") from exc
    budget.start()
    try:
        text = _render(template, messages, add_generation_prompt, context)
    except jinja2.exceptions.SecurityError as exc:
        raise ChatTemplateError(f"chat template went past a bound: {_short(exc)}") from exc
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template rejected the messages: {_short(exc)}") from exc
    except (TypeError, ValueError, ArithmeticError, LookupError, RecursionError) as exc:
        if isinstance(exc, ChatTemplateError):
            raise
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}") from exc
    finally:
        budget.stop()
    _check_unicode(text)
    return text


def _render(template, messages, add_generation_prompt, context) -> str:
    parts, size = [], 0
    stream = template.generate(
        messages=messages, add_generation_prompt=add_generation_prompt, **context
    )
    for part in stream:
        parts.append(part)
        size += len(part)
        if size > MAX_TEMPLATE_CHARS:
            raise ChatTemplateError(
                f"chat template output exceeds {MAX_TEMPLATE_CHARS} chars (MAX_TEMPLATE_CHARS)"
            )
        budget.tick()  # time is checked between output parts too
    return "".join(parts)


def _short(exc: Exception, limit: int = 1000) -> str:
    """An error's text as an API error can show it: a template's raise_exception may be long
    or hold a lone surrogate (escaped here: a JSON body must be valid UTF-8)."""
    text = str(exc)[: limit + 1].encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[:limit] + "..."


def lone_surrogate(text: str) -> str | None:
    """Where `text` is not valid Unicode ("a lone surrogate (U+D800) at character 3"), or
    None: a tokenizer, a JSON body and a log line all need valid Unicode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"a lone surrogate (U+{ord(text[exc.start]):04X}) at character {exc.start}"
    return None


def _check_unicode(text: str) -> None:
    where = lone_surrogate(text)
    if where is not None:
        raise ChatTemplateError(f"chat template output is not valid Unicode: {where}")


def read_chat_template(model_dir: str | Path) -> str | None:
    """The chat template stored in `model_dir` (a model's: the operator's files), or None.

    Looks in TEMPLATE_FILES in order (the first present decides); a list of named templates
    yields the one named "default". ValueError names a file of the wrong shape. Adapters'
    files are read under stricter rules (server/adapter_templates.py)."""
    for name in TEMPLATE_FILES:
        path = Path(model_dir) / name
        if path.is_file():
            return template_in_file(name, path.read_text())
    return None


def template_in_file(name: str, text: str) -> str | None:
    """The chat template held by the text of `name` (one of TEMPLATE_FILES), or None.
    ValueError naming the file if its JSON or its chat_template has the wrong shape."""
    if name.endswith(".jinja"):
        return text
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{name} is not valid JSON") from exc
    template = data.get("chat_template") if isinstance(data, dict) else None
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = [t for t in template if isinstance(t, dict) and t.get("name") == "default"]
        template = named[-1].get("template") if named else None  # the last wins, as in a dict
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{name}: chat_template must be a string or a list of named templates")
    return template
