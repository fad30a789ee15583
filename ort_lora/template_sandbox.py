"""The jinja2 sandbox chat templates render in, bounded in work, time and size.

jinja2's immutable sandbox keeps a template away from Python internals; this one also counts
every operation against a per-render budget and checks, before it runs, every operation that
could build a large value (a template may come from a request; template_bounds.py):

  MAX_TEMPLATE_OPS       attribute / item lookups, calls, operators, items of `range`, `for`
                         and lazy filters (map, select, ...), items walked by the size checks
  MAX_TEMPLATE_SECONDS   checked at every operation; no single operation runs long, as the
                         size checks keep every value small
  MAX_TEMPLATE_CHARS     the length of any string or list an operation would build: `*`, `+`,
                         `~`, `%` and str.format (from their widths), the str methods center,
                         ljust, rjust, zfill, expandtabs, replace, join, format(_map), the
                         filters center, indent, replace, join, format, wordwrap, batch, slice,
                         sum, tojson, pprint; and the text of any value turned into a string
                         (output, `~`, formatting, the filters that take text), which for a
                         list sharing one long string many times is far larger than the list;
                         and what a block, a macro or `{% set %}` captures
  MAX_TEMPLATE_INT_BITS  the size of an integer `*` or `**` would make

jinja2's `urlize` filter and `lipsum` global are not offered. Past a bound the render stops
with a jinja2 SecurityError that names the bound.
"""

from __future__ import annotations

import functools
import itertools
import json
from pprint import pformat

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.filters import (
    do_batch,
    do_format,
    do_indent,
    do_replace,
    do_wordwrap,
    make_attrgetter,
    sync_do_slice,
)
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range
from jinja2.utils import pass_environment, pass_eval_context

from ort_lora.template_bounds import (
    CONTAINERS,
    SEQUENCES,
    budget,
    check_binop,
    check_size,
    check_str_call,
    printf_size,
    replace_size,
    text_size,
    width,
)

# jinja2's filters that turn their input into text (the bounded ones below do it themselves)
TEXT_FILTERS = ("string", "e", "escape", "forceescape", "safe", "trim", "upper", "lower",
                "title", "capitalize", "striptags", "wordcount", "truncate", "urlencode",
                "xmlattr")  # fmt: skip
# jinja2's filters that yield items lazily: each item is counted as an operation
COUNTED_FILTERS = ("map", "select", "reject", "selectattr", "rejectattr")


# -- filters ---------------------------------------------------------------------------------


def text_of(value, what: str) -> str:
    """str(value), if its text is within MAX_TEMPLATE_CHARS (checked first for containers)."""
    if isinstance(value, CONTAINERS):
        check_size(text_size(value), what)
    return str(value)


def _center(value, size=80):
    s = text_of(value, "the center filter")
    check_size(max(len(s), width(size)), "the center filter")
    return s.center(size)


def _indent(s, size=4, first=False, blank=False):
    text = text_of(s, "the indent filter")
    check_size(len(text) + (text.count("\n") + 1) * width(size), "the indent filter")
    return do_indent(text, size, first, blank)


@pass_eval_context
def _replace(eval_ctx, s, old, new, count=None):
    text = text_of(s, "the replace filter")
    size = replace_size(text, str(old), str(new), -1 if count is None else count)
    check_size(size, "the replace filter")
    return do_replace(eval_ctx, text, old, new, count)


@pass_eval_context
def _join(eval_ctx, value, d="", attribute=None):
    if attribute is not None:
        value = map(make_attrgetter(eval_ctx.environment, attribute), value)
    items, size, d = [], 0, str(d)
    for x in value:
        size += text_size(x) + len(d)
        check_size(size, "the join filter")
        items.append(str(x))
    return d.join(items)


def _format(value, *args, **kwargs):
    text = text_of(value, "the format filter")
    check_size(printf_size(text, kwargs or args), "the format filter")
    return do_format(text, *args, **kwargs)


@pass_environment
def _wordwrap(environment, s, width=79, break_long_words=True, wrapstring=None,
              break_on_hyphens=True):  # fmt: skip
    separator = environment.newline_sequence if wrapstring is None else str(wrapstring)
    s = text_of(s, "the wordwrap filter")
    check_size(len(s) * (1 + len(separator)), "the wordwrap filter")
    return do_wordwrap(environment, s, width, break_long_words, wrapstring,
                               break_on_hyphens)  # fmt: skip


def _batch(value, linecount, fill_with=None):
    check_size(width(linecount), "the batch filter")
    return do_batch(value, linecount, fill_with)


