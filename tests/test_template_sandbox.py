"""The chat-template sandbox's bounds (template_sandbox.py, chat_template.py): every operation
that could build a huge value is refused before it runs, with an error naming the bound, and
ordinary templates render as before."""

from __future__ import annotations

import pytest

from ort_lora.chat_template import ChatTemplateError, render_chat_template

MESSAGES = [{"role": "user", "content": "hi"}]
DOUBLING = "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s OP ns.s %}{% endfor %}{{ ns.s|length }}"  # noqa: E501

# a list of 1000 references to one 1M-char string: small in memory, 1G chars as text
SHARED = "{% set l = ['a' * 1000000] * 1000 %}"
# name -> (template, the bound its error names)
HOSTILE = {
    "repeat a str": ("{{ 'a' * 10**9 }}", "MAX_TEMPLATE_CHARS"),
    "repeat a list": ("{{ ([1] * 10**9)|length }}", "MAX_TEMPLATE_CHARS"),
    "repeat, int first": ("{{ (1000000000 * 'a')|length }}", "MAX_TEMPLATE_CHARS"),
    "huge power": ("{{ 7 ** 6000000 }}", "MAX_TEMPLATE_INT_BITS"),
    "power of a power": ("{{ 2 ** (2 ** 40) }}", "MAX_TEMPLATE_INT_BITS"),
    "squaring loop": ("{% set ns = namespace(n=3) %}{% for i in range(40) %}"
                      "{% set ns.n = ns.n * ns.n %}{% endfor %}", "MAX_TEMPLATE_INT_BITS"),
    "~ doubling": (DOUBLING.replace("OP", "~"), "MAX_TEMPLATE_CHARS"),
    "+ doubling": (DOUBLING.replace("OP", "+"), "MAX_TEMPLATE_CHARS"),
    "% width": ("{{ '%0999999999d' % 1 }}", "MAX_TEMPLATE_CHARS"),
    "format filter width": ("{{ '%999999999s'|format('a') }}", "MAX_TEMPLATE_CHARS"),
    "str.format width": ("{{ '{:>999999999}'.format('a') }}", "MAX_TEMPLATE_CHARS"),
    "str.format repeats": ("{{ ('{0}' * 1000).format('a' * 100000) }}", "MAX_TEMPLATE_CHARS"),
    "str.center": ("{{ 'a'.center(10**9) }}", "MAX_TEMPLATE_CHARS"),
    "center filter": ("{{ 'a'|center(10**9) }}", "MAX_TEMPLATE_CHARS"),
    "indent filter": ("{{ ('a\n' * 100000)|indent(100000) }}", "MAX_TEMPLATE_CHARS"),
    "replace filter": ("{{ ('a' * 1000000)|replace('a', 'aaaaaaaa') }}", "MAX_TEMPLATE_CHARS"),
    "str.replace": ("{{ ('a' * 1000000).replace('a', 'aaaaaaaa') }}", "MAX_TEMPLATE_CHARS"),
    "join filter": ("{{ (['a' * 1000000] * 8)|join }}", "MAX_TEMPLATE_CHARS"),
    "str.join": ("{{ ''.join(['a' * 1000000] * 8) }}", "MAX_TEMPLATE_CHARS"),
    "tojson indent": ("{{ [[[[[[1]]]]]]|tojson(indent=10**8) }}", "MAX_TEMPLATE_CHARS"),
    "batch fill": ("{{ [1]|batch(10**9, 0)|list|length }}", "MAX_TEMPLATE_CHARS"),
    "a shared string, output": (SHARED + "{{ l }}", "MAX_TEMPLATE_CHARS"),
    "a shared string, ~": (SHARED + "{{ 'x' ~ l }}", "MAX_TEMPLATE_CHARS"),
    "a shared string, string": (SHARED + "{{ l|string|length }}", "MAX_TEMPLATE_CHARS"),
    "a shared string, upper": (SHARED + "{{ l|upper|length }}", "MAX_TEMPLATE_CHARS"),
    "a shared string, join": (SHARED + "{{ l|join|length }}", "MAX_TEMPLATE_CHARS"),
    "a shared string, tojson": (SHARED + "{{ l|tojson|length }}", "MAX_TEMPLATE_CHARS"),
    "a shared string, %": (SHARED + "{{ ('%s' % (l,))|length }}", "MAX_TEMPLATE_CHARS"),
    "a shared string, format": (SHARED + "{{ '{}'.format(l)|length }}", "MAX_TEMPLATE_CHARS"),
    "a shared string, raise": (SHARED + "{{ raise_exception(l) }}", "MAX_TEMPLATE_CHARS"),
    "stringify in a loop": ("{% set l = ['a'] * 1300000 %}{% for i in range(1000) %}"
                            "{{ l|string|length }}{% endfor %}", "the template"),
    "lazy filter in a loop": ("{% set l = ['a'] * 4000000 %}{% for i in range(100) %}"
                              "{{ l|map('upper')|list|length }}{% endfor %}", "the template"),
    "captured by set": ("{% set big = 'a' * 1000000 %}{% set x %}{% for i in range(10000) %}"
                        "{{ big }}{% endfor %}{% endset %}{{ x|length }}", "MAX_TEMPLATE_CHARS"),
    "captured by filter": ("{% set big = 'a' * 1000000 %}{% filter upper %}"
                           "{% for i in range(10000) %}{{ big }}{% endfor %}{% endfilter %}",
                           "MAX_TEMPLATE_CHARS"),
    "macro body": ("{% set big = 'a' * 1000000 %}{% macro m() %}{% for i in range(10000) %}"
                   "{{ big }}{% endfor %}{% endmacro %}{{ m()|length }}", "MAX_TEMPLATE_CHARS"),
    "empty nested loops": ("{% for i in 'a' * 100000 %}{% for j in 'a' * 100000 %}"
                           "{% endfor %}{% endfor %}", "operations"),
}  # fmt: skip


