"""Chat templates: where a model (or an adapter) keeps its template, and rendering it.

Templates render in a sandboxed jinja2 environment configured the way transformers does
(trim_blocks, lstrip_blocks, loopcontrols, `raise_exception`, `strftime_now`, a `tojson` that
does not escape HTML, `{% generation %}` blocks), so rendered prompts match it exactly.

A template may come from a request (the server allows that only with
--trust-request-chat-template), so every render is bounded: at most MAX_TEMPLATE_OPS
operations (attribute and item lookups, calls, `range` items), MAX_TEMPLATE_SECONDS of time
and MAX_TEMPLATE_CHARS of output. Past a bound, or on any template error, the render stops
with a ChatTemplateError that says which.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

CONFIG_FILE = "tokenizer_config.json"
MAX_TEMPLATE_OPS = 1_000_000
MAX_TEMPLATE_SECONDS = 2.0
MAX_TEMPLATE_CHARS = 4_000_000


class ChatTemplateError(ValueError):
    """The chat template is missing, rejected the messages (its `raise_exception`), failed,
    or went past a bound of the render."""


class _Budget(threading.local):
    """What the render on this thread may still do (renders run on worker threads)."""

    ops = -1  # < 0: no render under way
    deadline = 0.0

    def tick(self) -> None:
        if self.ops < 0:
            return
        self.ops -= 1
        if self.ops == 0:
            raise jinja2.exceptions.SecurityError(
                f"the template made over {MAX_TEMPLATE_OPS} operations"
            )
        if self.ops % 4096 == 0 and time.monotonic() > self.deadline:
            raise jinja2.exceptions.SecurityError(f"the template ran over {MAX_TEMPLATE_SECONDS} s")


_budget = _Budget()


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with every attribute / item lookup and call counted against the budget
    (the positional-only names keep templates' own keyword arguments out of the way)."""

    def getattr(self, obj, attribute, /):
        _budget.tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument, /):
        _budget.tick()
        return super().getitem(obj, argument)

    def call(self, context, obj, /, *args, **kwargs):
        _budget.tick()
        return super().call(context, obj, *args, **kwargs)


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


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _range(*args):
    """The sandbox's range, each item counted."""
    for i in jinja2.sandbox.safe_range(*args):
        _budget.tick()
        yield i


@lru_cache(maxsize=32)
def _compile_template(source: str) -> jinja2.Template:
    env = _BoundedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["range"] = _range
    return env.from_string(source)


def render_chat_template(
    source: str, messages: list[dict], add_generation_prompt: bool, context: dict
) -> str:
    """The prompt text; ChatTemplateError on a template error or past a bound."""
    try:
        template = _compile_template(source)
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
    _budget.ops, _budget.deadline = MAX_TEMPLATE_OPS, time.monotonic() + MAX_TEMPLATE_SECONDS
    parts, size = [], 0
    try:
        stream = template.generate(
            messages=messages, add_generation_prompt=add_generation_prompt, **context
        )
        for part in stream:
            parts.append(part)
            size += len(part)
            if size > MAX_TEMPLATE_CHARS:
                raise ChatTemplateError(f"chat template output exceeds {MAX_TEMPLATE_CHARS} chars")
            _budget.tick()  # time is checked between output parts too
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template rejected the messages: {exc}") from exc
    except (TypeError, ValueError, ArithmeticError, LookupError, RecursionError) as exc:
        if isinstance(exc, ChatTemplateError):
            raise
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}") from exc
    finally:
        _budget.ops = -1
    return "".join(parts)


def read_chat_template(model_dir: str | Path) -> str | None:
    """The chat template stored in `model_dir` (also used for adapter dirs), or None.

    Looks in chat_template.jinja, chat_template.json, then tokenizer_config.json; a dict of
    named templates yields the one named "default"."""
    model_dir = Path(model_dir)
    if (model_dir / "chat_template.jinja").is_file():
        return (model_dir / "chat_template.jinja").read_text()
    template = None
    if (model_dir / "chat_template.json").is_file():
        template = json.loads((model_dir / "chat_template.json").read_text()).get("chat_template")
    elif (model_dir / CONFIG_FILE).is_file():
        template = json.loads((model_dir / CONFIG_FILE).read_text()).get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template
