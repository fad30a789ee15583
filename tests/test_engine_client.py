"""Every engine the server speaks to implements EngineClient (server/engine_client.py): the
in-process AsyncEngine, the Ray ingress's ReplicaClient and the tests' FakeEngine have each of
its members, their methods the same parameters and the same kind (coroutine, async
generator or plain), so the server's use of one holds for all."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
from test_server_fakes import FakeEngine

from ort_lora.engine.async_engine import AsyncEngine
from ort_lora.server.engine_client import EngineClient
from ort_lora.server.ray.client import ReplicaClient

IMPLEMENTATIONS = [AsyncEngine, ReplicaClient, FakeEngine]


def _assigned_in_init(cls) -> set[str]:
    """Names the class's __init__ sets on self."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }


def _kind(fn) -> str:
    if inspect.isasyncgenfunction(fn):
        return "async generator"
    return "coroutine" if inspect.iscoroutinefunction(fn) else "plain"


def _protocol_methods() -> dict:
    return {
        name: fn
        for name, fn in vars(EngineClient).items()
        if inspect.isfunction(fn) and not name.startswith("_")
    }


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_implements_every_member(cls):
    have = set(dir(cls)) | _assigned_in_init(cls)
    missing = [n for n in [*EngineClient.__annotations__, *_protocol_methods()] if n not in have]
    assert not missing, f"{cls.__name__} lacks {missing}"
    for name, fn in _protocol_methods().items():
        theirs = getattr(cls, name)
        assert callable(theirs), f"{cls.__name__}.{name} is not a method"
        want = list(inspect.signature(fn).parameters)
        assert list(inspect.signature(theirs).parameters) == want, f"{cls.__name__}.{name}"
        # generate returns an async iterator: the implementations are async generators
        kind = "async generator" if name == "generate" else _kind(fn)
        assert _kind(theirs) == kind, f"{cls.__name__}.{name} is {_kind(theirs)}, not {kind}"


def test_the_check_fails_on_a_missing_member():
    class Partial(FakeEngine):
        stats = None  # not a method any more

    with pytest.raises(AssertionError, match="Partial.stats"):
        test_implements_every_member(Partial)
