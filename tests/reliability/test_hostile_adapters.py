"""Hostile adapter files through /v1/load_lora_adapter: each is refused with a 4xx that names
the problem, none shows the file's bytes, and the server keeps serving unchanged. Every case
is a copy of a valid adapter ("qv", under the adapter root) with one thing broken."""

from __future__ import annotations

import json
import os
import shutil
import struct

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
SECRET = "root:x:0:0:SECRET-LINE"  # must never appear in an error


def edit_config(d, **changes):
    config = json.loads((d / CONFIG).read_text()) | changes
    (d / CONFIG).write_text(json.dumps(config))


def edit_tensors(d, fn):
    tensors = load_file(str(d / WEIGHTS))
    fn(tensors)
    save_file(tensors, str(d / WEIGHTS))


def first_a(tensors) -> str:
    return next(k for k in sorted(tensors) if "lora_A" in k)


def raw_header(d, header: dict, data: bytes = b"") -> None:
    blob = json.dumps(header).encode()
    (d / WEIGHTS).write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def set_first(tensors, value):
    tensors[first_a(tensors)][0, 0] = value


def wrong_shape(tensors):
    name = first_a(tensors)
    tensors[name] = np.zeros((tensors[name].shape[0], 3), np.float32)


def sparse(d):
    """A 1 GB sparse file whose header claims a tensor far larger than the config allows."""
    header = {first_a(load_file(str(d / WEIGHTS))): {
        "dtype": "F32", "shape": [4, 1 << 28], "data_offsets": [0, 1 << 30]}}  # fmt: skip
    raw_header(d, header)
    with open(d / WEIGHTS, "r+b") as f:
        f.truncate(1 << 30 | 4096)


def link_files_outside(d, outside):
    for name in (CONFIG, WEIGHTS):
        (d / name).unlink()
        os.symlink(outside / "qv" / name, d / name)


def scale_tensors(d, factor_a, factor_b):
    """Every value finite in float32, the scaled product s B A not."""

    def edit(tensors):
        for k in tensors:
            tensors[k] = tensors[k] * (factor_a if "lora_A" in k else factor_b)

    edit_tensors(d, edit)


def rename_first_to_secret(d):
    """A tensor whose name (file contents) is a secret: it must not be echoed."""
    edit_tensors(d, lambda t: t.update({SECRET: t.pop(first_a(t))}))


def link_weights_to_secret(d, outside):
    (d / WEIGHTS).unlink()
    os.symlink(outside / "secret.txt", d / WEIGHTS)


