"""EngineClient: what the HTTP server asks of an engine, written down. AsyncEngine
(engine/async_engine.py) implements it over one engine in this process, ReplicaClient
(server/ray/client.py) over replicas on a Ray cluster, and the tests' fakes over nothing;
create_app and OpenAIServing are typed against it. tests/test_engine_client.py checks that
each implementation has every member, with the same parameters."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from ort_lora.lora_request import LoRARequest
from ort_lora.outputs import RequestOutput
from ort_lora.sampling_params import SamplingParams
from ort_lora.tokenizer import Tokenizer


@runtime_checkable
class EngineClient(Protocol):
    model_name: str  # the base model's name in the API (unless --served-model-name)
    max_model_len: int  # prompt + output tokens of one request
    max_queued_requests: int  # unfinished requests held before new ones are 503s
    tokenizer: Tokenizer
    error: BaseException | None  # set once the engine stopped serving: /health is 503

    async def start(self) -> None:
        """Start serving (the app's lifespan calls it unless manage_engine=False)."""

    async def stop(self) -> None:
        """Stop serving; every request still held gets an error."""

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        lora_request: LoRARequest | list[LoRARequest] | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request, the last finished; its errors are raised
        (RequestError, AdapterError, QueueFullError, EngineError, EngineUnavailable); leaving
        the iteration early aborts the request. The adapters must be registered."""

    def abort(self, request_id: str) -> None:
        """Cancel a request (unknown or finished: nothing happens)."""

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Register an adapter; AdapterError naming the problem."""

    def remove_lora(self, lora_name: str) -> None:
        """Unload an adapter: new requests for it fail at once, running ones finish."""

    def list_loras(self) -> list[LoRARequest]:
        """The adapters served (a snapshot: never waits for a step)."""

    def stats(self) -> dict:
        """engine/stats.py's figures as of the last step (never waits for a step)."""
