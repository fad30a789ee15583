"""The bounds of a chat template's render: its budget of operations and time, and how large
its values would get (the checks template_sandbox.py runs before an operation that could
build a large value).

Size estimates are upper bounds, computed without building the value: from lengths, counts
and the widths in format strings; containers are walked (without recursion) only as far as
the bound, their items charged to the budget as operations.
"""

from __future__ import annotations

import json
import math
import re
import string
import threading
import time

from jinja2.exceptions import SecurityError
from jinja2.utils import Namespace

MAX_TEMPLATE_OPS = 1_000_000
MAX_TEMPLATE_SECONDS = 2.0
MAX_TEMPLATE_CHARS = 4_000_000
MAX_TEMPLATE_INT_BITS = 1 << 16  # ~19,700 decimal digits: far more than any prompt needs
SEQUENCES = (str, list, tuple)
CONTAINERS = (list, tuple, dict, set, frozenset, Namespace)
_FORMAT_NUMBER = re.compile(r"\d+")
_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[#0 +\-]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?(.)", re.S)
_END = object()


class Budget(threading.local):
    """What the render on this thread may still do (renders run on worker threads)."""

    ops = -1  # < 0: no render under way
    deadline = 0.0

    def start(self) -> None:
        self.ops, self.deadline = MAX_TEMPLATE_OPS, time.monotonic() + MAX_TEMPLATE_SECONDS

    def stop(self) -> None:
        self.ops = -1

    def tick(self) -> None:
        if self.ops < 0:
            return
        self.ops -= 1
        if self.ops == 0:
            raise SecurityError(f"the template made over {MAX_TEMPLATE_OPS} operations")
        self._check_time()  # every time: one operation may be slow (sorting 4M items)

    def charge(self, ops: int) -> None:
        """`ops` operations' worth of work done inside one (a walk over a large value)."""
        if self.ops < 0:
            return
        self.ops = max(self.ops - ops, 1)
        self.tick()

    def _check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise SecurityError(f"the template ran over {MAX_TEMPLATE_SECONDS} s")


budget = Budget()


def check_size(size: int, what: str) -> None:
    """SecurityError if `what` would build more than MAX_TEMPLATE_CHARS chars or items."""
    if size > MAX_TEMPLATE_CHARS:
        raise SecurityError(
            f"{what} would build {size} chars or items; a chat template's values are at most "
            f"{MAX_TEMPLATE_CHARS} (MAX_TEMPLATE_CHARS)"
        )


def check_bits(bits: float, what: str) -> None:
    if bits > MAX_TEMPLATE_INT_BITS:
        raise SecurityError(
            f"{what} would make an integer of about {int(bits)} bits; a chat template's "
            f"integers are at most {MAX_TEMPLATE_INT_BITS} bits (MAX_TEMPLATE_INT_BITS)"
        )


def width(value) -> int:
    """A width argument's size (an int, or a str's length); 0 for anything else."""
    if isinstance(value, str):
        return len(value)
    return value if isinstance(value, int) else 0


# -- operators ---------------------------------------------------------------------------------


def check_binop(op: str, left, right) -> None:
    """Refuse an operator whose result would be past a bound (before it runs)."""
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, SEQUENCES) and isinstance(n, int):
                return check_size(len(seq) * n, "'*'")
        if isinstance(left, int) and isinstance(right, int):
            check_bits(abs(left).bit_length() + abs(right).bit_length(), "'*'")
    elif op == "**" and isinstance(left, int) and isinstance(right, int):
        if abs(left) > 1 and right > 0:
            check_bits(right * math.log2(abs(left)), "'**'")
    elif op == "+" and isinstance(left, SEQUENCES) and isinstance(right, SEQUENCES):
        check_size(len(left) + len(right), "'+'")
    elif op == "%" and isinstance(left, str):
        check_size(printf_size(left, right), "'%' formatting")


