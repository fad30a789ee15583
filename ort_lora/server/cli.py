"""`ort-lora serve [MODEL_DIR] [options]`: the OpenAI-compatible server.

Without MODEL_DIR it serves the default model (SmolLM2-135M-Instruct, exported on first use)
with the bundled demo adapters.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

from ort_lora.config import page_bytes
from ort_lora.lora_request import LoRARequest
from ort_lora.runtime.cuda_pool import CudaError
from ort_lora.server.limits import DEFAULT_MAX_REQUEST_BYTES
from ort_lora.server.structured import TOOL_PARSERS


def parse_lora_module(text: str) -> tuple[str, str]:
    """`name=path`, or vLLM's JSON form `{"name": ..., "path": ...}` -> (name, path)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"--lora-modules: invalid JSON {text!r}: {exc}")
        if not isinstance(spec, dict) or not spec.get("name") or not spec.get("path"):
            raise argparse.ArgumentTypeError(
                f'--lora-modules: JSON form needs "name" and "path", got {text!r}'
            )
        return str(spec["name"]), str(spec["path"])
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(
            f"--lora-modules: expected name=path or JSON, got {text!r}"
        )
    return name, path


def positive_bytes(text: str) -> int:
    """A byte count of at least 1 KiB (a smaller limit would refuse ordinary requests)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a byte count, got {text!r}") from None
    if value < 1024:
        raise argparse.ArgumentTypeError(f"expected at least 1024 bytes, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ort-lora serve",
        description="Serve a model and its LoRA adapters over the OpenAI API.",
    )
    p.add_argument(
        "model_dir", nargs="?", help="exported model dir (default: SmolLM2 + demo adapters)"
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=[],
        type=parse_lora_module,
        metavar="NAME=PATH",
        help='adapters to serve: name=path or \'{"name": ..., "path": ...}\'',
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        help="require `Authorization: Bearer KEY` on /v1 routes, /tokenize, /detokenize and "
        "/metrics",
    )
    p.add_argument(
        "--allow-unauthenticated-metrics",
        action="store_true",
        help="serve /metrics without the API key (for a Prometheus scraper; it lists the "
        "served adapters' names)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=positive_bytes,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request body; a larger one is refused with 413 as it streams in "
        "(default: %(default)s = 2 MiB)",
    )
    p.add_argument(
        "--adapter-root",
        help="enable /v1/load_lora_adapter and /v1/unload_lora_adapter; paths must be in here",
    )
    p.add_argument("--served-model-name", help="name of the base model in the API")
    p.add_argument(
        "--max-loras",
        type=int,
        help="upper bound on distinct adapters in one step (default: none beyond the pool: as "
        "many as fit beside the running sequences' KV)",
    )
    p.add_argument("--max-cpu-loras", type=int, help="adapters kept in host memory")
    p.add_argument(
        "--no-preload-adapters",
        dest="preload_adapters",
        action="store_false",
        default=None,
        help="do not copy adapters into free pool pages when they are registered (they are "
        "then read from disk in their first request's step)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the KV cache of prompt prefixes already computed under the same adapter "
        "(default: on)",
    )
    p.add_argument(
        "--base-graph",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the steps that use no adapter on a copy of the graph without its LoRA nodes "
        "(default: where it shares the weights, i.e. int4 QuantMatMul exports on CPU)",
    )
    p.add_argument("--max-num-seqs", type=int, help="sequences in one step")
    p.add_argument("--max-num-batched-tokens", type=int, help="tokens in one step")
    p.add_argument("--max-model-len", type=int, help="prompt + output tokens of one request")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--num-pages", type=int, help="pool size in pages")
    pool.add_argument(
        "--pool-memory-mb",
        type=int,
        help="pool size in MiB (default: 10%% of the host memory available at start, less the "
        "weights, within [256, 4096]; cuda: 512)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where to run (cuda needs onnxruntime-gpu; that path has not yet run end to end on "
        "a GPU: docs/CUDA.md)",
    )
    p.add_argument("--max-queued-requests", type=int, default=1024, help="beyond this, answer 503")
    p.add_argument(
        "--tool-call-parser",
        choices=list(TOOL_PARSERS),
        help='read tool calls out of outputs for tool_choice "auto" (default: the one the chat '
        "template implies: hermes for a template that ignores tools or writes <tool_call>; "
        'none for other formats, where "auto" is a 400)',
    )
    p.add_argument(
        "--allow-unknown-fields",
        action="store_true",
        help="ignore request fields the API does not define (default: a 400 naming them)",
    )
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests bring their own chat_template (rendered sandboxed, bounded)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    ray = p.add_argument_group("scale-out on a Ray cluster (docs/SCALE_OUT.md)")
    ray.add_argument("--ray", action="store_true", help="serve replicas through Ray Serve")
    ray.add_argument("--num-replicas", type=int, help="engine replicas (default 2)")
    ray.add_argument(
        "--max-adapters-per-replica", type=int, help="adapters one replica holds (default 8)"
    )
    ray.add_argument("--replica-cpus", type=float, help="CPUs Ray reserves per replica (1)")
    ray.add_argument(
        "--ray-address", help="default: start a local Ray; auto: join the running cluster"
    )
    ray.add_argument(
        "--max-ongoing-requests",
        type=int,
        help="requests Ray sends one replica at once; more go to other replicas (default "
        "--max-num-seqs or 64)",
    )
    ray.add_argument(
        "--ray-routing",
        choices=["adapter", "default"],
        help="adapter (default): an adapter's requests go to replicas holding it; "
        "default: Ray's power-of-two routing (the baseline)",
    )
    return p


RAY_ONLY = ("num_replicas", "max_adapters_per_replica", "replica_cpus", "ray_address")
RAY_ONLY += ("max_ongoing_requests", "ray_routing")


def engine_overrides(args: argparse.Namespace) -> dict:
    """EngineConfig fields given on the command line."""
    names = ("max_loras", "max_cpu_loras", "max_num_seqs", "max_num_batched_tokens")
    names += ("max_model_len", "num_pages", "preload_adapters", "enable_prefix_caching")
    names += ("base_graph",)
    overrides = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    if args.pool_memory_mb is not None:
        overrides["pool_memory_bytes"] = args.pool_memory_mb << 20
    return overrides


def resolve_model(args: argparse.Namespace) -> tuple[Path, list[tuple[str, str]]]:
    """The model dir and the adapters to register (demo adapters for the default model)."""
    modules = list(args.lora_modules)
    if args.model_dir:
        return Path(args.model_dir), modules
    from ort_lora.server.default_model import demo_adapters, ensure_default_model

    demos = [(name, str(path)) for name, path in demo_adapters().items()]
    return ensure_default_model(progress=True, device=args.device), demos + modules


def build_app(args: argparse.Namespace):
    """Engine + adapters + FastAPI app, from parsed arguments."""
    from ort_lora.engine.async_engine import AsyncEngine
    from ort_lora.server.app import create_app

    if args.device == "cuda":  # before a possibly long export of the default model
        from ort_lora.runtime.cuda_pool import require_cuda

        require_cuda()
    model_dir, modules = resolve_model(args)
    engine = AsyncEngine.from_model_dir(
        model_dir,
        max_queued_requests=args.max_queued_requests,
        device=args.device,
        **engine_overrides(args),
    )
    names = [name for name, _ in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules: duplicate adapter names in {names}")
    base = args.served_model_name or engine.model_name
    if base in names:
        raise ValueError(f"--lora-modules: {base!r} is the base model's name")
    for i, (name, path) in enumerate(modules, start=1):
        engine.add_lora(LoRARequest(name, i, str(Path(path).expanduser().resolve())))
    return create_app(
        engine,
        api_key=args.api_key,
        adapter_root=args.adapter_root,
        served_model_name=args.served_model_name,
        model_root=str(model_dir),
        trust_request_chat_template=args.trust_request_chat_template,
        tool_call_parser=args.tool_call_parser,
        allow_unknown_fields=args.allow_unknown_fields,
        max_request_bytes=args.max_request_bytes,
        allow_unauthenticated_metrics=args.allow_unauthenticated_metrics,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.adapter_root is not None and not Path(args.adapter_root).is_dir():
        root = args.adapter_root
        print(f"ort-lora serve: --adapter-root {root} is not a directory", file=sys.stderr)
        return 2
    given = [f"--{n.replace('_', '-')}" for n in RAY_ONLY if getattr(args, n) is not None]
    if given and not args.ray:
        print(f"ort-lora serve: {', '.join(given)} need --ray", file=sys.stderr)
        return 2
    if args.ray:
        from ort_lora.server.ray.serve import serve_on_ray

        return serve_on_ray(args, *resolve_model(args), engine_overrides(args))
    try:
        listener = listen(args.host, args.port)  # before the model loads: a taken port fails fast
    except OSError as exc:
        print(f"ort-lora serve: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    try:
        app = build_app(args)
    except (ValueError, FileNotFoundError, OSError, CudaError) as exc:
        listener.close()
        print(f"ort-lora serve: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    for line in served_summary(app.state.engine, args, listener):
        print(f"ort-lora serve: {line}", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, log_level=args.log_level)
    uvicorn.Server(config).run(sockets=[listener])
    return 0


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (IPv4 or IPv6); OSError when it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


def served_summary(engine, args: argparse.Namespace, listener: socket.socket) -> list[str]:
    """What the server serves and where, said once at start."""
    inner = engine.engine  # the LLMEngine behind the AsyncEngine
    manifest, config = inner.manifest, inner.config
    quant = manifest.quantization or {}
    weights = quant.get("weights", manifest.dtype)
    names = [lora.lora_name for lora in engine.list_loras()]
    pool_mib = config.num_pages * page_bytes(manifest) / 2**20
    host, port = listener.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    root = f"; run-time loading from {args.adapter_root}" if args.adapter_root else ""
    return [
        f"model {args.served_model_name or engine.model_name} ({inner.model_dir}; "
        f"{manifest.model_type}, {manifest.num_layers} layers, weights {weights}, {args.device})",
        f"adapters {', '.join(names) if names else '(none)'}{root}",
        f"pool {config.num_pages} pages of {config.block_size} tokens ({pool_mib:.0f} MiB), "
        f"max_loras {config.max_loras}, max_num_seqs {config.max_num_seqs}, "
        f"max_model_len {config.max_model_len}, prefix caching "
        f"{'on' if config.enable_prefix_caching else 'off'}, base graph "
        f"{'on' if inner.runner.session.base is not None else 'off'}",
        f"listening on http://{host}:{port} (OpenAI API under /v1)",
    ]
