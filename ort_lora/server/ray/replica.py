"""LoraReplica: one ort-lora engine (AsyncEngine) as a replica of a Ray Serve deployment.

    generate(prompt_ids, params, lora, request_id)  ->  stream of OutputDelta | ReplicaError

The ingress (ray/client.py) calls it through a DeploymentHandle with
`multiplexed_model_id=<adapter name>`, so Ray routes each adapter's requests to replicas that
already hold it. Ray's `@serve.multiplexed` loader (`_load`) registers the adapter in this
engine; when Ray evicts it (LRU, `max_adapters_per_replica`), it is unregistered, once the
requests still using it here have ended (ray/residency.py keeps that bookkeeping). Base-model
requests carry no model id and go to any replica. As in the single-process server,
--adapter-root governs adapters loaded at run time only (checked again here when one is
registered); --lora-modules adapters are registered wherever they lie.

Errors: a request's error is streamed back as a ReplicaError (the HTTP error it maps to); the
replica goes on serving the others. An engine that stopped (repeated faults) fails Ray's
health check, and Ray replaces the replica. Every REPORT_EVERY_S the replica posts its engine
stats and adapter figures to the adapter directory and drops adapters it no longer serves.

Ray is imported inside methods: this module imports without it (tests/test_imports.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path

from ort_lora.adapters.errors import AdapterNotFoundError
from ort_lora.adapters.registry import resolve_adapter_dir
from ort_lora.engine.async_engine import AsyncEngine
from ort_lora.lora_request import LoRARequest
from ort_lora.sampling_params import SamplingParams
from ort_lora.server.ray.config import DIRECTORY_NAMESPACE, RayServeConfig
from ort_lora.server.ray.directory import REPORT_EVERY_S
from ort_lora.server.ray.residency import AdapterBusy, ReplicaAdapters
from ort_lora.server.ray.stream import DeltaEncoder, ReplicaError

logger = logging.getLogger("ort_lora.server")
DRAIN_WAIT_S = 10.0  # how long a registration waits for the engine to finish an unload


class RoutingError(RuntimeError):
    """A request reached a replica under another adapter's model id (a bug: never served)."""


class _Resident:
    """What Ray's multiplexed LRU holds for one adapter. Ray awaits `__del__` when it evicts
    the adapter; it is an instance attribute, so garbage collection never calls it."""

    def __init__(self, on_evict):
        self.__del__ = on_evict


