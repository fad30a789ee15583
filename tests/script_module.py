"""A program of the repository (bench/, examples/, a peer's child script) loaded as a module,
so that tests can call its functions without running its main."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: Path, name: str | None = None, argv: list[str] | None = None) -> ModuleType:
    """The module of the file at `path` (named `name`, default its stem); argv, if given, is
    sys.argv while it is imported (for programs that read options at import)."""
    spec = importlib.util.spec_from_file_location(name or Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    saved = sys.argv
    if argv is not None:
        sys.argv = [str(path), *argv]
    try:
        spec.loader.exec_module(module)
    finally:
        sys.argv = saved
    return module


def assert_usage_error(main, argv: list[str], says: str, capsys) -> None:
    """A program's main(argv) stops with argparse's usage error (exit status 2), its message
    naming `says` (the option at fault)."""
    import pytest

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err
