"""The parts of `ort-lora serve --ray` that need no Ray cluster: the output stream's delta
codec and error values, a replica's adapter bookkeeping, the adapter directory, the cluster's
/metrics page, the config and the CLI's checks, and the ingress's client over a fake
deployment handle (that one needs Ray's exception types), the KubeRay manifest, and the
bench's cluster section (its comparison and projection). The cluster itself:
tests/test_ray_cluster.py."""

from __future__ import annotations

import asyncio
import importlib.util
import pickle
from dataclasses import replace
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ort_lora.adapters.errors import AdapterError, AdapterNotFoundError
from ort_lora.bench.harness.servers import ServerThread
from ort_lora.errors import EngineUnavailable, QueueFullError, RequestError
from ort_lora.lora_request import LoRARequest
from ort_lora.outputs import CompletionOutput, Logprob, RequestOutput
from ort_lora.sampling_params import SamplingParams
from ort_lora.server import create_app
from ort_lora.server.errors import APIError
from ort_lora.server.ray.config import RayServeConfig
from ort_lora.server.ray.directory import AdapterDirectory
from ort_lora.server.ray.metrics import ClusterPage, cluster_page, cluster_totals
from ort_lora.server.ray.residency import AdapterBusy, ReplicaAdapters
from ort_lora.server.ray.stream import DecodeError, DeltaDecoder, DeltaEncoder, ReplicaError

HAS_RAY = importlib.util.find_spec("ray") is not None

# ---- the stream: deltas and errors -------------------------------------------------------------


def cumulative_outputs(rng, n: int, steps: int, logprobs: bool, shrink_at: int | None = None):
    """`steps` cumulative RequestOutputs of one request with n completions; at `shrink_at`
    completion 0's text loses its last characters (as a stop string cut would)."""
    texts, ids, lps = [""] * n, [[] for _ in range(n)], [[] for _ in range(n)]
    outs = []
    for step in range(steps):
        completions = []
        for i in range(n):
            new = [int(t) for t in rng.integers(0, 256, int(rng.integers(0, 3)))]
            ids[i] += new
            texts[i] += "".join(chr(97 + t % 26) for t in new)
            lps[i] += [{t: Logprob(-float(rng.random()), 1)} for t in new]
            if step == shrink_at and i == 0:
                texts[i] = texts[i][: max(0, len(texts[i]) - 2)]
            done = step == steps - 1
            completions.append(
                CompletionOutput(
                    i,
                    texts[i],
                    list(ids[i]),
                    -float(step),
                    [dict(p) for p in lps[i]] if logprobs else None,
                    "length" if done else None,
                )
            )
        out = RequestOutput("r1", "prompt", [1, 2, 3], None, completions, step == steps - 1)
        outs.append(out)
    return outs


@pytest.mark.parametrize(
    "n, logprobs, shrink_at", [(1, False, None), (3, True, None), (2, True, 4)]
)
def test_deltas_rebuild_every_cumulative_output(rng, n, logprobs, shrink_at):
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    sent = 0
    for out in cumulative_outputs(rng, n, 12, logprobs, shrink_at):
        delta = pickle.loads(pickle.dumps(encoder.encode(out)))  # as Ray carries it
        assert decoder.decode(delta) == out
        sent += sum(len(d.token_ids) for d in delta.completions)
    assert sent == sum(len(c.token_ids) for c in out.outputs)  # each token travels once


def test_a_stream_without_its_head_is_refused(rng):
    encoder = DeltaEncoder()
    first, second = (encoder.encode(o) for o in cumulative_outputs(rng, 1, 2, False))
    assert first.head is not None and second.head is None
    with pytest.raises(DecodeError):
        DeltaDecoder().decode(second)


@pytest.mark.parametrize(
    "exc, status, code, param",
    [
        (RequestError("max_tokens is too large", "max_tokens"), 400, None, "max_tokens"),
        (QueueFullError("full"), 503, "queue_full", None),
        (EngineUnavailable("stopped"), 503, "engine_unavailable", None),
        (AdapterNotFoundError("adapter not found: 'x'"), 404, "model_not_found", "model"),
        (AdapterError("bad weights"), 400, "adapter_load_failed", "model"),
        (RuntimeError("secret detail"), 500, "internal_error", None),
    ],
)
def test_replica_errors_carry_the_http_error(exc, status, code, param):
    err = pickle.loads(pickle.dumps(ReplicaError.of(exc, "request r1")))
    api = err.api_error()
    assert isinstance(api, APIError)
    assert (api.status, api.code, api.param) == (status, code, param)
    if status == 500:  # only the error id travels; the text is in the replica's log
        assert "secret" not in api.message and api.message.startswith("internal error ")
    if status == 503 and code == "queue_full":
        assert api.headers == {"Retry-After": "1"}