class LoraReplica:
    async def __init__(self, config: RayServeConfig):
        from ray import serve

        self.config = config
        # no adapter_root here: it governs run-time adapters only, checked in _add_lora
        self.engine = AsyncEngine.from_model_dir(
            config.model_dir,
            max_queued_requests=config.max_queued_requests,
            **config.engine_options,
        )
        await self.engine.start()
        self.adapters = ReplicaAdapters()
        self._wanted: dict[str, LoRARequest] = {}  # name -> the request's LoRARequest
        self._lock = asyncio.Lock()  # one registration change at a time

        async def load(name: str) -> _Resident:
            return await self._load(name)

        limit = config.max_adapters_per_replica
        self._multiplexed = serve.multiplexed(max_num_models_per_replica=limit)(load)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._reporter = asyncio.get_running_loop().create_task(self._report_loop())

    # ---- requests ---------------------------------------------------------------------------

    async def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        lora: LoRARequest | None,
        request_id: str,
    ):
        """The request's outputs as OutputDeltas; its error as one ReplicaError."""
        from ray import serve

        encoder, acquired = DeltaEncoder(), None
        try:
            routed = serve.get_multiplexed_model_id()
            if routed and routed != (lora.lora_name if lora else ""):
                raise RoutingError(f"request routed as {routed!r} carries adapter {lora!r}")
            if lora is not None:
                await self._acquire(lora)
                acquired = lora
            async for out in self.engine.generate(prompt, params, lora, request_id):
                yield encoder.encode(out)
        except AdapterBusy as exc:
            yield ReplicaError(503, str(exc), "model", "adapter_busy", {"Retry-After": "1"})
        except Exception as exc:
            yield ReplicaError.of(exc, f"request {request_id} on replica {self.replica_id}")
        finally:
            if acquired is not None:
                self._release(acquired)

    def describe(self) -> dict:
        """What the ingress needs to know of the engine."""
        return {"model_name": self.engine.model_name, "max_model_len": self.engine.max_model_len}

    def check_health(self) -> None:
        """Ray's health check: an engine that stopped serving gets the replica replaced."""
        if self.engine.error is not None:
            raise RuntimeError(f"replica {self.replica_id}: {self.engine.error}")

    async def __del__(self):
        self._reporter.cancel()
        await self.engine.stop()

    # ---- adapters ---------------------------------------------------------------------------

    async def _acquire(self, lora: LoRARequest) -> None:
        """Count the request as a user of `lora` and make sure the engine has it."""
        self.adapters.arrive(lora)
        try:
            self._wanted[lora.lora_name] = lora
            await self._multiplexed(lora.lora_name)
            await self._register(lora)  # Ray may hold it while this replica dropped it
        except BaseException:
            self._release(lora)
            raise

    def _release(self, lora: LoRARequest) -> None:
        if self.adapters.release(lora):
            asyncio.get_running_loop().create_task(self._unregister(lora.lora_name))

    async def _load(self, name: str) -> _Resident:
        """Ray's multiplexed loader: register the adapter the current request names."""
        await self._register(self._wanted[name])

        async def evicted() -> None:
            if self.adapters.evict(name):
                await self._unregister(name)

        return _Resident(evicted)

    async def _register(self, lora: LoRARequest) -> None:
        async with self._lock:
            needed, old = self.adapters.to_register(lora)
            if old is not None:
                await self._remove(old.lora_name)
            if needed:
                await self._await_drained(lora.lora_name)
                # files are read and checked on a worker thread, as the server's add_lora
                await asyncio.to_thread(self._add_lora, lora)
                self.adapters.did_register(lora)

    def _add_lora(self, lora: LoRARequest) -> None:
        """Register `lora` in the engine. An adapter loaded at run time must lie inside the
        adapter root (the ingress checked it at load; its files may have moved since);
        --lora-modules adapters are the operator's own, as in the single-process server."""
        root = self.config.root_for(lora.lora_name, lora.lora_path)
        if root is not None:
            resolve_adapter_dir(lora.lora_path, Path(root))
        self.engine.add_lora(lora)

    async def _unregister(self, name: str) -> None:
        async with self._lock:
            if self.adapters.leaving_and_idle(name):
                await self._remove(name)

    async def _remove(self, name: str) -> None:
        # bookkeeping first: the engine's removal runs on even if this task is cancelled,
        # and a later registration of the name waits for it (_await_drained)
        self.adapters.did_unregister(name)
        with contextlib.suppress(AdapterNotFoundError):
            await asyncio.to_thread(self.engine.remove_lora, name)

    async def _await_drained(self, name: str) -> None:
        """The engine unregisters an unloaded adapter once its last sequence ends (an abort
        is processed between steps): wait for that before registering the name again."""
        deadline = time.monotonic() + DRAIN_WAIT_S
        while name in self.engine.engine.registry and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    # ---- reports ----------------------------------------------------------------------------

    async def _report_loop(self) -> None:
        import ray

        directory = None
        while True:
            try:
                directory = directory or ray.get_actor(
                    self.config.directory_name, namespace=DIRECTORY_NAMESPACE
                )
                served = await directory.report.remote(self.replica_id, self.figures())
                for name in self.adapters.drop_unknown(served):
                    await self._unregister(name)
            except Exception as exc:  # the directory restarting: report again later
                logger.warning("replica %s: report failed: %s", self.replica_id, exc)
                directory = None
            await asyncio.sleep(REPORT_EVERY_S)

    def figures(self) -> dict:
        """Engine stats (without step times) and adapter figures, as the directory keeps;
        "time" is taken first, so the figures count everything that happened before it."""
        import ray

        now = time.time()
        stats = {k: v for k, v in self.engine.stats().items() if k != "step"}
        return {
            "stats": stats,
            "adapters": {name: dict(c) for name, c in self.adapters.counters.items()},
            "held": sorted(self.adapters.registered),
            "in_use": self.adapters.in_use(),
            "pid": os.getpid(),
            "node": ray.util.get_node_ip_address(),
            "time": now,
        }