@pytest.mark.parametrize("template, bound", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_template_refused_naming_the_bound(template, bound):
    with pytest.raises(ChatTemplateError, match="went past a bound") as caught:
        render_chat_template(template, MESSAGES, True, {})
    assert bound in str(caught.value)


def test_lone_surrogate_in_output_is_a_template_error():
    with pytest.raises(ChatTemplateError, match=r"not valid Unicode: a lone surrogate \(U\+D800\)"):
        render_chat_template("ok {{ '\\ud800' }}", MESSAGES, True, {})


def test_error_text_is_short_and_valid_unicode():
    with pytest.raises(ChatTemplateError) as caught:
        render_chat_template("{{ raise_exception('\\ud800' * 100000) }}", MESSAGES, True, {})
    message = str(caught.value)
    assert len(message) < 2000 and "\\ud800" in message
    message.encode("utf-8")  # a JSON body can carry it


def test_lipsum_and_urlize_are_not_offered():
    with pytest.raises(ChatTemplateError, match="lipsum"):
        render_chat_template("{{ lipsum(10**8) }}", MESSAGES, True, {})
    with pytest.raises(ChatTemplateError, match="urlize"):
        render_chat_template("{{ 'x'|urlize }}", MESSAGES, True, {})


ORDINARY = {
    "{% for m in messages %}{{ m.role ~ ': ' ~ m.content }}{% endfor %}": "user: hi",
    "{{ 'ab' * 2 }}{{ [1] + [2] }}{{ 2 ** 10 }}{{ 6 * 7 }}{{ 7 % 4 }}": "abab[1, 2]1024423",
    "{{ '%s-%03d'|format('a', 7) }} {{ '{}/{:>3}'.format(1, 'x') }}": "a-007 1/  x",
    "{{ 'x'|center(5) }}|{{ 'a\nb'|indent(2) }}|{{ 'aXa'|replace('X', 'yy') }}":
        "  x  |a\n  b|ayya",
    "{{ [1, 2, 3]|join(',') }} {{ ''.join(['p', 'q']) }} {{ [[1], [2]]|sum(start=[]) }}":
        "1,2,3 pq [1, 2]",
    "{{ {'a': [1]}|tojson(indent=2) }}": '{\n  "a": [\n    1\n  ]\n}',
    "{% for i in range(3) %}{{ loop.index }}/{{ loop.length }} {% endfor %}": "1/3 2/3 3/3 ",
    "{{ [1, 2, 3]|batch(2)|list }} {{ [1, 2, 3]|slice(2)|list }}": "[[1, 2], [3]] [[1, 2], [3]]",
    "{% set x %}a{{ 1 }}{% endset %}{% macro m(v) %}<{{ v }}>{% endmacro %}{{ x ~ m(2) }}":
        "a1<2>",
    "{{ ['a', 'b']|upper }} {{ {'k': 1} }} {{ 'x' ~ [1] }} {{ ['p']|string }}":
        "['A', 'B'] {'k': 1} x[1] ['p']",
}  # fmt: skip


@pytest.mark.parametrize("template, want", ORDINARY.items())
def test_ordinary_templates_render_as_before(template, want):
    assert render_chat_template(template, MESSAGES, True, {}) == want
