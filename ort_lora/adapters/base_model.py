"""Does an adapter name the base model it is served on? A warning, never a refusal.

PEFT records the model an adapter was trained on in adapter_config.json's
`base_model_name_or_path`: a Hub id ("HuggingFaceTB/SmolLM2-135M-Instruct") or the local
directory the base was loaded from. The export records where the served model came from
(`ModelManifest.source`: a checkpoint directory or a GGUF file). Shapes are checked strictly
elsewhere (host.py); this compares the names, which shapes cannot tell apart (two fine-tunes
of one architecture), and says so in the log when they differ.

Names are compared by their last path component, lower-cased, with punctuation, a file
extension and a GGUF quantization suffix (".Q4_1", "-q8_0", "-f16") removed:
"HuggingFaceTB/SmolLM2-135M-Instruct" and ".../SmolLM2-135M-Instruct.Q4_1.gguf" agree.
"""

from __future__ import annotations

import re

_QUANT_SUFFIX = re.compile(r"[.\-_](i?q\d[a-z0-9_]*|f16|f32|bf16)$")


def model_key(name: str) -> str:
    """The comparable form of a model name or path ("" when nothing is left)."""
    last = name.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1].lower()
    last = re.sub(r"\.(gguf|safetensors|bin|onnx)$", "", last)
    last = _QUANT_SUFFIX.sub("", last)
    return re.sub(r"[^a-z0-9]", "", last)


def base_model_mismatch(adapter_base: object, served_source: str) -> str | None:
    """A sentence saying the adapter names another base model than the one served, or None
    when they agree or either name is missing (nothing to compare)."""
    if not isinstance(adapter_base, str):
        return None
    wanted, served = model_key(adapter_base), model_key(served_source)
    if not wanted or not served or wanted == served:
        return None
    return (
        f"its adapter_config.json names base model {adapter_base!r}, but this server's model "
        f"was exported from {served_source.replace(chr(92), '/').rsplit('/', 1)[-1]!r}: "
        "its output may be wrong (served anyway; shapes match)"
    )
