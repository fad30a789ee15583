"""Reading an adapter's own chat template (server/adapter_templates.py): files resolve inside
the boundary, are regular and size-capped; the per-adapter cache is bounded and forgets."""

from __future__ import annotations

import json
import os

import pytest

from ort_lora.adapters.errors import AdapterError, AdapterPathError
from ort_lora.lora_request import LoRARequest
from ort_lora.server.adapter_templates import (
    MAX_CONFIG_FILE_BYTES,
    MAX_TEMPLATE_FILE_BYTES,
    AdapterTemplates,
    TemplateContentError,
    check_adapter_template_files,
    read_adapter_template,
)

SECRET = "SECRET-LINE-{{ 1 }}"
FILES = {  # file name -> its text holding `template`
    "chat_template.jinja": lambda template: template,
    "chat_template.json": lambda template: json.dumps({"chat_template": template}),
    "tokenizer_config.json": lambda template: json.dumps({"chat_template": template}),
}


@pytest.fixture
def layout(tmp_path):
    """(root, adapter dir under it, a directory outside the root holding the secret files)."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    adapter = root / "a"
    adapter.mkdir(parents=True)
    outside.mkdir()
    for name, text in FILES.items():
        (outside / name).write_text(text(SECRET))
    return root, adapter, outside


@pytest.mark.parametrize("name", FILES)
def test_template_file_linked_outside_the_root_is_refused(layout, name):
    root, adapter, outside = layout
    os.symlink(outside / name, adapter / name)
    with pytest.raises(AdapterPathError, match=f"{name} resolves outside the adapter root") as e:
        read_adapter_template(adapter, root)
    assert "SECRET" not in str(e.value) and str(outside) not in str(e.value)


@pytest.mark.parametrize("name", FILES)
def test_template_file_read_inside_the_root(layout, name):
    root, adapter, _ = layout
    (root / name).write_text(FILES[name]("shared {{ 1 }}"))
    os.symlink(root / name, adapter / name)  # elsewhere inside the root: allowed
    assert read_adapter_template(adapter, root) == "shared {{ 1 }}"
    with pytest.raises(AdapterPathError, match="outside the adapter's directory"):
        read_adapter_template(adapter)  # without a root: the adapter's own directory only


def test_dangling_link_is_refused_not_skipped(layout):
    root, adapter, outside = layout
    (adapter / "tokenizer_config.json").write_text(FILES["tokenizer_config.json"]("own"))
    os.symlink(outside / "missing", adapter / "chat_template.jinja")
    with pytest.raises(AdapterPathError):
        read_adapter_template(adapter, root)


@pytest.mark.parametrize(
    "name, cap", [("chat_template.jinja", MAX_TEMPLATE_FILE_BYTES),
                  ("tokenizer_config.json", MAX_CONFIG_FILE_BYTES)],
)  # fmt: skip
def test_oversized_template_file_is_refused_unread(layout, name, cap):
    root, adapter, _ = layout
    with open(adapter / name, "wb") as f:
        f.truncate(256 << 20)  # sparse: reading it whole would take 256 MiB
    with pytest.raises(AdapterError, match=f"{name} is larger than its limit of {cap} bytes"):
        read_adapter_template(adapter, root)


def test_a_fifo_is_refused_without_blocking(layout):
    root, adapter, _ = layout
    os.mkfifo(adapter / "chat_template.jinja")
    with pytest.raises(AdapterError, match="chat_template.jinja is not a regular file"):
        read_adapter_template(adapter, root)


@pytest.mark.parametrize(
    "name, text, needle",
    [("chat_template.jinja", b"\xff\xfe", "not UTF-8"),
     ("tokenizer_config.json", b"[" * 100_000, "not valid JSON"),
     ("chat_template.json", b'{"chat_template": 3}', "must be a string")],
)  # fmt: skip
def test_template_file_without_a_usable_template(layout, name, text, needle):
    """Named as such; the load lets it through (the model's template will serve)."""
    root, adapter, _ = layout
    (adapter / name).write_bytes(text)
    with pytest.raises(TemplateContentError, match=needle):
        read_adapter_template(adapter, root)
    check_adapter_template_files(adapter, root)


def test_named_templates_and_none(layout):
    root, adapter, _ = layout
    assert read_adapter_template(adapter, root) is None
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (adapter / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert read_adapter_template(adapter, root) == "D"


def test_cache_is_bounded_and_forgets_an_unloaded_adapter(tmp_path):
    loras = []
    for i in range(4):
        (tmp_path / f"a{i}").mkdir()
        (tmp_path / f"a{i}" / "chat_template.jinja").write_text(f"T{i}")
        loras.append(LoRARequest(f"a{i}", i + 1, str(tmp_path / f"a{i}")))
    cache = AdapterTemplates(tmp_path, max_entries=2)
    assert [cache.get(lora) for lora in loras] == ["T0", "T1", "T2", "T3"]
    assert len(cache) == 2
    (tmp_path / "a3" / "chat_template.jinja").write_text("changed")
    assert cache.get(loras[3]) == "T3"  # cached
    cache.forget("a3")
    assert len(cache) == 1 and cache.get(loras[3]) == "changed"


def test_cache_ignores_a_hostile_file_with_a_warning(layout, caplog):
    root, adapter, outside = layout
    os.symlink(outside / "chat_template.jinja", adapter / "chat_template.jinja")
    cache = AdapterTemplates(root)
    assert cache.get(LoRARequest("a", 1, str(adapter))) is None
    assert "ignoring its chat template" in caplog.text and "SECRET" not in caplog.text
