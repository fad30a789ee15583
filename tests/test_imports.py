"""The package's import graph: no cycles (module-level or inside functions), every module
imports alone, and the bookkeeping and serving layers keep their dependencies (DESIGN.md:
bookkeeping imports neither onnxruntime nor torch; serving never imports torch)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "ort_lora"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """ort_lora modules `name` imports anywhere in its file (function bodies included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{up}.{base}" if base else up
            found |= {f"{base}.{a.name}" for a in node.names} | {base}
    return {m for m in found if m in MODULES and m != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _graph() -> dict[str, set[str]]:
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    # A package's __init__ re-exporting its submodules is not a cycle with them.
    return {n: {m for m in deps if not n.startswith(m + ".")} for n, deps in graph.items()}


def _layer(name: str) -> str:
    """ort_lora.engine.scheduler -> ort_lora.engine; ort_lora.config stays itself."""
    return ".".join(name.split(".")[:2])


def test_no_import_cycle_between_modules():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_cycle_between_layers():
    """Packages (engine, runtime, adapters, server, export, ...) form a DAG too: e.g. the
    engine may use the runtime, but then nothing in the runtime may reach into the engine."""
    layers: dict[str, set[str]] = {}
    for name, deps in _graph().items():
        layers.setdefault(_layer(name), set()).update(_layer(d) for d in deps)
    layers = {n: deps - {n} for n, deps in layers.items()}
    cycle = _cycle(layers)
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle or [])


def test_each_module_imports_alone():
    """Each module imported with no other ort_lora module loaded (third-party ones stay
    cached, so this takes seconds): a cycle or a missing import fails here by name."""
    script = """
import importlib, sys, traceback
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "ort_lora" or m.startswith("ort_lora.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ": " + traceback.format_exc(limit=2))
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""
    done = subprocess.run(
        [sys.executable, "-c", script, *MODULES], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    "layer, forbidden",
    [
        (["ort_lora.engine", "ort_lora.adapters", "ort_lora.config"], ["onnxruntime", "torch"]),
        (["ort_lora.server", "ort_lora.runtime", "ort_lora.llm"], ["torch", "transformers"]),
    ],
)
def test_layers_keep_their_dependencies(layer, forbidden):
    """Importing and running a layer's modules loads none of the forbidden packages
    (modules are checked by import; the session imports onnxruntime only when built)."""
    names = [m for m in MODULES if any(m == p or m.startswith(p + ".") for p in layer)]
    script = (
        "import importlib, sys\n"
        f"for n in {names!r}: importlib.import_module(n)\n"
        f"print([m for m in {forbidden!r} if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"{layer} imports {done.stdout.strip()}"