# name -> (how to break the copy (fn(dir) or fn(dir, outside)), status, needle)
CASES = {
    "truncated header": (lambda d: (d / WEIGHTS).write_bytes((d / WEIGHTS).read_bytes()[:200]),
                         400, "not a safetensors file"),
    "truncated data": (lambda d: (d / WEIGHTS).write_bytes((d / WEIGHTS).read_bytes()[:-100]),
                       400, "does not fit"),
    "weights not safetensors": (lambda d: (d / WEIGHTS).write_text(SECRET * 10), 400,
                                "not a safetensors file"),
    "pickle only": (lambda d: (d / WEIGHTS).rename(d / "adapter_model.bin"), 400, "pickle"),
    "NaN weight": (lambda d: edit_tensors(d, lambda t: set_first(t, np.nan)), 400, "NaN or inf"),
    "inf weight": (lambda d: edit_tensors(d, lambda t: set_first(t, np.inf)), 400, "NaN or inf"),
    "wrong shape": (lambda d: edit_tensors(d, wrong_shape), 400, "shape"),
    "rank 0": (lambda d: edit_config(d, r=0), 400, "r must be"),
    "huge rank": (lambda d: edit_config(d, r=100_000), 400, "r must be"),
    "sparse 1 GB file": (sparse, 400, "shape"),
    "bad regex": (lambda d: edit_config(d, target_modules="(q_proj"), 400, "target_modules"),
    "backtracking regex": (lambda d: edit_config(d, target_modules=r"(.|..)*(.|..)*(.|..)*\d\d"),
                           400, "simplify"),
    "bad pattern key": (lambda d: edit_config(d, rank_pattern={"[": 2}), 400, "rank_pattern"),
    "target_modules a number": (lambda d: edit_config(d, target_modules=5), 400,
                                "target_modules"),
    "rank_pattern a list": (lambda d: edit_config(d, rank_pattern=[1]), 400, "rank_pattern"),
    "alpha a string": (lambda d: edit_config(d, alpha_pattern={"q_proj": "x"}), 400, "alpha"),
    "alpha inf": (lambda d: edit_config(d, lora_alpha=float("inf")), 400, "lora_alpha"),
    "alpha 1e308": (lambda d: edit_config(d, lora_alpha=1e308), 400, "lora_alpha must be a finite"),
    "alpha 3e38": (lambda d: edit_config(d, lora_alpha=3e38), 400, "scaling lora_alpha / r"),
    "alpha_pattern 1e30": (lambda d: edit_config(d, alpha_pattern={"q_proj": 1e30}), 400,
                           "alpha_pattern['q_proj'] / r"),
    "scaled product overflows": (lambda d: scale_tensors(d, 1, 1e30), 400, "could overflow"),
    "scaled shrink overflows": (lambda d: scale_tensors(d, 1e36, 1e-36), 400, "could overflow"),
    "tensor named as a secret": (rename_first_to_secret, 400, "not named as a LoRA"),
    "layers_to_transform text": (lambda d: edit_config(d, layers_to_transform="0"), 400,
                                 "layers_to_transform"),
    "exclude_modules a number": (lambda d: edit_config(d, exclude_modules=3), 400,
                                 "exclude_modules"),
    "use_rslora text": (lambda d: edit_config(d, use_rslora="yes"), 400, "use_rslora"),
    "config not JSON": (lambda d: (d / CONFIG).write_text(SECRET), 400, "not valid JSON"),
    "config a list": (lambda d: (d / CONFIG).write_text("[1]"), 400, "JSON object"),
    "config deeper than JSON": (lambda d: (d / CONFIG).write_text("[" * 100_000 + "]" * 100_000),
                                400, "nested too deeply"),
    "header dtype": (lambda d: raw_header(d, {SECRET: {"dtype": "I64", "shape": [1],
                                                     "data_offsets": [0, 8]}}, b"\0" * 8),
                     400, "dtype"),
    "header offsets": (lambda d: raw_header(d, {"x": {"dtype": "F32", "shape": [1],
                                                       "data_offsets": ["0", 4]}}, b"\0" * 4),
                       400, "data_offsets"),
    "header nested": (lambda d: raw_header(d, {"x": json.loads("[" * 500 + "]" * 500)}), 400,
                      "malformed"),
    "header deeper than JSON": (lambda d: (d / WEIGHTS).write_bytes(
        struct.pack("<Q", 200_000) + b"[" * 100_000 + b"]" * 100_000), 400, "not valid JSON"),
    "empty dir": (lambda d: [p.unlink() for p in list(d.iterdir())], 400, ""),
    "files linked outside": (link_files_outside, 403, "outside"),
    "weights linked to a secret": (link_weights_to_secret, 403, "outside"),
}  # fmt: skip


@pytest.fixture(scope="module")
def outside(served, tmp_path_factory):
    """A valid adapter and a 'secret' file outside the adapter root."""
    out = tmp_path_factory.mktemp("outside_root")
    shutil.copytree(served.root / "qv", out / "qv")
    (out / "secret.txt").write_text(SECRET + "\n" * 100)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_adapter(served, outside, case):
    breaker, status, needle = CASES[case]
    name = "h-" + case.replace(" ", "-").replace("_", "-")
    d = served.root / name
    shutil.copytree(served.root / "qv", d)
    breaker(*((d, outside) if breaker.__code__.co_argcount == 2 else (d,)))
    r = served.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": name})
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert needle in message, message
    assert "SECRET" not in r.text and "root:x" not in r.text
    for where in (served.root, outside):  # the server's layout: never shown
        assert str(where) not in r.text, message
    listed = httpx.get(served.url + "/v1/models", timeout=30).json()["data"]
    assert name not in {m["id"] for m in listed}
    served.assert_serving()


@pytest.mark.parametrize(
    "path, status",
    [
        ("../../../etc", 403),
        ("a" * 5000, 400),
        ("loop", 400),
        ("sneaky-dir", 403),
    ],
)
def test_hostile_adapter_paths(served, outside, path, status):
    """Traversal, a name too long, a symlink loop, a directory symlink out of the root."""
    if path == "loop" and not (served.root / "loop").exists():
        os.symlink(served.root / "loop", served.root / "loop")
    if path == "sneaky-dir" and not (served.root / "sneaky-dir").exists():
        os.symlink(outside / "qv", served.root / "sneaky-dir")
    r = served.post("/v1/load_lora_adapter", {"lora_name": "p", "lora_path": path})
    assert r.status_code == status, r.text
    served.assert_serving()


@pytest.mark.parametrize("weight", [1e308, 1e30, -1e4])
def test_composed_weights_beyond_float32_or_max_weight_are_refused(served, weight):
    """Finite as a float64 but not as the kernel's float32 (or absurd): 400 naming the weight,
    before any step runs (a step would fail, or answer garbage with a 200)."""
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "adapters": [{"name": "qv", "weight": weight}]}
    r = served.post("/v1/completions", body)
    assert r.status_code == 400, r.text
    assert "weight" in r.json()["error"]["message"]
    served.assert_serving()
