"""LocalRayCluster: a Ray head node on 127.0.0.1 for tests and benchmarks.

    with LocalRayCluster(num_cpus=2, lifetime_s=600) as cluster:
        with cluster.serve([model, "--num-replicas", "2"]) as url:  # ort-lora serve --ray
            ...

The head runs as `timeout LIFETIME ray start --head --block ...` in a session of its own: it
stops when the context exits (SIGTERM to the session, SIGKILL after a grace period) and, if
this process dies first, when its lifetime runs out. Everything listens on 127.0.0.1 only, on
free ports, with its own temp dir and a fresh token (Ray's token authentication), so it never
touches another Ray instance on the machine (`ray stop` would kill them all; never used).

This process never imports Ray: drivers (`ort-lora serve --ray`) run as child processes with
`cluster.env`, which Ray must see before it is imported (it fixes the node address then).
Serve's HTTP proxy keeps the port the first application set: every `serve` of one cluster
uses `cluster.http_port`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ort_lora.bench.harness.servers import ServeProcess, free_port

# Ray takes the machine's routable address even for 127.0.0.1 unless it believes it runs on
# a laptop (ray_constants.ENABLE_RAY_CLUSTER): this keeps every Ray socket on loopback.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


class LocalRayCluster:
    def __init__(self, num_cpus: int = 2, lifetime_s: float = 600, startup_timeout_s=120.0):
        self.num_cpus = num_cpus
        self.lifetime_s = lifetime_s
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.env: dict[str, str] = {}  # for drivers: os.environ + what Ray needs here
        self.http_port = free_port()

    def __enter__(self) -> LocalRayCluster:
        self.temp_dir = tempfile.mkdtemp(prefix="ortlora-ray-")  # short: Ray's socket paths
        self.env = {
            **os.environ,
            **LOOPBACK_ENV,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(16),
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # stop at once, nothing to drain
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        port = free_port()
        self.address = f"127.0.0.1:{port}"
        with open(Path(self.temp_dir) / "head.log", "w") as log:
            self.proc = subprocess.Popen(
                self._command(port),
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            self._wait_listening(port)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _command(self, port: int) -> list[str]:
        ray_exe = str(Path(sys.executable).with_name("ray"))
        return [
            "timeout",
            "-k",
            "20",
            str(int(self.lifetime_s)),
            ray_exe,
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={self.num_cpus}",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--temp-dir={self.temp_dir}",
        ]

    def _wait_listening(self, port: int) -> None:
        """Until the head's GCS accepts connections (drivers' ray.init waits for the rest)."""
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited ({self.proc.returncode}): {self.log()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"no Ray head at {self.address}: {self.log()}")
            time.sleep(0.5)

    def serve(self, args: list[str], startup_timeout_s: float = 300) -> ServeProcess:
        """`ort-lora serve --ray ARGS` on this cluster (a context manager: the base URL)."""
        ray_args = ["--ray", "--ray-address", self.address, "--host", "127.0.0.1"]
        return ServeProcess(args + ray_args, self.env, startup_timeout_s, port=self.http_port)

    def log(self, tail: int = 4000) -> str:
        path = Path(self.temp_dir) / "head.log"
        return path.read_text(errors="replace")[-tail:] if path.is_file() else ""

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            _stop_session(self.proc)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _stop_session(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM to the head's session (ray start stops its processes), SIGKILL after grace_s
    to whatever is left of it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
