"""PEFT LoRA adapter_config.json: parsing, refusals, and PEFT's own matching and scaling rules.

Module keys are the base model's module names, as PEFT sees them, e.g.
"model.layers.3.self_attn.q_proj". Matching mirrors peft (0.17-0.21):
  target_modules     peft.tuners.tuners_utils.check_target_module_exists
  rank/alpha_pattern peft.utils.other.get_pattern_key (first key k with re.match(r"(.*\\.)?(k)$"))
  scaling            peft.tuners.lora.layer.LoraLayer.update_layer (alpha/r, rslora alpha/sqrt(r))

The file is untrusted: every field's type is checked, and its regular expressions (string
target_modules / exclude_modules, pattern keys, layers_pattern) are compiled with the `regex`
engine and matched under one time budget per adapter, so that a pathological pattern is a
clear AdapterError, not a stalled server. Numbers are checked in the type the kernel uses:
lora_alpha (and alpha_pattern values) must be finite in float32; each module's scaling is
bounded where the adapter is loaded (host.py, bounds.py). Errors name the file as the adapter
directory holds it (`where`), never its resolved path.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import regex

from ort_lora.adapters.errors import AdapterError

CONFIG_NAME = "adapter_config.json"
ALL_LINEAR = "all-linear"
LLAMA_LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# field -> (value that is fine, why the others are refused)
_REFUSED = {
    "fan_in_fan_out": (False, "fan_in_fan_out (Conv1D weights) does not apply to Llama"),
    "lora_bias": (False, "LoRA bias terms are not supported"),
    "use_qalora": (False, "QALoRA is not supported"),
}
FLOAT32_MAX = 3.4028234663852886e38
MAX_RANK = 512  # LoraSGMV's largest rank (custom_ops/lora_sgmv)
MAX_PATTERN_CHARS = 1000
MATCH_BUDGET_S = 1.0  # all of one adapter's regex matching
_MUST_BE_EMPTY = (
    "modules_to_save",
    "layer_replication",
    "target_parameters",
    "trainable_token_indices",
    "alora_invocation_tokens",
)


class Patterns:
    """An adapter's regular expressions, compiled once and matched under one time budget."""

    def __init__(self, where: str | Path, budget_s: float = MATCH_BUDGET_S):
        self.where = where
        self.left = budget_s
        self._compiled: dict[str, regex.Pattern] = {}

    def compile(self, pattern: str, field_name: str) -> regex.Pattern:
        """AdapterError naming the field for a pattern too long or not a regex."""
        if pattern not in self._compiled:
            if len(pattern) > MAX_PATTERN_CHARS:
                raise AdapterError(
                    f"{self.where}: {field_name} holds a pattern of {len(pattern)} characters "
                    f"(at most {MAX_PATTERN_CHARS})"
                )
            try:
                self._compiled[pattern] = regex.compile(pattern)
            except (regex.error, OverflowError, RecursionError) as e:
                raise AdapterError(
                    f"{self.where}: {field_name} {pattern[:80]!r} is not a valid regular "
                    f"expression ({e})"
                ) from None
        return self._compiled[pattern]

    def match(self, pattern: str, key: str, full: bool = False) -> regex.Match | None:
        compiled = self._compiled[pattern]  # compiled when the config was read
        start = time.perf_counter()
        try:
            m = (compiled.fullmatch if full else compiled.match)(key, timeout=max(self.left, 1e-3))
        except TimeoutError:
            m = None
            self.left = 0.0
        self.left -= time.perf_counter() - start
        if self.left <= 0:
            raise AdapterError(
                f"{self.where}: its module patterns took over {MATCH_BUDGET_S} s to match the "
                f"module names (pattern {pattern[:80]!r}); simplify them"
            )
        return m


