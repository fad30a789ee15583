"""AsyncEngine: the LLMEngine on its own thread, with an asyncio streaming interface.

The engine thread loops: run queued commands (add, abort), then one step, then hand every
RequestOutput (or a request's error) to the asyncio queue of its request. HTTP handlers never
run engine work on the event loop: they enqueue a command and await its result. A lock
serializes the few direct calls (adapter registration) with the step; what cheap routes read
(the adapters served, the stats) is a snapshot the engine thread refreshes between steps, so
they never wait for a step.

Faults: one request's fault fails that request alone (LLMEngine.step). A failed model run
is isolated (engine/isolation.py): the step's entries are rerun in halves, only requests
whose entries fail even alone end (500 with an error id), the others go on unchanged. A step
counts as failed only when the model itself fails: no entry runs alone and neither does a
minimal probe step (or a bug around the run), so no client can stop the engine. Should
MAX_STEP_FAILURES steps in a row fail (LLMEngine.healthy turns false) or the loop itself
break, the engine stops: every request it holds and every command still queued is answered
with EngineUnavailable (503) saying why, later calls (and /health) get it at once.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from ort_lora.config import EngineConfig
from ort_lora.engine.llm_engine import LLMEngine
from ort_lora.errors import EngineUnavailable, check_room, internal_error
from ort_lora.lora_request import LoRARequest
from ort_lora.outputs import RequestOutput
from ort_lora.sampling_params import SamplingParams

STATS_EVERY_S = 0.25  # how often the engine thread refreshes the stats snapshot


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
        self.error: BaseException | None = None  # set: the engine stopped serving
        self._loras: list[LoRARequest] = engine.list_loras()
        self._stats: dict = engine.stats()
        self._stats_time = 0.0

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
        """Stop the engine thread, then release the engine's session."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self.engine.close()

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and self.error is None:
                self._run_commands()
                outputs = self._step()
                for out in outputs:
                    self._deliver(out.request_id, out)
                self._refresh_snapshot()
                if not outputs and not self.engine.has_unfinished_requests():
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as exc:  # the loop itself broke: nothing can be served
            self._shut_down(exc)

    def _step(self) -> list[RequestOutput]:
        """One engine step; its failed requests get their errors. A fault escaping the step
        counts as a failed step (LLMEngine.step_failures); too many in a row stop the
        engine."""
        try:
            with self._lock:
                outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
        except Exception as exc:
            internal_error(exc, "engine step")
            self.engine.step_failures += 1
            outputs = []
        for rid, error in self.engine.take_failures():
            self._deliver(rid, error)
        if not self.engine.healthy:
            n = self.engine.step_failures
            why = f"{n} steps in a row failed, not because of any one request"
            self._shut_down(RuntimeError(f"{n} failed steps in a row"), why)
        return outputs

    def _shut_down(self, cause: BaseException, why: str = "its loop broke") -> None:
        """Stop serving: answer every request held and every command queued (503, saying
        `why`: a fixed text, never the cause's, which is logged)."""
        logged = internal_error(cause, "the engine loop")
        error = EngineUnavailable(
            f"the engine stopped serving: {why} (internal error {logged.error_id}); "
            "restart the server"
        )
        self.error = error
        for rid in list(self._streams):
            self._deliver(rid, error)
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                break
            if fut is not None:
                self._resolve(fut, error=error)

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

    def _refresh_snapshot(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._stats_time >= STATS_EVERY_S:
            with self._lock:
                self._loras = self.engine.list_loras()
                self._stats = self.engine.stats()
            self._stats_time = now

    def _resolve(self, fut: asyncio.Future, result=None, error=None) -> None:
        def settle():
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

        self._loop.call_soon_threadsafe(settle)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            self._loop.call_soon_threadsafe(stream.put_nowait, item)

    async def _call(self, fn: Callable):
        """Run fn() on the engine thread between steps; return its result or raise."""
        if self.error is not None:
            raise self.error
        fut = self._loop.create_future()
        self._commands.put((fn, fut))
        self._wake.set()
        if self.error is not None:  # stopped meanwhile: its last drain may have missed it
            raise self.error
        return await fut

    # ---- requests ---------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        lora_request: LoRARequest | list[LoRARequest] | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative RequestOutputs after each step that advanced the request; the last has
        finished=True. The adapter (or each of a composition's: a list, with their weights)
        must be registered (add_lora): a name unloaded meanwhile is not found. Errors of the
        request (RequestError, AdapterError, QueueFullError, EngineError, EngineUnavailable)
        are raised; leaving the loop early aborts it."""
        rid = request_id or uuid.uuid4().hex
        if self.error is not None:
            raise self.error
        check_room(self._streams, rid, self.max_queued_requests, "the engine")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = stream
        finished = False
        try:
            grammar = None
            if params.structured_outputs is not None:  # compiled here, not on the engine's thread
                compile_ = self.engine.grammars.compile
                grammar = await asyncio.to_thread(compile_, params.structured_outputs)
            add = functools.partial(self.engine.add_request, register=False, grammar=grammar)
            await self._call(lambda: add(rid, prompt, params, lora_request))
            while not finished:
                out = await stream.get()
                if isinstance(out, BaseException):
                    raise out
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

    # ---- adapters and stats -----------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Register an adapter: its files are read and checked here, on the caller's thread;
        only the registration itself waits for the engine's step."""
        adapter = self.engine.registry.load(lora_request)
        with self._lock:
            self.engine.add_lora(lora_request, adapter)
        self._refresh_snapshot(force=True)

    def remove_lora(self, lora_name: str) -> None:
        with self._lock:
            self.engine.remove_lora(lora_name)
        self._refresh_snapshot(force=True)

    def list_loras(self) -> list[LoRARequest]:
        """The adapters served (a snapshot: never waits for a step)."""
        return list(self._loras)

    def stats(self) -> dict:
        """The engine's stats as of the last step (never waits for a step)."""
        return self._stats
