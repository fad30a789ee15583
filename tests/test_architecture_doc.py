"""docs/ARCHITECTURE.md names the code that does what it says, and that code exists.

Every code span of the page that names code is checked against the source, read with `ast`
(nothing is imported, so no optional dependency is needed and nothing runs):

  `engine/scheduler.py: Scheduler._cached_prefix, Scheduler._cache_blocks`
                        the file exists (from ort_lora/, else from the repository root) and
                        defines each name: a top-level def, class or assignment, or a
                        class's method, nested class, class attribute, dataclass field or
                        `self.x` attribute (inherited from a base class of the package too)
  `Scheduler._cached_prefix`
                        a class of that name in ort_lora/ has that member
  `StepPlan`            a capitalized name: a top-level def, class or assignment somewhere in
                        ort_lora/, or an operator of custom_ops/ (LoraSGMV)
  `custom_ops/lora_sgmv/lora_sgmv_op.h`, `engine/grammar.py`, `custom_ops/cuda/`
                        the file or directory exists

And every step of a walk (a table row numbered in its first cell) names at least one piece of
code, so the walks cannot drift back into prose nobody can check. The README's Layout names
every top-level module and package of ort_lora/.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"
PACKAGE = "ort_lora"

FENCE = re.compile(r"^```.*?^```", re.M | re.S)
SPAN = re.compile(r"`([^`\n]+)`")
IDENT = r"[A-Za-z_]\w*"
DOTTED = rf"{IDENT}(?:\.{IDENT})*"
# `path/to/file.py: Name, Class.method`
FILE_REF = re.compile(rf"^(?P<path>[\w./-]+\.py): (?P<names>{DOTTED}(?:, {DOTTED})*)$")
# `Class.member` (a capitalized first part: a class, not a module or a variable)
MEMBER_REF = re.compile(rf"^(?P<cls>[A-Z]\w*)\.(?P<member>{IDENT})$")
NAME_REF = re.compile(r"^[A-Z]\w*$")
# a relative path with a directory, or a bare source file name
PATH_REF = re.compile(r"^(?:(?:[\w.-]+/)+[\w.-]*|[\w-]+\.(?:py|h|cc|cu))$")
ROW = re.compile(r"^\|\s*\d+\s*\|")


# ---- the package, read with ast ------------------------------------------------------------


@dataclass
class Module:
    path: Path
    top: dict[str, ast.AST] = field(default_factory=dict)  # top-level defs and assignments


def _targets(node: ast.AST) -> list[str]:
    """Names an assignment statement binds (a = ..., a: T = ..., a, b = ...)."""
    if isinstance(node, ast.Assign):
        found = []
        for t in node.targets:
            found += [n.id for n in ast.walk(t) if isinstance(n, ast.Name)]
        return found
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def _top_level(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Top-level names of a module, looking into `if` and `try` blocks (not imports)."""
    out: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, (ast.If, ast.Try)):
            blocks = [node.body, node.orelse]
            blocks += [h.body for h in getattr(node, "handlers", [])]
            blocks += [getattr(node, "finalbody", [])]
            for block in blocks:
                out.update(_top_level(block))
        else:
            out.update(dict.fromkeys(_targets(node), node))
    return out


@cache
def module(path: Path) -> Module:
    tree = ast.parse(path.read_text(), filename=str(path))
    return Module(path, _top_level(tree.body))


@cache
def package_modules() -> tuple[Module, ...]:
    return tuple(module(p) for p in sorted((ROOT / PACKAGE).rglob("*.py")))


@cache
def classes() -> dict[str, list[ast.ClassDef]]:
    """Every top-level class of the package by name (a name may be defined more than once)."""
    out: dict[str, list[ast.ClassDef]] = {}
    for m in package_modules():
        for name, node in m.top.items():
            if isinstance(node, ast.ClassDef):
                out.setdefault(name, []).append(node)
    return out