@dataclass
class PeftLoraConfig:
    """The parts of a PEFT LoraConfig that change the math, validated."""

    r: int
    lora_alpha: float
    target_modules: str | list[str]
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    use_rslora: bool = False
    use_dora: bool = False  # DoRA: a magnitude vector per module (adapters/dora.py)
    layers_to_transform: list[int] | int | None = None
    layers_pattern: list[str] | str | None = None
    exclude_modules: list[str] | str | None = None
    patterns: Patterns = field(default_factory=lambda: Patterns(CONFIG_NAME))
    base_model: str | None = None  # base_model_name_or_path: information only (base_model.py)

    def __post_init__(self):
        """Compile every regular expression now: a bad one fails the load, by field."""
        p = self.patterns
        for name in ("target_modules", "exclude_modules"):
            if isinstance(getattr(self, name), str):
                p.compile(getattr(self, name), name)
        for name in ("rank_pattern", "alpha_pattern"):
            for k in getattr(self, name):
                p.compile(rf"(.*\.)?({k})$", f"{name} key")
        for lp in _as_list(self.layers_pattern):
            p.compile(rf"(?:^|.*?\.){lp}\.(?P<idx>\d+)\.", "layers_pattern")
        p.compile(_LAYER_INDEX, "layers_to_transform")

    def targets(self, key: str) -> bool:
        """Whether PEFT would put LoRA on the module named key."""
        if self._excluded(key):
            return False
        tm = self.target_modules
        if isinstance(tm, str):
            if tm.lower() == ALL_LINEAR:
                # + Phi-3's fused modules (adapters/fused.py maps them onto their parts)
                return key.rsplit(".", 1)[-1] in LLAMA_LINEAR_MODULES + ("qkv_proj", "gate_up_proj")
            return self.patterns.match(tm, key, full=True) is not None
        if key in tm:
            return True
        return any(key.endswith(f".{t}") for t in tm) and self._layer_selected(key)

    def rank(self, key: str) -> int:
        return int(self.rank_pattern.get(self._pattern_key(self.rank_pattern, key), self.r))

    def alpha(self, key: str) -> float:
        k = self._pattern_key(self.alpha_pattern, key)
        return float(self.alpha_pattern.get(k, self.lora_alpha))

    def scaling(self, key: str) -> float:
        r = self.rank(key)
        return self.alpha(key) / (math.sqrt(r) if self.use_rslora else r)

    def scaling_rule(self, key: str) -> str:
        """How scaling(key) is computed, naming the fields: 'lora_alpha / r = 16 / 8'."""
        ak, rk = (self._pattern_key(p, key) for p in (self.alpha_pattern, self.rank_pattern))
        alpha = f"alpha_pattern[{ak[:40]!r}]" if ak in self.alpha_pattern else "lora_alpha"
        r = f"rank_pattern[{rk[:40]!r}]" if rk in self.rank_pattern else "r"
        if self.use_rslora:
            return f"{alpha} / sqrt({r}) = {self.alpha(key):.4g} / sqrt({self.rank(key)})"
        return f"{alpha} / {r} = {self.alpha(key):.4g} / {self.rank(key)}"

    def _pattern_key(self, patterns: dict, key: str) -> str:
        for k in patterns:
            if self.patterns.match(rf"(.*\.)?({k})$", key):
                return k
        return key

    def _excluded(self, key: str) -> bool:
        ex = self.exclude_modules
        if not ex:
            return False
        if isinstance(ex, str):
            return self.patterns.match(ex, key, full=True) is not None
        return key in ex or any(key.endswith(f".{e}") for e in ex)

    def _layer_selected(self, key: str) -> bool:
        idx = self.layers_to_transform
        if idx is None or (isinstance(idx, list) and not idx):
            return True
        m = None
        if not self.layers_pattern:
            m = self.patterns.match(_LAYER_INDEX, key)
        else:
            for p in _as_list(self.layers_pattern):
                m = self.patterns.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", key)
                if m:
                    break
        if m is None:
            return False
        layer = int(m.group("idx"))
        return layer == idx if isinstance(idx, int) else layer in idx


_LAYER_INDEX = r".*?\.[^.]*\.(?P<idx>\d+)\."


def _as_list(value) -> list:
    if not value:
        return []
    return [value] if isinstance(value, str) else list(value)