# ---- a replica's adapters ----------------------------------------------------------------------

A1, A1_NEW, B = LoRARequest("a", 1, "/x/a"), LoRARequest("a", 7, "/x/a2"), LoRARequest("b", 2, "/b")


def registered(adapters: ReplicaAdapters, lora: LoRARequest) -> ReplicaAdapters:
    assert adapters.to_register(lora) == (True, None)
    adapters.did_register(lora)
    return adapters


def test_hits_misses_and_loads_are_counted():
    adapters = ReplicaAdapters()
    assert adapters.arrive(A1) is False  # a miss: not registered yet
    registered(adapters, A1)
    assert adapters.to_register(A1) == (False, None)  # a second request: nothing to do
    assert adapters.arrive(A1) is True
    assert adapters.counters["a"] == {"hits": 1, "misses": 1, "loads": 1, "evictions": 0}
    assert adapters.in_use() == {"a": 2}


def test_an_evicted_adapter_leaves_when_its_last_request_ends():
    adapters = ReplicaAdapters()
    adapters.arrive(A1)
    registered(adapters, A1)
    adapters.arrive(A1)
    assert adapters.evict("a") is False  # two requests still stream with it
    assert adapters.release(A1) is False
    assert adapters.release(A1) is True  # the last one: unregister now
    adapters.did_unregister("a")
    assert adapters.registered == {} and adapters.counters["a"]["evictions"] == 1
    assert adapters.evict("a") is False  # gone: nothing to do


def test_an_adapter_wanted_again_before_it_left_stays():
    adapters = ReplicaAdapters()
    adapters.arrive(A1)
    registered(adapters, A1)
    assert adapters.evict("a") is False
    assert adapters.arrive(A1) is True  # Ray loads it again: still registered here
    assert adapters.release(A1) is False
    assert adapters.release(A1) is False
    assert adapters.leaving_and_idle("a") is False and "a" in adapters.registered


def test_a_name_loaded_again_replaces_its_idle_registration_only():
    adapters = registered(ReplicaAdapters(), A1)
    assert adapters.to_register(A1_NEW) == (True, A1)  # idle: remove the old one first
    adapters.arrive(A1)
    with pytest.raises(AdapterBusy, match="still use the old one"):
        adapters.to_register(A1_NEW)


def test_adapters_the_registry_no_longer_serves_are_dropped():
    adapters = registered(registered(ReplicaAdapters(), A1), B)
    adapters.arrive(B)
    # "a" came back under a new id, "b" was unloaded (and is in use: it leaves later)
    assert adapters.drop_unknown({"a": 7}) == ["a"]
    assert adapters.release(B) is True


# ---- the adapter directory ---------------------------------------------------------------------


def test_directory_ids_are_never_reused():
    directory = AdapterDirectory([("a", "/x/a"), ("b", "/x/b")])
    assert [(x.lora_name, x.lora_int_id) for x in directory.adapters()] == [("a", 1), ("b", 2)]
    assert directory.remove("a") == directory.version == 3  # each change counts
    lora, version = directory.add("a", "/x/a")
    assert (lora.lora_int_id, version) == (3, 4)
    with pytest.raises(AdapterError, match="already been loaded"):
        directory.add("b", "/y")
    with pytest.raises(AdapterError, match="not allowed"):
        directory.add("bad name", "/y")
    with pytest.raises(AdapterNotFoundError):
        directory.remove("zzz")


def test_directory_reports_expire():
    directory = AdapterDirectory([("a", "/x/a")], report_ttl_s=0.0)
    assert directory.report("r1", {"pid": 1}) == {"a": 1}
    assert directory.snapshot()[2] == {}  # older than the ttl: the replica is gone
    directory.report_ttl_s = 60.0
    directory.report("r2", {"pid": 2})
    assert directory.snapshot() == (1, directory.adapters(), {"r2": {"pid": 2}})


# ---- /metrics ----------------------------------------------------------------------------------