def printf_size(fmt: str, args) -> int:
    """An upper bound of the length of `fmt % args` (`*` widths are refused)."""
    values = (
        args.values() if isinstance(args, dict) else args if isinstance(args, tuple) else [args]
    )
    specs, widths = 0, 0
    for m in _PRINTF_SPEC.finditer(fmt):
        if "*" in (m.group(1), m.group(2)):
            raise SecurityError("'%' formatting with '*' widths is not allowed in chat templates")
        specs += 1
        widths += sum(_number(n) for n in m.group(1, 2) if n)
    return len(fmt) + widths + specs * _longest(values)


def format_size(fmt: str, args, kwargs) -> int:
    """An upper bound of the length of `fmt.format(*args, **kwargs)`."""
    fields, widths = 0, 0
    for _, field, spec, _ in string.Formatter().parse(fmt):
        if field is None:
            continue
        if spec and "{" in spec:
            raise SecurityError("nested format specs ('{:{w}}') are not allowed in chat templates")
        fields += 1
        widths += sum(_number(n) for n in _FORMAT_NUMBER.findall(spec or ""))
    return len(fmt) + widths + fields * _longest([*args, *kwargs.values()])


def _number(digits: str) -> int:
    return int(digits) if len(digits) <= 9 else MAX_TEMPLATE_CHARS + 1


def _longest(values) -> int:
    return max((text_size(v) for v in values), default=0)


# -- calls of str methods --------------------------------------------------------------------


def check_str_call(obj, args: tuple, kwargs: dict) -> tuple:
    """Refuse a str method call whose result would be past a bound; returns the args to call
    with (join's iterable read once, into a list)."""
    target = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
    s = getattr(target, "__self__", None)
    if not isinstance(s, str):
        return args
    name = getattr(target, "__name__", "")
    what = f"str.{name}"
    first = args[0] if args else None
    if name in ("center", "ljust", "rjust", "zfill"):
        check_size(max(len(s), width(first)), what)
    elif name == "expandtabs":
        check_size(len(s) + s.count("\t") * width(kwargs.get("tabsize", first or 8)), what)
    elif name == "replace" and len(args) >= 2:
        check_size(replace_size(s, args[0], args[1], args[2] if len(args) > 2 else -1), what)
    elif name == "join" and args:
        items = list(first)
        sizes = sum(len(x) for x in items if isinstance(x, str))
        check_size(sizes + len(s) * max(len(items) - 1, 0), what)
        return (items, *args[1:])
    elif name == "format":
        check_size(format_size(s, args, kwargs), what)
    elif name == "format_map" and args and isinstance(first, dict):
        check_size(format_size(s, (), first), what)
    return args


def replace_size(s: str, old, new, count=-1) -> int:
    """The length of `s.replace(old, new, count)` (0 for arguments replace would refuse)."""
    if not (isinstance(old, str) and isinstance(new, str)):
        return 0
    n = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(s) + n * (len(new) - len(old))


# -- text of values ----------------------------------------------------------------------------


def text_size(value, indent=None, separators=None, ensure_ascii=None) -> int:
    """An upper bound of the length of `str(value)` (ensure_ascii None), or of
    `json.dumps(value, ensure_ascii=..., indent=..., separators=...)`; counting stops once
    past MAX_TEMPLATE_CHARS. A container shares its items, so it can be small in memory
    and huge as text: this is what stands between it and str()."""
    pad = width(indent)
    sep = sum(map(len, separators)) if separators else 2
    total, steps, stack = 0, 0, [iter((value,))]
    while stack and total <= MAX_TEMPLATE_CHARS:
        steps += 1
        if steps % 1024 == 0:
            budget.charge(1024)
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
            continue
        total += sep + 1 + pad * len(stack)
        if isinstance(item, str):
            total += (
                len(item)
                if ensure_ascii is None
                else len(json.dumps(item, ensure_ascii=ensure_ascii))
            )
        elif isinstance(item, dict):
            stack.append(_pairs(item))
        elif isinstance(item, Namespace):
            stack.append(iter(vars(item).values()))
        elif isinstance(item, CONTAINERS):
            stack.append(iter(item))
        elif isinstance(item, int):
            total += item.bit_length() // 3 + 1
        else:
            total += 64  # floats, None, jinja's small objects (loop, cycler)
    return total


def _pairs(d: dict):
    for k, v in d.items():
        yield k
        yield v
