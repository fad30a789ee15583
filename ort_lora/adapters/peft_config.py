"""PEFT LoRA adapter_config.json: parsing, refusals, and PEFT's own matching and scaling rules.

Module keys are the base model's module names, as PEFT sees them, e.g.
"model.layers.3.self_attn.q_proj". Matching mirrors peft (0.17-0.21):
  target_modules     peft.tuners.tuners_utils.check_target_module_exists
  rank/alpha_pattern peft.utils.other.get_pattern_key (first key k with re.match(r"(.*\\.)?(k)$"))
  scaling            peft.tuners.lora.layer.LoraLayer.update_layer (alpha/r, rslora alpha/sqrt(r))
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ort_lora.adapters.errors import AdapterError

CONFIG_NAME = "adapter_config.json"
ALL_LINEAR = "all-linear"
LLAMA_LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# field -> (value that is fine, why the others are refused)
_REFUSED = {
    "use_dora": (False, "DoRA adapters are not supported"),
    "fan_in_fan_out": (False, "fan_in_fan_out (Conv1D weights) does not apply to Llama"),
    "lora_bias": (False, "LoRA bias terms are not supported"),
    "use_qalora": (False, "QALoRA is not supported"),
}
_MUST_BE_EMPTY = (
    "modules_to_save",
    "layer_replication",
    "target_parameters",
    "trainable_token_indices",
    "alora_invocation_tokens",
)


@dataclass
class PeftLoraConfig:
    """The parts of a PEFT LoraConfig that change the math, validated."""

    r: int
    lora_alpha: float
    target_modules: str | list[str]
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    use_rslora: bool = False
    layers_to_transform: list[int] | int | None = None
    layers_pattern: list[str] | str | None = None
    exclude_modules: list[str] | str | None = None

    def targets(self, key: str) -> bool:
        """Whether PEFT would put LoRA on the module named key."""
        if self._excluded(key):
            return False
        tm = self.target_modules
        if isinstance(tm, str):
            if tm.lower() == ALL_LINEAR:
                # + Phi-3's fused modules (adapters/fused.py maps them onto their parts)
                return key.rsplit(".", 1)[-1] in LLAMA_LINEAR_MODULES + ("qkv_proj", "gate_up_proj")
            return re.fullmatch(tm, key) is not None
        if key in tm:
            return True
        return any(key.endswith(f".{t}") for t in tm) and self._layer_selected(key)

    def rank(self, key: str) -> int:
        return int(self.rank_pattern.get(_pattern_key(self.rank_pattern, key), self.r))

    def alpha(self, key: str) -> float:
        return float(self.alpha_pattern.get(_pattern_key(self.alpha_pattern, key), self.lora_alpha))

    def scaling(self, key: str) -> float:
        r = self.rank(key)
        return self.alpha(key) / (math.sqrt(r) if self.use_rslora else r)

    def _excluded(self, key: str) -> bool:
        ex = self.exclude_modules
        if not ex:
            return False
        if isinstance(ex, str):
            return re.fullmatch(ex, key) is not None
        return key in ex or any(key.endswith(f".{e}") for e in ex)

    def _layer_selected(self, key: str) -> bool:
        idx = self.layers_to_transform
        if idx is None or (isinstance(idx, list) and not idx):
            return True
        m = None
        if not self.layers_pattern:
            m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
        else:
            pats = (
                [self.layers_pattern]
                if isinstance(self.layers_pattern, str)
                else self.layers_pattern
            )
            for p in pats:
                m = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", key)
                if m:
                    break
        if m is None:
            return False
        layer = int(m.group("idx"))
        return layer == idx if isinstance(idx, int) else layer in idx


def _pattern_key(patterns: dict, key: str) -> str:
    for k in patterns:
        if re.match(rf"(.*\.)?({k})$", key):
            return k
    return key


def read_config(adapter_dir: Path) -> PeftLoraConfig:
    """Parse and validate adapter_dir/adapter_config.json; AdapterError names the bad field."""
    path = adapter_dir / CONFIG_NAME
    if not path.is_file():
        raise AdapterError(f"{adapter_dir}: no {CONFIG_NAME} (not a PEFT adapter directory)")
    try:
        raw = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{path}: expected a JSON object")
    _refuse_unsupported(raw, path)
    return _build(raw, path)


def _refuse_unsupported(raw: dict, path: Path) -> None:
    peft_type = raw.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise AdapterError(
            f"{path}: peft_type is {peft_type!r}; only 'LORA' adapters are supported"
        )
    for name, (ok, why) in _REFUSED.items():
        if raw.get(name, ok) not in (ok, None):
            raise AdapterError(f"{path}: {name} is {raw[name]!r}: {why} (expected {ok})")
    for name in _MUST_BE_EMPTY:
        if raw.get(name):
            raise AdapterError(f"{path}: {name} is {raw[name]!r}; expected null or empty")
    if raw.get("bias", "none") != "none":
        raise AdapterError(f"{path}: bias is {raw['bias']!r}; only bias='none' is supported")


def _build(raw: dict, path: Path) -> PeftLoraConfig:
    r, alpha = raw.get("r", 8), raw.get("lora_alpha", 8)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise AdapterError(f"{path}: r must be an integer >= 1, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise AdapterError(f"{path}: lora_alpha must be a number, got {alpha!r}")
    tm = raw.get("target_modules")
    if not (isinstance(tm, str) or (isinstance(tm, list) and all(isinstance(t, str) for t in tm))):
        raise AdapterError(f"{path}: target_modules must be a string or a list, got {tm!r}")
    rank_pattern = raw.get("rank_pattern") or {}
    alpha_pattern = raw.get("alpha_pattern") or {}
    for k, v in rank_pattern.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise AdapterError(f"{path}: rank_pattern[{k!r}] must be an integer >= 1, got {v!r}")
    for k, v in alpha_pattern.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise AdapterError(f"{path}: alpha_pattern[{k!r}] must be a number, got {v!r}")
    return PeftLoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=tm,
        rank_pattern=dict(rank_pattern),
        alpha_pattern=dict(alpha_pattern),
        use_rslora=bool(raw.get("use_rslora", False)),
        layers_to_transform=raw.get("layers_to_transform"),
        layers_pattern=raw.get("layers_pattern"),
        exclude_modules=raw.get("exclude_modules"),
    )
