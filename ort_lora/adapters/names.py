"""What an adapter may be called and where it may live: its name (an API `model` field, a
metrics label, a log line) and its directory (inside the adapter root, symlinks followed).
Errors show what was given, never where a path resolves to nor the root (the server's
layout)."""

from __future__ import annotations

import re
from pathlib import Path

from ort_lora.adapters.errors import AdapterError, AdapterPathError
from ort_lora.adapters.host import WEIGHTS_NAME
from ort_lora.adapters.peft_config import CONFIG_NAME

# No spaces, quotes, newlines or "+" (reserved to compose adapters), at most 128 characters.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}")


def check_name(name: str) -> None:
    """AdapterError unless `name` is a valid adapter name (NAME_RE)."""
    if not NAME_RE.fullmatch(name):
        shown = name if len(name) <= 64 else name[:64] + "..."
        raise AdapterError(
            f"adapter name {shown!r} is not allowed: 1-128 characters, letters, digits and "
            "._:@/- only, starting with a letter or digit"
        )


def resolve_adapter_dir(path: str | Path, root: Path | None) -> Path:
    """The adapter directory, resolved (symlinks followed; a relative path is taken from
    `root` when given). With `root`, the directory and each file read from it must lie
    inside it (AdapterPathError); a path that cannot be resolved (a symlink loop, a NUL, a
    name too long) is an AdapterError. Errors show the path as given (cut to 200 characters)
    and the file's name in it, never where it resolves to nor the root."""
    shown = repr(str(path)[:200])
    try:
        where = Path(path).expanduser()
        if root is not None and not where.is_absolute():
            where = Path(root) / where
        resolved = where.resolve()
        files = {name: (resolved / name).resolve() for name in (CONFIG_NAME, WEIGHTS_NAME)}
    except (OSError, RuntimeError, ValueError) as e:
        why = unresolvable(e)
        raise AdapterError(f"adapter path {shown} cannot be resolved: {why}") from None
    if root is not None:
        root = Path(root).resolve()
        for name, p in [("", resolved), *files.items()]:
            if not p.is_relative_to(root):
                what = f"adapter path {shown}" + (f" (its {name})" if name else "")
                raise AdapterPathError(
                    f"{what} resolves outside the adapter root (symlinks are followed)"
                )
    return resolved


def unresolvable(e: Exception) -> str:
    """Why a path cannot be resolved, without the paths an OSError or RuntimeError names."""
    if isinstance(e, OSError):
        return e.strerror or type(e).__name__
    if isinstance(e, RuntimeError):
        return "a symlink loop"
    return "it holds a NUL character" if "null" in str(e) else "not a valid path"