def figures(running: int, pool: dict, adapters: dict, counters: dict, held: list, pid: int):
    stats = {"running": running, "waiting": 0, "preemptions": 1, "pool": pool, "adapters": adapters}
    where = {"pid": pid, "node": "10.0.0.1", "time": 1.7e9 + pid}  # report time: per replica
    return {"stats": stats, "adapters": counters, "held": held, **where}


REPLICAS = {
    "r1": figures(
        2,
        {"kv": 3, "adapter": 4, "free": 9},
        {"a": {"resident": "device", "loads": 1}},
        {"a": {"hits": 3, "misses": 1, "loads": 1, "evictions": 0}},
        ["a"],
        101,
    ),
    "r2": figures(
        1,
        {"kv": 1, "adapter": 0, "free": 15},
        {"a": {"resident": "host", "loads": 2}},
        {"a": {"hits": 0, "misses": 4, "loads": 2, "evictions": 1}},
        [],
        102,
    ),
}
RAY_PAGE = '# HELP ray_x X\n# TYPE ray_x gauge\nray_x{{NodeAddress="{}"}} 1.0\n'


def samples(text: str) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_cluster_totals_add_up_the_replicas():
    totals = cluster_totals(REPLICAS)
    assert (totals["running"], totals["preemptions"]) == (3, 2)
    assert totals["pool"] == {"kv": 4, "adapter": 4, "free": 24}
    assert totals["adapters"] == {"a": {"resident": "device", "loads": 3}}


class FakeCluster:
    """What create_app reads of an engine, and the replicas' figures."""

    model_name, max_model_len, max_queued_requests, error = "base", 64, 8, None
    tokenizer = SimpleNamespace(max_token_bytes=16)  # the ingress has the model's (ray_client)

    def __init__(self, replicas):
        self.replicas = replicas

    async def start(self):
        pass

    async def stop(self):
        pass

    def list_loras(self):
        return []

    def stats(self):
        return cluster_totals(self.replicas)


def test_cluster_metrics_page():
    """Engine families once per replica (never unlabelled), the affinity figures, the
    ingress's own request metrics, and Ray's pages of two nodes merged into one family."""
    client = FakeCluster(REPLICAS)

    async def ray_pages():
        return [RAY_PAGE.format("n1"), RAY_PAGE.format("n2")]

    app = create_app(client, metrics_page=cluster_page(client, ray_metrics=ray_pages))
    with ServerThread(app) as url:
        text = httpx.get(url + "/metrics").text
    got = samples(text)
    assert got[("ort_lora:num_requests_running", (("replica", "r1"),))] == 2
    assert got[("ort_lora:num_requests_running", (("replica", "r2"),))] == 1
    assert ("ort_lora:num_requests_running", ()) not in got
    hits = (
        "ort_lora:cluster_adapter_requests_total",
        (("lora_name", "a"), ("replica", "r1"), ("result", "hit")),
    )
    assert got[hits] == 3
    assert got[("ort_lora:cluster_adapter_hit_rate", ())] == 3 / 8
    assert got[("ort_lora:cluster_adapter_replicas", (("lora_name", "a"),))] == 1
    assert (
        got[
            (
                "ort_lora:cluster_replica_info",
                (("node", "10.0.0.1"), ("pid", "101"), ("replica", "r1")),
            )
        ]
        == 1
    )
    stamp = "ort_lora:cluster_replica_report_timestamp_seconds"
    assert got[(stamp, (("replica", "r1"),))] == 1.7e9 + 101
    assert got[(stamp, (("replica", "r2"),))] == 1.7e9 + 102
    assert text.count("# TYPE ray_x gauge") == 1
    assert got[("ray_x", (("NodeAddress", "n2"),))] == 1
    assert "# TYPE ort_lora:time_to_first_token_seconds histogram" in text


def test_cluster_metrics_page_without_replicas():
    page = ClusterPage(create_app(FakeCluster({})).state.metrics.registry, {}, [])
    from prometheus_client import generate_latest

    got = samples(generate_latest(page).decode())
    assert got[("ort_lora:cluster_adapter_hit_rate", ())] == 0.0


