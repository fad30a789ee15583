"""RayServeConfig: everything `ort-lora serve --ray` deploys, in one value that Ray pickles to
the ingress and to every replica."""

from __future__ import annotations

from dataclasses import dataclass, field

DIRECTORY_NAMESPACE = "ort-lora"


@dataclass(frozen=True)
class RayServeConfig:
    """One ort-lora application on a Ray cluster.

    model_dir:        the exported model; every node must see it at this path
    lora_modules:     (name, path) adapters served from the start (paths seen by every node);
                      the operator's own, so adapter_root does not apply to them
    engine_options:   each replica's engine (EngineConfig fields, device, intra_op_num_threads)
    num_replicas:     replicas of the engine deployment
    max_adapters_per_replica: adapters one replica keeps registered (Ray's multiplexed LRU)
    replica_cpus:     CPUs Ray reserves for each replica
    replica_max_ongoing: requests Ray sends one replica at once (more wait in Ray's queue)
    multiplexed:      route adapter requests by adapter (False: Ray's default routing; the
                      benchmark's and the affinity test's baseline)
    adapter_root:     where adapters loaded at run time (/v1/load_lora_adapter) must lie; as
                      for the single-process server, it governs only those
    max_queued_requests: as for the single-process server
    app_options:      the ingress app's other create_app keywords (api_key,
                      served_model_name, ...: `ort-lora serve`'s flags of the same names)
    app_name:         the Ray Serve application; also names the adapter directory actor
    """

    model_dir: str
    lora_modules: tuple[tuple[str, str], ...] = ()
    engine_options: dict = field(default_factory=dict)
    num_replicas: int = 2
    max_adapters_per_replica: int = 8
    replica_cpus: float = 1.0
    replica_max_ongoing: int = 64
    multiplexed: bool = True
    adapter_root: str | None = None
    max_queued_requests: int = 1024
    app_options: dict = field(default_factory=dict)
    app_name: str = "ort-lora"

    def __post_init__(self):
        for name in ("num_replicas", "max_adapters_per_replica", "replica_max_ongoing"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not self.replica_cpus > 0:
            raise ValueError(f"replica_cpus must be > 0, got {self.replica_cpus!r}")
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if not self.app_name:
            raise ValueError("app_name must not be empty")
        object.__setattr__(self, "lora_modules", tuple(tuple(m) for m in self.lora_modules))

    @property
    def directory_name(self) -> str:
        """The adapter directory actor's name (namespace DIRECTORY_NAMESPACE)."""
        return f"{self.app_name}:adapters"

    def root_for(self, name: str, path: str) -> str | None:
        """The directory adapter `name`'s files at `path` must lie in: None for a
        --lora-modules adapter (trusted, as the single-process server trusts them), else
        adapter_root (an adapter loaded at run time)."""
        if (name, str(path)) in {(n, str(p)) for n, p in self.lora_modules}:
            return None
        return self.adapter_root
