"""ReplicaClient: the ingress's engine. It has AsyncEngine's interface, so the server's own app
(create_app) serves the cluster unchanged, but it runs no model: each request goes to a
LoraReplica through Ray Serve's DeploymentHandle.

    generate  -> handle.options(stream=True, multiplexed_model_id=<adapter name>).generate
                 (base-model requests: no model id, any replica; multiplexed=False: never one)
    abort     -> cancels the request's stream (the replica aborts it in its engine)
    add_lora / remove_lora -> the cluster's adapter directory (a Ray actor); files are
                 checked here first, as the single-process server checks them
    list_loras / stats -> snapshots refreshed every REFRESH_S from the directory, so the
                 server's cheap routes never wait for Ray

A replica that dies before a request's first output is retried on another (nothing was sent
to the client yet); after it, the request ends with EngineUnavailable (a 503 error event in
a stream). Never on another adapter: the request carries its LoRARequest, and the replica
checks it against the model id it was routed by.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from ort_lora.adapters.errors import CompositionError
from ort_lora.adapters.loader import AdapterLoader
from ort_lora.contract import ModelManifest
from ort_lora.errors import EngineUnavailable, check_room
from ort_lora.lora_request import LoRARequest
from ort_lora.outputs import RequestOutput
from ort_lora.sampling_params import SamplingParams
from ort_lora.server.ray.config import DIRECTORY_NAMESPACE, RayServeConfig
from ort_lora.server.ray.stream import DeltaDecoder, ReplicaError
from ort_lora.tokenizer import Tokenizer

logger = logging.getLogger("ort_lora.server")
REFRESH_S = 1.0  # how often the adapters and the replicas' figures are read
RETRIES = 3  # attempts on another replica when one dies before the first output
RETRY_WAIT_S = 0.25


class ReplicaClient:
    def __init__(self, handle, directory, config: RayServeConfig, max_model_len: int):
        self.config = config
        self.model_name = Path(config.model_dir).name
        self.max_model_len = max_model_len
        self.max_queued_requests = config.max_queued_requests
        self.tokenizer = Tokenizer.from_model_dir(config.model_dir)
        # checks run-time adapters' files (inside the adapter root; reads and converts, keeps
        # nothing); --lora-modules adapters never come here: the directory starts with them
        manifest = ModelManifest.load(config.model_dir)
        self._checker = AdapterLoader(manifest, config.adapter_root)
        self._handle = handle
        self._directory = directory
        self._streams: dict[str, object] = {}  # request id -> its response generator
        self._loras: list[LoRARequest] = []
        self._version = -1  # of the directory's adapters, as _loras holds them
        self.replicas: dict[str, dict] = {}  # replica id -> its latest figures
        self._refresher: asyncio.Task | None = None

    @classmethod
    async def connect(cls, handle, config: RayServeConfig) -> ReplicaClient:
        """A client of the replica deployment `handle` (asks one replica for the model's
        limits) and of the application's adapter directory."""
        import ray

        directory = ray.get_actor(config.directory_name, namespace=DIRECTORY_NAMESPACE)
        info = await handle.describe.remote()
        client = cls(handle, directory, config, info["max_model_len"])
        await client.refresh()
        return client

    # ---- lifecycle (the app's lifespan) -------------------------------------------------------

    async def start(self) -> None:
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_loop())

    async def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        for stream in list(self._streams.values()):
            stream.cancel()

    async def refresh(self) -> None:
        version, loras, self.replicas = await self._directory.snapshot.remote()
        self._set_loras(loras, version)

    def _set_loras(self, loras: list[LoRARequest], version: int) -> None:
        if version >= self._version:  # a snapshot read before a load or unload is stale
            self._loras, self._version = loras, version

    @property
    def error(self) -> BaseException | None:
        """What the server's /health reports: unavailable while no replica reports."""
        if self.replicas:
            return None
        return EngineUnavailable("no engine replica has reported lately")

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            try:
                await self.refresh()
            except Exception as exc:  # the directory restarting: keep the last snapshot
                logger.warning("adapter directory unavailable: %s", exc)

    # ---- requests ---------------------------------------------------------------------------

    async def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        lora_request: LoRARequest | list[LoRARequest] | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """As AsyncEngine.generate, served by a replica; leaving early cancels it there."""
        rid = request_id or uuid.uuid4().hex
        lora_request = _one_adapter(lora_request)
        check_room(self._streams, rid, self.max_queued_requests, "the ingress")
        decoder, started, finished = DeltaDecoder(), False, False
        try:
            for attempt in range(RETRIES + 1):
                stream = self._call(prompt, params, lora_request, rid)
                self._streams[rid] = stream
                try:
                    async for item in stream:
                        if isinstance(item, ReplicaError):
                            raise item.api_error()
                        out = decoder.decode(item)
                        started, finished = True, out.finished
                        yield out
                    return
                except _replica_gone() as exc:
                    if started or attempt == RETRIES:
                        raise EngineUnavailable(
                            f"the replica serving request {rid} stopped ({type(exc).__name__}); "
                            "retry the request"
                        ) from exc
                    logger.warning("request %s: replica gone before its first output", rid)
                    stream.cancel()  # unreachable rather than dead: stop it there too
                    await asyncio.sleep(RETRY_WAIT_S * (attempt + 1))
        finally:
            stream = self._streams.pop(rid, None)
            if stream is not None and not finished:
                stream.cancel()

    def _call(self, prompt, params, lora: LoRARequest | None, rid: str):
        model_id = lora.lora_name if lora is not None and self.config.multiplexed else ""
        handle = self._handle.options(stream=True, multiplexed_model_id=model_id)
        return handle.generate.remote(list(prompt), params, lora, rid)

    def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.cancel()

    # ---- adapters and stats -----------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Check the adapter's files here, then record it in the cluster's directory (which
        gives it its cluster-wide int id); replicas load it when a request needs it. Blocks:
        the server calls it on a worker thread."""
        import ray

        self._checker.load(lora_request)
        call = self._directory.add.remote(lora_request.lora_name, lora_request.lora_path)
        lora, version = _unwrapped(lambda: ray.get(call))
        self._set_loras([*self._loras, lora], version)

    def remove_lora(self, lora_name: str) -> None:
        """Forget the adapter cluster-wide: the name stops resolving here at once, replicas
        unregister it after their next report (requests that named it finish on it)."""
        import ray

        version = _unwrapped(lambda: ray.get(self._directory.remove.remote(lora_name)))
        self._set_loras([x for x in self._loras if x.lora_name != lora_name], version)

    def list_loras(self) -> list[LoRARequest]:
        return list(self._loras)

    def stats(self) -> dict:
        """The replicas' engine stats added up (ray/metrics.py shows them per replica)."""
        from ort_lora.server.ray.metrics import cluster_totals

        return cluster_totals(self.replicas)


def _replica_gone() -> tuple[type[BaseException], ...]:
    """What Ray raises when the replica a request was on is gone."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import ReplicaUnavailableError

    return (RayActorError, ReplicaUnavailableError)


def _one_adapter(lora_request):
    """The request's one adapter (or None): Ray routes a request by one adapter name, so a
    composition of several adapters (or one at a weight other than 1) is refused, 400."""
    if lora_request is None:
        return None
    loras = [lora_request] if isinstance(lora_request, LoRARequest) else list(lora_request)
    if len(loras) == 1 and loras[0].weight == 1.0:
        return loras[0]
    raise CompositionError(
        "composed requests (several adapters, or one at a weight other than 1) are not served "
        "by `ort-lora serve --ray`: Ray routes a request by one adapter; send one adapter, or "
        "serve compositions from a single-process `ort-lora serve`"
    )


def _unwrapped(call):
    """call(), with an actor method's exception re-raised as itself (Ray wraps it in a
    RayTaskError that carries the actor's traceback in its message)."""
    from ray.exceptions import RayTaskError

    try:
        return call()
    except RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, Exception):
            raise cause from None
        raise