def members(cls: ast.ClassDef, seen: frozenset[str] = frozenset()) -> dict[str, ast.AST]:
    """A class's members: methods, nested classes, class attributes and fields, attributes
    its methods set on self, and those of its base classes defined in the package."""
    out: dict[str, ast.AST] = {}
    for base in cls.bases:
        name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
        if name and name not in seen:
            for parent in classes().get(name, []):
                out.update(members(parent, seen | {cls.name}))
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        else:
            out.update(dict.fromkeys(_targets(node), node))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):  # self.x = ..., self.x: T = ..., self.a, self.b = ...
                if isinstance(sub, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                    targets = getattr(sub, "targets", None) or [sub.target]
                    for t in (n for target in targets for n in ast.walk(target)):
                        if isinstance(t, ast.Attribute) and getattr(t.value, "id", "") == "self":
                            out.setdefault(t.attr, sub)
    return out


@cache
def operator_sources() -> str:
    """The C++ operator library's text (where LoraSGMV, PagedAttention, ... are defined)."""
    files = sorted((ROOT / "custom_ops").rglob("*"))
    return "\n".join(p.read_text() for p in files if p.suffix in (".h", ".cc", ".cu"))


# ---- resolving the references ------------------------------------------------------------


def resolve_path(text: str) -> tuple[Path | None, str | None]:
    """(the file a doc path names, None) or (None, why not): from ort_lora/, else from the
    repository root; a path both resolve is ambiguous."""
    found = [p for p in (ROOT / PACKAGE / text, ROOT / text) if p.exists()]
    if not found:
        return None, f"no file or directory {text} (in {PACKAGE}/ or the repository root)"
    if len(found) > 1 and found[0].resolve() != found[1].resolve():
        return None, f"{text} is ambiguous: it is in {PACKAGE}/ and at the repository root"
    return found[0], None


def check_in_module(path: Path, dotted: str) -> str | None:
    """Why `dotted` (Name or Class.member...) is not defined in the module, or None."""
    first, *rest = dotted.split(".")
    node = module(path).top.get(first)
    if node is None:
        return f"{path.relative_to(ROOT)} defines no {first}"
    for i, part in enumerate(rest):
        if not isinstance(node, ast.ClassDef):
            owner = ".".join([first, *rest[:i]])
            return f"{owner} is not a class, so it has no {part}"
        found = members(node).get(part)
        if found is None:
            return f"class {node.name} ({path.relative_to(ROOT)}) has no {part}"
        node = found
    return None


def problem(span: str) -> str | None:
    """Why the code span names code that does not exist; None if it exists, or if the span
    names no code (a field, a value, a formula)."""
    m = FILE_REF.match(span)
    if m:
        path, why = resolve_path(m["path"])
        if path is None:
            return why
        errors = [check_in_module(path, name) for name in m["names"].split(", ")]
        return "; ".join(e for e in errors if e) or None
    m = MEMBER_REF.match(span)
    if m:
        defs = classes().get(m["cls"])
        if not defs:
            return f"no class {m['cls']} in {PACKAGE}/"
        if not any(m["member"] in members(c) for c in defs):
            return f"class {m['cls']} has no {m['member']}"
        return None
    if NAME_REF.match(span):
        if any(span in m.top for m in package_modules()):
            return None
        if re.search(rf"\b{span}\b", operator_sources()):
            return None
        return f"{span} is defined neither in {PACKAGE}/ nor in custom_ops/"
    if PATH_REF.match(span):
        return resolve_path(span)[1]
    return None


def spans(text: str) -> list[tuple[int, str]]:
    """(line number, code span) of every code span outside fenced blocks."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return [(i, s) for i, line in enumerate(text.splitlines(), 1) for s in SPAN.findall(line)]


def is_code_ref(span: str) -> bool:
    return bool(FILE_REF.match(span) or MEMBER_REF.match(span))


def stale_references(text: str) -> list[str]:
    """Code spans naming code that is gone, and spans broken over two lines (unchecked)."""
    out = [f"line {i}: `{s}`: {why}" for i, s in spans(text) if (why := problem(s))]
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for i, line in enumerate(text.splitlines(), 1):
        if line.count("`") % 2:
            out.append(f"line {i}: a code span runs over the line's end; keep it on one line")
    return sorted(out, key=lambda s: int(s.split(":")[0].split()[1]))


def rows_without_code(text: str) -> list[str]:
    """Walk steps (table rows numbered in their first cell) that name no function, class or
    method (a `file.py: Name` or `Class.member` span)."""
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if ROW.match(line) and not any(is_code_ref(s) for s in SPAN.findall(line)):
            out.append(f"line {i}: {line[:80]}")
    return out


# ---- the tests ---------------------------------------------------------------------------


def test_every_code_reference_exists():
    stale = stale_references(DOC.read_text())
    assert not stale, "docs/ARCHITECTURE.md names code that is gone:\n" + "\n".join(stale)


def test_every_step_names_its_code():
    text = DOC.read_text()
    bare = rows_without_code(text)
    assert not bare, "walk steps that name no code:\n" + "\n".join(bare)
    refs = [s for _, s in spans(text) if is_code_ref(s)]
    assert len(refs) >= 100, f"only {len(refs)} references to functions, classes or methods"


def test_the_check_catches_what_is_gone(monkeypatch, tmp_path):
    """A missing file, module-level name, method, class and operator are each reported by
    name; existing ones, and spans that name no code, are not."""
    root = tmp_path / "repo"
    (root / PACKAGE / "engine").mkdir(parents=True)
    (root / "custom_ops").mkdir()
    (root / "custom_ops" / "ops.cc").write_text('Op("LoraSGMV");\n')
    (root / PACKAGE / "engine" / "plan.py").write_text(
        "LIMIT = 3\n\n"
        "class Base:\n    def shared(self): ...\n\n"
        "class Plan(Base):\n"
        "    size: int = 0\n"
        "    def __init__(self):\n        self.rows = []\n"
        "    @property\n    def segments(self): ...\n\n"
        "def make_plan(): ...\n"
    )
    for fn in (module, package_modules, classes, operator_sources):
        fn.cache_clear()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", root)
    try:
        text = (
            "| 1 | `engine/plan.py: make_plan, Plan.segments, Plan.rows, LIMIT` |\n"
            "`Plan.size` `Plan.shared` `Plan` `LoraSGMV` `engine/plan.py` `custom_ops/`\n"
            '`max_loras` `scale * (x @ A^T)` `POST /v1/completions` `"<id>#<i>"`\n'
            "| 2 | `engine/plan.py: make_plans` `engine/plan.py: Plan.nope` |\n"
            "`engine/gone.py: f` `Plan.gone` `Gone.x` `GoneOp` `custom_ops/gone.h`\n"
            "`engine/plan.py: LIMIT.x`\n"
            "| 3 | prose only, `max_loras` |\n"
            "a span `engine/plan.py:\nmake_plan` over two lines\n"
        )
        assert stale_references(text) == [
            "line 4: `engine/plan.py: make_plans`: ort_lora/engine/plan.py defines no make_plans",
            "line 4: `engine/plan.py: Plan.nope`: class Plan (ort_lora/engine/plan.py) has no nope",
            "line 5: `engine/gone.py: f`: no file or directory engine/gone.py (in ort_lora/ or "
            "the repository root)",
            "line 5: `Plan.gone`: class Plan has no gone",
            "line 5: `Gone.x`: no class Gone in ort_lora/",
            "line 5: `GoneOp`: GoneOp is defined neither in ort_lora/ nor in custom_ops/",
            "line 5: `custom_ops/gone.h`: no file or directory custom_ops/gone.h (in ort_lora/ "
            "or the repository root)",
            "line 6: `engine/plan.py: LIMIT.x`: LIMIT is not a class, so it has no x",
            "line 8: a code span runs over the line's end; keep it on one line",
            "line 9: a code span runs over the line's end; keep it on one line",
        ]
        assert rows_without_code(text) == ["line 7: | 3 | prose only, `max_loras` |"]
    finally:
        for fn in (module, package_modules, classes, operator_sources):
            fn.cache_clear()


def unlisted_modules(readme: str) -> list[str]:
    """Top-level modules and packages of ort_lora/ that the README's Layout section does not
    name in a code span (`timing.py`, `engine/`)."""
    layout = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    named = set(SPAN.findall(layout))
    entries = [
        p.name + ("/" if p.is_dir() else "")
        for p in sorted((ROOT / PACKAGE).iterdir())
        if p.suffix == ".py" or (p / "__init__.py").exists()
    ]
    return [e for e in entries if e not in named]


def test_readme_layout_lists_every_module_of_the_package():
    readme = (ROOT / "README.md").read_text()
    assert unlisted_modules(readme) == []
    cut = readme.replace("`timing.py`", "timing").replace("`engine/`", "the engine")
    assert unlisted_modules(cut) == ["engine/", "timing.py"]
