"""AsyncEngine: the LLMEngine on its own thread, with an asyncio streaming interface.

The engine thread loops: run queued commands (add, abort), then one step, then hand every
RequestOutput to the asyncio queue of its request. HTTP handlers never run engine work on the
event loop: they enqueue a command and await its result. A lock serializes the few direct
calls (adapters, stats) with the step.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from ort_lora.adapters.errors import AdapterError
from ort_lora.config import EngineConfig
from ort_lora.engine.errors import QueueFullError
from ort_lora.engine.llm_engine import LLMEngine
from ort_lora.lora_request import LoRARequest
from ort_lora.outputs import RequestOutput
from ort_lora.sampling_params import SamplingParams


class AsyncEngine:
    """Streams RequestOutputs of an LLMEngine running on a background thread."""

    def __init__(self, engine: LLMEngine, max_queued_requests: int = 1024):
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self._lock = threading.Lock()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        *,
        adapter_root: str | Path | None = None,
        max_queued_requests: int = 1024,
        **config_overrides,
    ) -> AsyncEngine:
        engine = LLMEngine(model_dir, config, adapter_root=adapter_root, **config_overrides)
        return cls(engine, max_queued_requests)

    @property
    def model_name(self) -> str:
        return self.engine.model_dir.name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="ort-lora-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._run_commands()
                with self._lock:
                    outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
                    failures = self.engine.take_failures()
                for rid, error in failures:
                    self._deliver_error(rid, error)
                for out in outputs:
                    self._deliver(out)
                if not outputs and not self.engine.has_unfinished_requests():
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as e:  # the engine is broken: fail every stream, keep the reason
            self.error = e
            for rid in list(self._streams):
                self._deliver_error(rid, e)

    def _run_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                with self._lock:
                    result = fn()
            except Exception as e:
                if fut is not None:
                    self._resolve(fut, error=e)
            else:
                if fut is not None:
                    self._resolve(fut, result=result)

    def _resolve(self, fut: asyncio.Future, result=None, error=None) -> None:
        def settle():
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

        self._loop.call_soon_threadsafe(settle)

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is not None:
            self._loop.call_soon_threadsafe(stream.put_nowait, out)

    def _deliver_error(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            self._loop.call_soon_threadsafe(stream.put_nowait, error)

    async def _call(self, fn: Callable):
        """Run fn() on the engine thread between steps; return its result or raise."""
        if self.error is not None:
            raise RuntimeError(f"the engine stopped after an internal error: {self.error}")
        fut = self._loop.create_future()
        self._commands.put((fn, fut))
        self._wake.set()
        return await fut

    # ---- requests ---------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative RequestOutputs after each step that advanced the request; the last has
        finished=True. Errors in the request (ValueError, QueueFullError) are raised before
        anything is yielded; leaving the loop early aborts the request."""
        rid = request_id or uuid.uuid4().hex
        if len(self._streams) >= self.max_queued_requests:
            raise QueueFullError(
                f"the engine already holds {len(self._streams)} requests "
                f"(max_queued_requests={self.max_queued_requests}); retry later"
            )
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = stream
        finished = False
        try:
            await self._call(lambda: self.engine.add_request(rid, prompt, params, lora_request))
            while not finished:
                out = await stream.get()
                if isinstance(out, AdapterError):  # this request's adapter failed to load
                    raise out
                if isinstance(out, BaseException):
                    raise RuntimeError(f"the engine failed: {out}") from out
                finished = out.finished
                yield out
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Cancel a request; its pages are freed before the next step."""
        self._commands.put((lambda: self.engine.abort_request(request_id), None))
        self._wake.set()

    # ---- adapters and stats (serialized with the step) -------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> None:
        with self._lock:
            self.engine.add_lora(lora_request)

    def remove_lora(self, lora_name: str) -> None:
        with self._lock:
            self.engine.remove_lora(lora_name)

    def list_loras(self) -> list[LoRARequest]:
        with self._lock:
            return self.engine.list_loras()

    def stats(self) -> dict:
        with self._lock:
            return self.engine.stats()