def read_config(adapter_dir: Path, where: str = CONFIG_NAME) -> PeftLoraConfig:
    """Parse and validate adapter_dir/adapter_config.json; AdapterError names the bad field.
    where: what errors call the file (e.g. "adapter 'sql': adapter_config.json")."""
    if not (adapter_dir / CONFIG_NAME).is_file():
        raise AdapterError(f"{where}: no such file (not a PEFT adapter directory)")
    path = where  # errors name the file as `where` says, never the path it was read from
    try:
        raw = json.loads((adapter_dir / CONFIG_NAME).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:  # nested deeper than the parser's stack
        raise AdapterError(f"{path}: not valid JSON (nested too deeply)") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{path}: expected a JSON object")
    _refuse_unsupported(raw, path)
    return _build(raw, path)


def _refuse_unsupported(raw: dict, path: str) -> None:
    peft_type = raw.get("peft_type", "LORA")
    if not isinstance(peft_type, str) or peft_type.upper() != "LORA":
        raise AdapterError(
            f"{path}: peft_type is {_shown(peft_type)}; only 'LORA' adapters are supported"
        )
    for name, (ok, why) in _REFUSED.items():
        if raw.get(name, ok) not in (ok, None):
            raise AdapterError(f"{path}: {name} is {_shown(raw[name])}: {why} (expected {ok})")
    for name in _MUST_BE_EMPTY:
        if raw.get(name):
            raise AdapterError(f"{path}: {name} is {_shown(raw[name])}; expected null or empty")
    if raw.get("bias", "none") != "none":
        raise AdapterError(f"{path}: bias is {_shown(raw['bias'])}; only bias='none' is supported")


def _build(raw: dict, path: str) -> PeftLoraConfig:
    r, alpha = raw.get("r", 8), raw.get("lora_alpha", 8)
    if not _is_int(r) or not 1 <= r <= MAX_RANK:
        raise AdapterError(f"{path}: r must be an integer in [1, {MAX_RANK}], got {_shown(r)}")
    if not _is_number(alpha):
        raise AdapterError(
            f"{path}: lora_alpha must be a finite number (in float32, |value| <= "
            f"{FLOAT32_MAX:.4g}), got {_shown(alpha)}"
        )
    tm = raw.get("target_modules")
    if not (isinstance(tm, str) or _str_list(tm)):
        raise AdapterError(f"{path}: target_modules must be a string or a list, got {_shown(tm)}")
    rank_pattern = _pattern_dict(raw, "rank_pattern", path)
    alpha_pattern = _pattern_dict(raw, "alpha_pattern", path)
    for k, v in rank_pattern.items():
        if not _is_int(v) or not 1 <= v <= MAX_RANK:
            raise AdapterError(
                f"{path}: rank_pattern[{_shown(k)}] must be an integer in [1, {MAX_RANK}], got "
                f"{_shown(v)}"
            )
    for k, v in alpha_pattern.items():
        if not _is_number(v):
            raise AdapterError(
                f"{path}: alpha_pattern[{_shown(k)}] must be a finite number (in float32), got "
                f"{_shown(v)}"
            )
    return PeftLoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=tm,
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
        use_rslora=_optional(raw, "use_rslora", path, lambda v: isinstance(v, bool), "a bool")
        or False,
        use_dora=_optional(raw, "use_dora", path, lambda v: isinstance(v, bool), "a bool") or False,
        layers_to_transform=_optional(
            raw, "layers_to_transform", path, _layer_indices, "an integer >= 0 or a list of them"
        ),
        layers_pattern=_optional(raw, "layers_pattern", path, _str_or_list, "a string or a list"),
        exclude_modules=_optional(raw, "exclude_modules", path, _str_or_list, "a string or list"),
        patterns=Patterns(path),
        base_model=_optional(raw, "base_model_name_or_path", path, _is_str, "a string"),
    )


def _is_str(value) -> bool:
    return isinstance(value, str)


def _pattern_dict(raw: dict, name: str, path: str) -> dict:
    value = raw.get(name) or {}
    if not isinstance(value, dict):
        raise AdapterError(
            f"{path}: {name} must be an object {{pattern: value}}, got {_shown(value)}"
        )
    return dict(value)


def _optional(raw: dict, name: str, path: str, ok, what: str):
    value = raw.get(name)
    if value is not None and not ok(value):
        raise AdapterError(f"{path}: {name} must be {what}, got {_shown(value)}")
    return value


def _shown(value) -> str:
    """A config value in an error, cut short (the file is the client's, but may be huge)."""
    if isinstance(value, int) and value.bit_length() > 128:  # repr of a huge int may raise
        return f"an integer of {value.bit_length()} bits"
    try:
        text = repr(value)
    except RecursionError:
        return "a value nested too deeply"
    return text if len(text) <= 80 else text[:80] + "..."


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    """A JSON number finite in float32 (LoraSGMV's arithmetic); a huge int is not."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return abs(float(v)) <= FLOAT32_MAX
    except OverflowError:
        return False


def _str_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(t, str) for t in v)


def _str_or_list(v) -> bool:
    return isinstance(v, str) or _str_list(v)


def _layer_indices(v) -> bool:
    if _is_int(v):
        return v >= 0
    return isinstance(v, list) and all(_is_int(i) and i >= 0 for i in v)
