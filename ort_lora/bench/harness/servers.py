"""Run an app under a real uvicorn server on 127.0.0.1, on a free port, in a background
thread (for tests, benchmarks and notebooks).

    with ServerThread(create_app(engine)) as url:
        openai.OpenAI(base_url=url + "/v1", api_key="x").models.list()
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import uvicorn


class ServerThread:
    """Context manager: starts the server, yields its base URL, stops it on exit."""

    def __init__(self, app, host: str = "127.0.0.1", startup_timeout_s: float = 120.0):
        self.app = app
        self.host = host
        self.startup_timeout_s = startup_timeout_s
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None
        self.url = ""

    def __enter__(self) -> str:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()
        self._wait_started()
        self.url = f"http://{self.host}:{port}"
        return self.url

    def _wait_started(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread exited during startup (see its log)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not started after {self.startup_timeout_s} s")
            time.sleep(0.02)

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


class ServeProcess:
    """Context manager: `python -m ort_lora.cli serve ARGS --port P` in a subprocess, waits
    for /health, yields the base URL, terminates the server on exit."""

    def __init__(
        self, args: list[str], env: dict | None = None, startup_timeout_s=180.0, port=None
    ):
        self.args = list(args)
        self.env = env
        self.startup_timeout_s = startup_timeout_s
        self.port = port  # None: a free one
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> str:
        port = self.port or free_port()
        cmd = [sys.executable, "-m", "ort_lora.cli", "serve", *self.args, "--port", str(port)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})}
        self.proc = subprocess.Popen(cmd, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            self._wait_healthy(url)
        except BaseException:
            self.__exit__()
            raise
        return url

    def _wait_healthy(self, url: str) -> None:
        import httpx

        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode}")
            try:
                if httpx.get(url + "/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not healthy after {self.startup_timeout_s} s")
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free at the time of the call."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
