"""Fixtures of the reliability suite (reliability_server.py has the server and its checks).

Bounded in CI (`make test`); `make fuzz` runs the fuzzers longer, `make soak` the soak
(tests/reliability/soak.py, docs/RELIABILITY.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from reliability_server import serve, write_adapter

pytest.importorskip("torch")
pytest.importorskip("peft")


@pytest.fixture(scope="session")
def adapter_root(tiny_llama_checkpoint, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("reliability_adapters")
    write_adapter(tiny_llama_checkpoint, root / "qv", seed=11)
    write_adapter(tiny_llama_checkpoint, root / "mlp", seed=12, target_modules=["up_proj"])
    return root


@pytest.fixture(scope="session")
def served(tiny_llama_export, adapter_root):
    """One server for the whole suite: every hostile group must leave it serving."""
    with serve(tiny_llama_export, adapter_root) as s:
        yield s
