"""An adapter's own chat template: read from its directory under rules a hostile adapter
cannot get round, and cached per adapter (bounded, dropped on unload).

An adapter may carry a template as a model does (chat_template.TEMPLATE_FILES: the first
present decides). Each such file must
  - resolve (symlinks followed, as adapters/registry.py resolves the adapter's other files)
    inside the boundary: the adapter root for an adapter that lies in it, else the adapter's
    own directory (adapters from --lora-modules: trusted, but not their neighbours' files)
  - be a regular file of at most MAX_TEMPLATE_FILE_BYTES (1 MiB; tokenizer_config.json:
    MAX_CONFIG_FILE_BYTES, 4 MiB, as its added_tokens_decoder can be large); no more than
    that is ever read
  - hold a template: UTF-8, and JSON of the expected shape for the .json files.
At load (/v1/load_lora_adapter) a file that breaks one of the first two rules refuses the
adapter: 403 (AdapterPathError) outside the boundary, else 400 (AdapterError), naming the
file and the rule, never its contents or its resolved path. A file that breaks the last one
(TemplateContentError), or any rule when read later (first use, after a cache eviction: the
files may have changed since the load), leaves the adapter with the model's template and a
warning in the log, as an unreadable template file always has.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
from collections import OrderedDict
from pathlib import Path

from ort_lora.adapters.errors import AdapterError, AdapterPathError
from ort_lora.adapters.registry import resolve_adapter_dir
from ort_lora.chat_template import CONFIG_FILE, TEMPLATE_FILES, template_in_file
from ort_lora.lora_request import LoRARequest

MAX_TEMPLATE_FILE_BYTES = 1 << 20
MAX_CONFIG_FILE_BYTES = 4 << 20
MAX_CACHED_TEMPLATES = 64
logger = logging.getLogger("ort_lora.server")


class TemplateContentError(AdapterError):
    """An adapter's template file is where it may be, but holds no usable template."""


def check_adapter_template_files(adapter_dir: str | Path, root: str | Path | None) -> None:
    """At load: AdapterPathError / AdapterError if a template file is outside the boundary,
    not a regular file or too large; a file without a usable template is let through."""
    with contextlib.suppress(TemplateContentError):  # the model's template will serve
        read_adapter_template(adapter_dir, root)


def read_adapter_template(adapter_dir: str | Path, root: str | Path | None = None) -> str | None:
    """The chat template an adapter's directory holds, or None; read under the rules above
    (AdapterPathError: a file resolves outside the boundary; TemplateContentError: it holds
    no usable template; AdapterError: any other rule).
    root: the adapter root, if the server has one."""
    directory = resolve_adapter_dir(adapter_dir, None)
    boundary, where = directory, "the adapter's directory"
    if root is not None and directory.is_relative_to(Path(root).resolve()):
        boundary, where = Path(root).resolve(), "the adapter root"
    for name in TEMPLATE_FILES:
        if os.path.lexists(directory / name):  # a dangling or hostile symlink counts too
            text = _read_bounded(directory / name, boundary, where)
            try:
                return template_in_file(name, text)
            except ValueError as exc:
                raise TemplateContentError(f"adapter file {exc}") from None
    return None


def _read_bounded(path: Path, boundary: Path, where: str) -> str:
    """The text of `path` if it resolves inside `boundary` (described by `where`), is a
    regular file and is within its size cap (opened once, checked through its descriptor)."""
    name, cap = path.name, _cap(path.name)
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError) as exc:
        raise AdapterError(
            f"adapter file {name} cannot be resolved: {type(exc).__name__}"
        ) from None
    if not resolved.is_relative_to(boundary):
        raise AdapterPathError(
            f"adapter file {name} resolves outside {where}: an adapter's chat template files "
            "must lie inside it (symlinks are followed)"
        )
    try:
        fd = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise AdapterError(f"adapter file {name} cannot be opened: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise AdapterError(f"adapter file {name} is not a regular file")
        data = f.read(cap + 1)
    if len(data) > cap:
        raise AdapterError(f"adapter file {name} is larger than its limit of {cap} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise TemplateContentError(f"adapter file {name} is not UTF-8 text") from None


def _cap(name: str) -> int:
    return MAX_CONFIG_FILE_BYTES if name == CONFIG_FILE else MAX_TEMPLATE_FILE_BYTES


class AdapterTemplates:
    """Adapters' own chat templates, read on first use, at most MAX_CACHED_TEMPLATES kept
    (least recently used dropped); `forget` drops an unloaded adapter's. Thread-safe (chat
    requests render on worker threads)."""

    def __init__(self, root: str | Path | None = None, max_entries: int = MAX_CACHED_TEMPLATES):
        self.root = root  # the server's adapter root, if it has one
        self.max_entries = max_entries
        self._cache: OrderedDict[tuple[str, str], str | None] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, lora: LoRARequest) -> str | None:
        """The adapter's own template (None: it has none, or a file breaks a rule)."""
        key = (lora.lora_name, lora.lora_path)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            template = read_adapter_template(lora.lora_path, self.root)
        except AdapterError as exc:  # the model's template serves
            logger.warning("adapter %s: ignoring its chat template: %s", lora.lora_name, exc)
            template = None
        with self._lock:
            self._cache[key] = template
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return template

    def forget(self, lora_name: str) -> None:
        """Drop the cached template of the adapter named `lora_name` (unloaded)."""
        with self._lock:
            for key in [k for k in self._cache if k[0] == lora_name]:
                del self._cache[key]

    def __len__(self) -> int:
        return len(self._cache)
