"""A loopback HTTP proxy that spreads a load generator's requests over adapters.

guidellm sends every request with one `model`; S-LoRA's trace draws each request's adapter
uniformly at random. The proxy sits between them: each JSON POST body's `model` becomes the
next draw from a seeded uniform choice over `names`, and vLLM's `stream_options.
continuous_usage_stats` extension is dropped (both servers then get the same OpenAI request,
usage once at the end, as OpenAI's own clients ask for it); everything else passes
through byte for byte (SSE streams included). One upstream connection per request
(`Connection: close`), so a response ends when the server closes it.

    proxy = AdapterProxy(upstream_port=8000, names=["a0", ..., "a15"], seed=0)
    port = proxy.start()        # serves on 127.0.0.1:port from a daemon thread
    ...                         # point the load generator at port
    proxy.stop(); proxy.counts  # requests sent to each adapter
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter

import numpy as np


class AdapterProxy:
    def __init__(self, upstream_port: int, names: list[str], seed: int = 0):
        if not names:
            raise ValueError("AdapterProxy needs at least one adapter name")
        self.upstream_port, self.names = upstream_port, list(names)
        self.rng = np.random.default_rng(seed)
        self.counts: Counter[str] = Counter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._port = 0

    def start(self) -> int:
        """Serve from a daemon thread; the port it listens on (127.0.0.1)."""
        threading.Thread(target=self._serve_forever, daemon=True).start()
        if not self._ready.wait(10):
            raise TimeoutError("the adapter proxy did not start within 10 s")
        return self._port

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)

    def _serve_forever(self) -> None:
        self._loop = asyncio.new_event_loop()
        server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0, limit=1 << 24)
        )
        self._port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    def rewrite(self, head: bytes, body: bytes) -> tuple[bytes, bytes]:
        """(head, body) with the body's `model` replaced, Content-Length and Connection set."""
        if body:
            try:
                doc = json.loads(body)
            except ValueError:
                doc = None
            if isinstance(doc, dict) and "model" in doc:
                doc["model"] = self.names[int(self.rng.integers(len(self.names)))]
                self.counts[doc["model"]] += 1
                if isinstance(doc.get("stream_options"), dict):
                    doc["stream_options"].pop("continuous_usage_stats", None)
                body = json.dumps(doc).encode()
        lines = head.split(b"\r\n")
        keep = [ln for ln in lines[1:] if ln and not _is_header(ln, b"content-length")]
        keep = [ln for ln in keep if not _is_header(ln, b"connection")]
        keep += [b"Content-Length: %d" % len(body), b"Connection: close"]
        return b"\r\n".join([lines[0], *keep]) + b"\r\n\r\n", body

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        """One request per client connection: the response says Connection: close."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = _content_length(head)
            head, body = self.rewrite(head, await reader.readexactly(length) if length else b"")
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
            up_writer.write(head + body)
            await up_writer.drain()
            while chunk := await up_reader.read(1 << 16):
                writer.write(chunk)
                await writer.drain()
            up_writer.close()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def _is_header(line: bytes, name: bytes) -> bool:
    return line.split(b":", 1)[0].strip().lower() == name


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        if _is_header(line, b"content-length"):
            return int(line.split(b":", 1)[1])
    return 0