def _slice(value, slices, fill_with=None):
    check_size(width(slices), "the slice filter")
    return sync_do_slice(value, slices, fill_with)


@pass_environment
def _sum(environment, iterable, attribute=None, start=0):
    if attribute is not None:
        iterable = map(make_attrgetter(environment, attribute), iterable)
    items = list(iterable)
    if not isinstance(start, SEQUENCES):
        return sum(items, start)
    # sequences are added in one pass (the builtin copies the sum once per item)
    if any(type(x) is not type(start) for x in items):
        raise TypeError(f"the sum filter adds {type(start).__name__}s only")
    check_size(len(start) + sum(map(len, items)), "the sum filter")
    return type(start)(itertools.chain(start, *items))


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    check_size(text_size(x, indent, separators, bool(ensure_ascii)), "the tojson filter")
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _pprint(value):
    check_size(text_size(value, 1) * 2, "the pprint filter")
    return pformat(value)


def _text_filter(name: str, f):
    """jinja2's filter `f`, its input's text checked first."""
    at = 1 if hasattr(f, "jinja_pass_arg") else 0  # after the context / environment it takes

    @functools.wraps(f)
    def bounded(*args, **kwargs):
        if len(args) > at:
            text_of(args[at], f"the {name} filter")
        return f(*args, **kwargs)

    return bounded


def _counted_filter(f):
    """jinja2's filter `f` (map, select, ...), each item of its result counted."""

    @functools.wraps(f)
    def counted(*args, **kwargs):
        return _counted(f(*args, **kwargs))

    return counted


def _finalize(value):
    """Every `{{ value }}` goes through here before it is made text."""
    if isinstance(value, CONTAINERS):
        check_size(text_size(value), "the output of a value")
    return value


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(text_of(message, "raise_exception"))


def _counted(iterable):
    """A `for` loop's items, each counted (a loop with an empty body costs time too)."""
    for item in iterable:
        budget.tick()
        yield item


def _range(*args):
    """The sandbox's range, each item counted."""
    return _counted(safe_range(*args))


BOUNDED_FILTERS = {
    "center": _center, "indent": _indent, "replace": _replace, "join": _join,
    "format": _format, "wordwrap": _wordwrap, "batch": _batch, "slice": _slice, "sum": _sum,
    "tojson": _tojson, "pprint": _pprint, "_counted": _counted,
}  # fmt: skip


# -- the environment -----------------------------------------------------------------------


class _CodeGenerator(CodeGenerator):
    """Compiles `~` to a checked join, and counts each item of a `for` loop."""

    def visit_Template(self, node, frame=None):
        for loop in node.find_all(nodes.For):
            loop.iter = nodes.Filter(loop.iter, "_counted", [], [], None, None, lineno=loop.lineno)
        super().visit_Template(node, frame)

    def visit_Concat(self, node, frame):
        self.write("environment.concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with every attribute / item lookup, call and operator counted against the
    budget and checked against the size bounds (the positional-only names keep templates'
    own keyword arguments out of the way)."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **options):
        super().__init__(finalize=_finalize, **options)
        for name in TEXT_FILTERS:
            self.filters[name] = _text_filter(name, self.filters[name])
        for name in COUNTED_FILTERS:
            self.filters[name] = _counted_filter(self.filters[name])
        self.filters.update(BOUNDED_FILTERS)
        del self.filters["urlize"], self.globals["lipsum"]
        self.globals["range"] = _range
        self.globals["raise_exception"] = _raise_exception

    def getattr(self, obj, attribute, /):
        budget.tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument, /):
        budget.tick()
        return super().getitem(obj, argument)

    def call(self, context, obj, /, *args, **kwargs):
        budget.tick()
        args = check_str_call(obj, args, kwargs)
        result = super().call(context, obj, *args, **kwargs)
        if isinstance(result, SEQUENCES):
            check_size(len(result), "a call")
        return result

    def call_binop(self, context, operator, left, right, /):
        budget.tick()
        check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def concat(self, parts) -> str:
        """The parts as strings, joined, if the result is within bounds: `a ~ b ~ ...`, and
        (jinja2's own use of `environment.concat`) what a block, a macro or `{% set %}`
        captures."""
        budget.tick()
        parts = list(parts)
        check_size(sum(text_size(p) for p in parts), "'~' or a captured block")
        return "".join(map(str, parts))


def new_environment(**options) -> jinja2.Environment:
    """A BoundedEnvironment with jinja2's `options`."""
    return BoundedEnvironment(**options)