def test_cluster_metrics_page_needs_the_api_key():
    """The cluster's /metrics replaces the engine's route, and stays behind the key."""
    client = FakeCluster(REPLICAS)

    async def no_pages():
        return []

    app = create_app(client, api_key="sk-ray", metrics_page=cluster_page(client, no_pages))
    with ServerThread(app) as url:
        anonymous = httpx.get(url + "/metrics")
        keyed = httpx.get(url + "/metrics", headers={"Authorization": "Bearer sk-ray"})
    assert anonymous.status_code == 401, anonymous.text
    assert anonymous.json()["error"]["code"] == "invalid_api_key"
    assert 'replica="r1"' not in anonymous.text
    assert keyed.status_code == 200 and 'replica="r1"' in keyed.text


# ---- config and CLI ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_replicas", 0),
        ("max_adapters_per_replica", True),
        ("replica_cpus", 0),
        ("app_name", ""),
    ],
)
def test_config_refuses(field, value):
    with pytest.raises(ValueError, match=field):
        RayServeConfig(model_dir="/m", **{field: value})


def test_cli_ray_flags_need_ray(capsys):
    from ort_lora.server.cli import main

    assert main(["/m", "--num-replicas", "3", "--ray-routing", "default"]) == 2
    assert "--num-replicas, --ray-routing need --ray" in capsys.readouterr().err


@pytest.mark.skipif(not HAS_RAY, reason="ray is not installed (pip install 'ort-lora[ray]')")
def test_cli_ray_checks_adapter_names_before_starting_ray(capsys, tmp_path):
    from ort_lora.server.cli import main

    args = [str(tmp_path / "m"), "--ray", "--lora-modules", "a=/x", "a=/y"]
    assert main(args) == 2
    assert "duplicate adapter names" in capsys.readouterr().err
    assert main([str(tmp_path / "m"), "--ray", "--lora-modules", "m=/x"]) == 2
    assert "base model's name" in capsys.readouterr().err


# ---- the ingress's client over a fake handle ---------------------------------------------------


class FakeStream:
    """A DeploymentResponseGenerator: yields the script's items, raises its exceptions."""

    def __init__(self, script):
        self.script, self.cancelled = script, False

    def __aiter__(self):
        return self._items()

    async def _items(self):
        for item in self.script:
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self):
        self.cancelled = True


class FakeHandle:
    """handle.options(...).generate.remote(...) -> the next script's FakeStream."""

    def __init__(self, *scripts):
        self.scripts, self.options_seen, self.streams = list(scripts), [], []

    def options(self, **options):
        self.options_seen.append(options)
        return self

    @property
    def generate(self):
        return self

    def remote(self, *args):
        self.streams.append(FakeStream(self.scripts.pop(0)))
        return self.streams[-1]


@pytest.fixture
def make_client(tiny_llama_export):
    pytest.importorskip("ray", reason="the client's failure handling uses Ray's exceptions")
    from ort_lora.server.ray.client import ReplicaClient

    def make(handle, multiplexed=True):
        config = RayServeConfig(model_dir=str(tiny_llama_export), multiplexed=multiplexed)
        return ReplicaClient(handle, None, config, max_model_len=64)

    return make


def deltas(rng, steps=3):
    encoder = DeltaEncoder()
    outs = cumulative_outputs(rng, 1, steps, False)
    return outs, [encoder.encode(o) for o in outs]


def collect(client, lora=None, until=None):
    async def run():
        got = []
        gen = client.generate([1, 2], SamplingParams(max_tokens=3), lora, "req")
        try:
            async for out in gen:
                got.append(out)
                if until is not None and len(got) == until:
                    break
        finally:
            await gen.aclose()
        return got

    return asyncio.run(run())


def test_client_retries_a_replica_gone_before_the_first_output(rng, make_client):
    from ray.exceptions import ActorDiedError

    outs, script = deltas(rng)
    handle = FakeHandle([ActorDiedError()], script)
    assert collect(make_client(handle), A1) == outs
    assert [o["multiplexed_model_id"] for o in handle.options_seen] == ["a", "a"]


def test_client_fails_a_request_whose_replica_died_after_it_started(rng, make_client):
    from ray.exceptions import ActorDiedError

    _, script = deltas(rng)
    handle = FakeHandle([script[0], ActorDiedError()])
    with pytest.raises(EngineUnavailable, match="stopped"):
        collect(make_client(handle), A1)
    assert len(handle.streams) == 1  # never retried: the client had its first output


