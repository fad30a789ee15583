"""`ort-lora serve --ray`: the server as a Ray Serve application.

    HTTP ─▶ Ray Serve proxy ─▶ LoraIngress (1 replica): the app of `ort-lora serve` (create_app)
                                 over a ReplicaClient ──handle.options(multiplexed_model_id=
                                 <adapter>)──▶ LoraReplica x num_replicas (one engine each)
            adapter directory (a named Ray actor): adapters served cluster-wide, replica reports

`build_application(config)` creates the directory actor and returns the bound application
(`app_builder(args)`: the same from a Serve config file, as KubeRay deploys it);
`deploy(config, host, port)` starts Serve's HTTP proxy and runs it; `serve_on_ray(...)` is
the CLI's `--ray` path (docs/SCALE_OUT.md).

Ray is imported inside functions: this module imports without it.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from pathlib import Path

from ort_lora.server.ray.client import ReplicaClient
from ort_lora.server.ray.config import DIRECTORY_NAMESPACE, RayServeConfig
from ort_lora.server.ray.directory import AdapterDirectory
from ort_lora.server.ray.metrics import cluster_page
from ort_lora.server.ray.replica import LoraReplica

INSTALL_HINT = (
    "ort-lora serve --ray needs Ray Serve: pip install -e '.[ray]' in the ort-lora checkout"
)


class LoraIngress:
    """The HTTP ingress: the single-process server's app, its engine a ReplicaClient."""

    def __init__(self, replica, config: RayServeConfig):
        self.replica, self.config = replica, config

    async def __serve_build_asgi_app__(self):
        from ort_lora.server.app import create_app

        client = await ReplicaClient.connect(self.replica, self.config)
        c = self.config
        root, model = c.adapter_root, c.model_dir
        return create_app(
            client,
            adapter_root=root,
            model_root=model,
            metrics_page=cluster_page(client),
            **c.app_options,
        )


def start_directory(config: RayServeConfig):
    """The application's adapter directory actor, fresh (a previous one of the same
    application is replaced). Detached: it outlives the process that deployed it; Ray
    restarts it if it dies (with the --lora-modules adapters only)."""
    import ray

    actor = ray.remote(AdapterDirectory)
    name = config.directory_name
    with contextlib.suppress(ValueError):  # ValueError: none yet
        ray.kill(ray.get_actor(name, namespace=DIRECTORY_NAMESPACE))
    options = dict(name=name, namespace=DIRECTORY_NAMESPACE, lifetime="detached")
    directory = actor.options(**options, max_restarts=-1, num_cpus=0).remote(
        list(config.lora_modules)
    )
    ray.get(directory.adapters.remote())  # constructed: bad --lora-modules names fail here
    return directory


def build_application(config: RayServeConfig):
    """The bound Serve application (starts the directory actor)."""
    from ray import serve

    start_directory(config)
    replica = serve.deployment(
        LoraReplica,
        name="LoraReplica",
        num_replicas=config.num_replicas,
        max_ongoing_requests=config.replica_max_ongoing,
        ray_actor_options={"num_cpus": config.replica_cpus},
    ).bind(config)
    ingress = serve.deployment(
        serve.ingress()(LoraIngress),
        name="LoraIngress",
        max_ongoing_requests=config.max_queued_requests,
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(replica, config)


def app_builder(args: dict):
    """The application from a Serve config file's `args` (`import_path:
    ort_lora.server.ray.serve:app_builder`; deploy/kuberay/rayservice.yaml): RayServeConfig's
    fields, `lora_modules` as {name: path}."""
    return build_application(config_from_builder_args(args))


def config_from_builder_args(args: dict) -> RayServeConfig:
    fields = dict(args)
    fields["lora_modules"] = tuple(dict(fields.get("lora_modules") or {}).items())
    unknown = set(fields) - set(RayServeConfig.__dataclass_fields__)
    if unknown:
        known = sorted(RayServeConfig.__dataclass_fields__)
        raise ValueError(f"unknown ort-lora application args {sorted(unknown)}; expected {known}")
    return RayServeConfig(**fields)


def deploy(config: RayServeConfig, host: str, port: int, log_level: str = "info"):
    """Start Serve's HTTP proxy on host:port (unless Serve runs already: its proxy keeps the
    port it has) and run the application until it is ready (Ray must be initialized);
    returns the replica deployment's handle. Serve's per-request access log is an INFO line."""
    from ray import serve

    serve.start(http_options={"host": host, "port": port})
    logging = {"log_level": log_level.upper()}
    app = build_application(config)
    serve.run(app, name=config.app_name, route_prefix="/", logging_config=logging)
    return serve.get_deployment_handle("LoraReplica", app_name=config.app_name)


def undeploy(config: RayServeConfig) -> None:
    """Delete the application and its directory actor."""
    import ray
    from ray import serve

    serve.delete(config.app_name)
    with contextlib.suppress(ValueError):
        ray.kill(ray.get_actor(config.directory_name, namespace=DIRECTORY_NAMESPACE))


def config_from_args(args: argparse.Namespace, model_dir: Path, modules, engine_options):
    """The RayServeConfig of `ort-lora serve --ray ARGS` (flags as the single-process server's,
    plus --num-replicas, --max-adapters-per-replica, --replica-cpus)."""
    import inspect

    from ort_lora.server.app import create_app

    names = [name for name, _ in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules: duplicate adapter names in {names}")
    base = args.served_model_name or Path(model_dir).name
    if base in names:
        raise ValueError(f"--lora-modules: {base!r} is the base model's name")
    own = ("engine", "adapter_root", "model_root", "manage_engine")
    threads = max(1, int(args.replica_cpus or 1))  # ORT's threads: the CPUs Ray reserves
    keywords = [k for k in inspect.signature(create_app).parameters if k not in own]
    return RayServeConfig(
        model_dir=str(Path(model_dir).resolve()),
        lora_modules=tuple((n, str(Path(p).expanduser().resolve())) for n, p in modules),
        engine_options={**engine_options, "device": args.device, "intra_op_num_threads": threads},
        num_replicas=args.num_replicas or 2,
        max_adapters_per_replica=args.max_adapters_per_replica or 8,
        replica_cpus=args.replica_cpus or 1.0,
        replica_max_ongoing=args.max_ongoing_requests or args.max_num_seqs or 64,
        multiplexed=args.ray_routing != "default",
        adapter_root=str(Path(args.adapter_root).resolve()) if args.adapter_root else None,
        max_queued_requests=args.max_queued_requests,
        app_options={k: getattr(args, k) for k in keywords if hasattr(args, k)},
    )


def serve_on_ray(args: argparse.Namespace, model_dir: Path, modules, engine_options) -> int:
    """`ort-lora serve --ray`: connect to Ray (`--ray-address`; default: start a local Ray),
    deploy, serve until SIGINT / SIGTERM, then delete the application."""
    try:
        import ray
    except ImportError:
        print(f"ort-lora serve: {INSTALL_HINT}", file=sys.stderr)
        return 2
    try:
        config = config_from_args(args, model_dir, modules, engine_options)
    except ValueError as exc:
        print(f"ort-lora serve: {exc}", file=sys.stderr)
        return 2
    # "local": a Ray of its own even where one runs already (ray.init's default joins it)
    ray.init(address=args.ray_address or "local", include_dashboard=False)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        deploy(config, args.host, args.port, args.log_level)
        print(f"ort-lora serve --ray: serving on http://{args.host}:{args.port}", flush=True)
        stop.wait()
    finally:
        undeploy(config)
        ray.shutdown()
    return 0