def test_client_raises_the_replicas_error(make_client):
    handle = FakeHandle([ReplicaError(400, "max_tokens is too large", "max_tokens")])
    with pytest.raises(APIError) as info:
        collect(make_client(handle, multiplexed=False), A1)
    assert (info.value.status, info.value.param) == (400, "max_tokens")
    assert handle.options_seen == [{"stream": True, "multiplexed_model_id": ""}]


def test_client_refuses_compositions_and_unwraps_a_list_of_one(rng, make_client):
    from ort_lora.adapters.errors import CompositionError
    from ort_lora.server.errors import api_error

    outs, script = deltas(rng)
    handle = FakeHandle(script)
    client = make_client(handle)
    for composed in ([A1, replace(B, weight=0.5)], [replace(A1, weight=0.5)], replace(B, weight=2)):
        with pytest.raises(CompositionError, match="not served by `ort-lora serve --ray`") as info:
            collect(client, composed)
        assert api_error(info.value).status == 400
    assert handle.streams == []  # nothing reached a replica
    assert collect(client, [A1]) == outs
    assert handle.options_seen[0]["multiplexed_model_id"] == "a"


def test_client_keeps_its_adapters_newer_than_a_stale_snapshot(make_client):
    client = make_client(FakeHandle())
    assert isinstance(client.error, EngineUnavailable)  # no replica has reported yet
    client._set_loras([A1], version=3)  # after a load
    client._set_loras([], version=2)  # a snapshot read before it
    assert client.list_loras() == [A1]
    client.replicas = REPLICAS
    assert client.error is None and client.stats()["running"] == 3


def test_client_cancels_a_stream_left_early(rng, make_client):
    _, script = deltas(rng, steps=4)
    handle = FakeHandle(script)
    client = make_client(handle)
    assert len(collect(client, None, until=1)) == 1
    assert handle.streams[0].cancelled and handle.options_seen[0]["multiplexed_model_id"] == ""


# ---- --lora-modules outside --adapter-root -----------------------------------------------------


class ReplicaHandle:
    """handle.options(...).generate.remote(...) -> an in-process replica's own stream."""

    def __init__(self, replica):
        self.replica = replica

    def options(self, **options):
        return self

    @property
    def generate(self):
        return self

    def remote(self, *args):
        return ReplicaStream(self.replica.generate(*args))


class ReplicaStream:
    """A DeploymentResponseGenerator over the replica's generator."""

    def __init__(self, items):
        self.items = items

    def __aiter__(self):
        return self.items

    def cancel(self):
        pass  # the client leaves a stream early only after an error: the replica's last item


@pytest.fixture
def make_replica(monkeypatch):
    """async make(config) -> a started LoraReplica outside Ray: Serve's multiplexed loader is
    a plain cache, and there is no adapter directory to report to."""
    pytest.importorskip("ray", reason="the replica imports Ray Serve")
    import ray
    from ray import serve

    from ort_lora.server.ray.replica import LoraReplica

    def multiplexed(max_num_models_per_replica):
        def wrap(load):
            held = {}

            async def get(name):
                if name not in held:
                    held[name] = await load(name)
                return held[name]

            return get

        return wrap

    def no_directory(*args, **kwargs):
        raise ValueError("no adapter directory in this test")

    context = SimpleNamespace(replica_id=SimpleNamespace(unique_id="r0"))
    monkeypatch.setattr(serve, "multiplexed", multiplexed)
    monkeypatch.setattr(serve, "get_replica_context", lambda: context)
    monkeypatch.setattr(ray, "get_actor", no_directory)

    class Replica(LoraReplica):
        def __del__(self):  # Ray awaits LoraReplica's async __del__; garbage collection would not
            pass

        async def stop(self):
            await LoraReplica.__del__(self)

    async def make(config: RayServeConfig) -> Replica:
        replica = Replica.__new__(Replica)
        await replica.__init__(config)  # as Ray Serve builds it: an async __init__
        return replica

    return make


def test_lora_modules_outside_the_adapter_root_are_served(
    tiny_llama_export, tiny_qv_adapter, tmp_path, make_replica
):
    """As in the single-process server, --adapter-root governs adapters loaded at run time
    only: a --lora-modules adapter outside it (docs/SCALE_OUT.md's quick start) is registered
    on the replica and served; a run-time adapter there is refused by the ingress's client
    and by the replica."""
    from ort_lora.adapters.errors import AdapterPathError
    from ort_lora.server.ray.client import ReplicaClient

    (root := tmp_path / "root").mkdir()
    outside = str(tiny_qv_adapter)
    config = RayServeConfig(
        model_dir=str(tiny_llama_export),
        lora_modules=[("qv", outside)],
        adapter_root=str(root),
        engine_options=dict(intra_op_num_threads=1),
    )
    static, late = LoRARequest("qv", 1, outside), LoRARequest("late", 2, outside)

    async def run():
        replica = await make_replica(config)
        try:
            client = ReplicaClient(ReplicaHandle(replica), None, config, max_model_len=64)
            client._set_loras([static], version=1)  # the directory's start-up adapters
            params = SamplingParams(max_tokens=3, ignore_eos=True)
            outs = [o async for o in client.generate([1, 2], params, static, "r1")]
            with pytest.raises(APIError, match="outside the adapter root") as refused:
                async for _ in client.generate([1, 2], params, late, "r2"):
                    pass
            with pytest.raises(AdapterPathError):
                client.add_lora(late)  # /v1/load_lora_adapter's check on the ingress
            return outs, refused.value, replica.engine.list_loras()
        finally:
            await replica.stop()

    outs, refused, registered = asyncio.run(run())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
    assert refused.status == 400
    assert registered == [static]


# ---- the KubeRay manifest ----------------------------------------------------------------------


@pytest.mark.skipif(not HAS_RAY, reason="ray is not installed (pip install 'ort-lora[ray]')")
def test_kuberay_manifest_deploys_the_application():
    """deploy/kuberay/rayservice.yaml: its Serve config passes Ray's schema, names the builder,
    and its args make a valid RayServeConfig; unknown args are refused by name."""
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema

    from ort_lora.server.ray import serve as ray_serve

    path = Path(__file__).parents[1] / "deploy" / "kuberay" / "rayservice.yaml"
    manifest = yaml.safe_load(path.read_text())
    assert manifest["kind"] == "RayService"
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    app = ServeDeploySchema.model_validate(serve_config).applications[0]
    module, _, name = app.import_path.partition(":")
    assert module == ray_serve.__name__ and callable(getattr(ray_serve, name))
    config = ray_serve.config_from_builder_args(app.args)
    assert config.adapter_root == "/adapters" and dict(config.lora_modules)["upper"]
    assert config.app_name == app.name
    with pytest.raises(ValueError, match="unknown ort-lora application args \\['replicas'\\]"):
        ray_serve.config_from_builder_args({**app.args, "replicas": 3})


# ---- the bench's cluster section ---------------------------------------------------------------


def cluster_row(routing: str, registrations: float, ttft_p99: float, replicas_cpu: float) -> dict:
    """A cluster run's results row: 100 requests, 2000 output tokens."""
    extra = dict(
        routing=routing,
        adapter_requests=100.0,
        registrations_per_request=registrations,
        pool_loads_per_request=registrations / 2,
        hit_rate=1 - registrations,
        replicas_per_adapter=1.0,
        requests_per_replica=[50.0, 50.0],
        cpu_by_component={"replicas": replicas_cpu, "ingress": 5.0, "proxy": 3.0, "ray": 2.0},
    )
    return dict(
        label=f"ort-lora Ray, {routing} routing",
        workload="slora-trace-64",
        experiment="cluster",
        output_tokens=2000,
        output_tok_s=20.0,
        ttft_p99_ms=ttft_p99,
        extra=extra,
    )


def test_bench_cluster_section_compares_the_routings_and_projects_the_cost():
    from ort_lora.bench import cluster

    rows = [cluster_row("adapter", 0.1, 900.0, 60.0), cluster_row("default", 0.4, 1200.0, 70.0)]
    text = "\n".join(cluster.markdown(rows + [{**rows[0], "error": "boom", "label": "x"}]))
    assert "registers 4.0x fewer adapters per request" in text
    assert "TTFT p99 900 ms vs 1200 ms" in text
    # adapter run: 30 CPU-ms / token in the replicas, (80 + 20) CPU-ms / request over 20
    # tokens = 5 ms / token in front: 1000 / 35 tok/s per core, x 8 cores x machines
    assert "| projected output tok/s | 229 | 457 | 914 | 1829 |" in text
    assert "| adapter | 0.100 | 0.050 | 0.900 | 1.00 | [50.0, 50.0] | 30.00 | 80.0 | 20.0 |" in text
    assert cluster.markdown([]) == []
