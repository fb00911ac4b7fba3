"""`streamgrok serve PIPELINE.py`: websocket sessions, the demo page and /metrics on one port."""

from __future__ import annotations

import asyncio
import hmac
import http
import ipaddress
import logging
import os
import signal
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from streamgrok.cache.config import CacheConfig
from streamgrok.engine import Engine
from streamgrok.media.native_pool import NativeMediaPool
from streamgrok.model.loader import LoadedModel
from streamgrok.pipeline.loader import load_pipeline
from streamgrok.pipeline.options import check_client_options
from streamgrok.pipeline.pipeline import Pipeline
from streamgrok.pipeline.resources import SharedResources
from streamgrok.server.connection import ClientConnection
from streamgrok.server.load import CpuMeter, LoadGovernor, LoadLimits, LoadReading
from streamgrok.server.metrics import ServerMetrics

log = logging.getLogger(__name__)
STATIC_DIR = Path(__file__).resolve().parent / "static"
STATIC_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".css": "text/css; charset=utf-8"}
TOKEN_ENV = "STREAMGROK_TOKEN"


@dataclass
class ServerConfig:
    """Limits and security settings of the server."""

    pipeline_path: str
    host: str = "127.0.0.1"
    port: int = 8765
    token: str | None = None
    allowed_origins: list[str] = field(default_factory=list)
    pipeline_options: dict = field(default_factory=dict)
    max_message_bytes: int = 2 * 2**20
    max_text_chars: int = 32_768  # input.text and query text (the engine bounds tokens too)
    max_inflight_queries: int = 4
    max_media_per_second: int = 30
    idle_timeout_s: float = 300.0
    outbound_queue: int = 256
    stats_interval_s: float = 2.0
    max_sessions: int = 32
    media_workers: int = 2  # processes for image decoding and OpenCV detectors
    load_tick_s: float | None = 2.0  # how often the load governor measures (None: never)
    load_limits: LoadLimits = field(default_factory=LoadLimits)
    shutdown_timeout_s: float = 30.0  # SIGTERM: how long in-flight answers may finish
    static_dir: Path = STATIC_DIR

    def __post_init__(self) -> None:
        self.token = self.token or os.environ.get(TOKEN_ENV) or None
        if not _is_loopback(self.host) and not self.token:
            raise ValueError(
                f"binding to {self.host} (not loopback) requires a token: pass --token or set "
                f"{TOKEN_ENV}"
            )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class StreamgrokServer:
    """One engine shared by every client session; one port for websocket and HTTP."""

    def __init__(self, loaded: LoadedModel, config: ServerConfig,
                 cache: CacheConfig | None = None) -> None:
        self.loaded = loaded
        self.config = config
        self.resources = SharedResources(NativeMediaPool(config.media_workers))
        self.pipeline = self.session_pipeline(None)  # fail early; the client allow-list
        ingest = self.pipeline.ingest
        if ingest.audio:  # loaded once, before the first client waits on them
            self.resources.speech_model()
            if ingest.transcribe:
                self.resources.transcriber(ingest.speech_model)
        self.cache_config = cache or CacheConfig()
        self.metrics = ServerMetrics(self.drops)
        self.governor = LoadGovernor(self.resources.degradation, config.load_limits)
        self.cpu = CpuMeter()
        self._governing: asyncio.Task | None = None
        self.closed_drops: Counter = Counter()  # what finished sessions dropped
        self.closed_frames = 0  # frames finished sessions received
        self.engine: Engine | None = None
        self.active_sessions = 0
        self.connections: set[ClientConnection] = set()
        self.server: Server | None = None

    def session_pipeline(self, client_options: dict | None) -> Pipeline:
        """The pipeline of a new session: the server's options, plus what the client may set
        (checked against the pipeline's allow-list); encoders are shared, not reloaded."""
        options = {**self.config.pipeline_options, "live": "true",
                   "hidden_size": self.loaded.config.hidden_size}
        if client_options is not None:
            options.update(check_client_options(self.pipeline.client_options, client_options))
        return load_pipeline(self.config.pipeline_path, options, self.resources)

    async def start(self) -> Server:
        self.engine = Engine(self.loaded, self.cache_config)
        self.engine.start()
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.config.host, self.config.port))
        port = sock.getsockname()[1]  # the real port, also when 0 asked for any
        origins = [None] + [o.rstrip("/") for o in self.config.allowed_origins] + [
            f"http://{h}:{port}" for h in ("127.0.0.1", "localhost", self.config.host)
        ]
        self.server = await serve(
            self._handle, sock=sock,
            process_request=self._process_request, origins=origins,
            max_size=4 * self.config.max_message_bytes, max_queue=32,
            server_header="streamgrok",
        )
        if self.config.load_tick_s is not None:
            self._governing = asyncio.create_task(self._govern())
        return self.server

    async def _govern(self) -> None:
        """Measure the load every tick and let the governor degrade, restore or refuse."""
        received = stale = 0
        decoded, since = self.engine.snapshot()["decode_tokens"], time.monotonic()
        self.cpu.read()
        while True:
            answering = self.backlog_tokens() > 0
            await asyncio.sleep(self.config.load_tick_s)
            new_decoded, now = self.engine.snapshot()["decode_tokens"], time.monotonic()
            # tokens a second the engine decoded, measured over ticks that began with answers
            # in flight (the rate a backlog of answers drains at)
            rate = (new_decoded - decoded) / (now - since) \
                if answering and new_decoded > decoded else None
            decoded, since = new_decoded, now
            drops = self.drops()
            frames = self.closed_frames + sum(c.frame_index for c in self.connections
                                              if c.runner is not None)
            new_stale = drops.get("frames_stale", 0) - stale
            new_frames = frames - received
            received, stale = frames, drops.get("frames_stale", 0)
            cpu, media_cpu = self.cpu.read()
            self.governor.tick(LoadReading(
                cpu=cpu,
                media_cpu=media_cpu,
                ttft_s=max(self.governor.recent_ttft(now), self.oldest_wait(now)),
                stale=new_stale / new_frames if new_frames > 0 else 0.0,
                sessions=self.active_sessions,
                decode_rate=rate,
            ))
            self.metrics.degraded.set(self.resources.degradation.fps_scale)

    def admission(self) -> str:
        """Why a new session is refused now (`busy`), or empty when there is room."""
        if self.active_sessions >= self.config.max_sessions:
            return f"the server is configured for at most {self.config.max_sessions} sessions"
        refused = self.governor.admit(self.active_sessions)
        return f"the server is at its sustainable load: {refused}" if refused else ""

    def oldest_wait(self, now: float) -> float:
        """How long the oldest question still without a first token has waited."""
        return max((c.oldest_wait(now) for c in self.connections), default=0.0)

    def backlog_tokens(self) -> int:
        """Tokens the answers in flight may still generate, over every session."""
        return sum(a.remaining_tokens for c in self.connections for a in c.answers.values())

    def question_admission(self, max_tokens: int) -> str:
        """Why a new question (of up to `max_tokens`) is refused now (`busy`), or empty to
        queue it."""
        if self.config.load_tick_s is None:  # the governor is off
            return ""
        return self.governor.admit_question(self.oldest_wait(time.monotonic()),
                                            self.backlog_tokens(), max_tokens)

    async def stop(self) -> None:
        """Close every connection and stop the engine and media workers (idempotent)."""
        if self._governing is not None:
            self._governing.cancel()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
        if self.engine is not None:
            await self.engine.stop()
        self.resources.close()

    def drops(self) -> dict[str, int]:
        """Everything every session dropped so far, by reason."""
        total = Counter(self.closed_drops)
        for connection in self.connections:
            if connection.runner is not None:
                total.update(connection.drops())
        return dict(total)

    def session_ended(self, drops: dict[str, int], frames: int) -> None:
        """A session ended: what it dropped and received joins the server's totals."""
        self.closed_drops.update(drops)
        self.closed_frames += frames

    @property
    def port(self) -> int:
        return self.server.sockets[0].getsockname()[1] if self.server else self.config.port

    async def _handle(self, ws: ServerConnection) -> None:
        connection = ClientConnection(self, ws)
        self.connections.add(connection)
        try:
            await connection.serve()
        finally:
            self.connections.discard(connection)

    async def drain(self, timeout_s: float) -> None:
        """Graceful stop: accept no one new, let in-flight answers finish for up to
        `timeout_s`, then end every session (`session.ended`, close 1001) and stop."""
        if self.server is not None:
            self.server.close(close_connections=False)
        deadline = asyncio.get_running_loop().time() + timeout_s
        while any(c.answers_in_flight() for c in self.connections):
            if asyncio.get_running_loop().time() >= deadline:
                log.warning("shutdown timeout: cancelling %d answers",
                            sum(c.answers_in_flight() for c in self.connections))
                break
            await asyncio.sleep(0.05)
        await asyncio.gather(*(c.shutdown("server shutting down") for c in list(self.connections)),
                             return_exceptions=True)
        await self.stop()

    def _authorized(self, request: Request) -> bool:
        if not self.config.token:
            return True
        header = request.headers.get("Authorization", "")
        offered = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""
        if not offered:
            offered = (parse_qs(urlsplit(request.path).query).get("token") or [""])[0]
        return hmac.compare_digest(offered.encode(), self.config.token.encode())

    def _process_request(self, connection: ServerConnection, request: Request):
        if not request.path.isprintable():
            return connection.respond(http.HTTPStatus.BAD_REQUEST, "bad request path\n")
        path = urlsplit(request.path).path
        upgrade = request.headers.get("Upgrade", "").lower() == "websocket"
        if upgrade:
            if path != "/ws":
                return connection.respond(http.HTTPStatus.NOT_FOUND, "not found\n")
            if not self._authorized(request):
                return connection.respond(http.HTTPStatus.UNAUTHORIZED, "unauthorized\n")
            return None
        if path == "/metrics":
            if not self._authorized(request):
                return connection.respond(http.HTTPStatus.UNAUTHORIZED, "unauthorized\n")
            body = self.metrics.render(self.engine.snapshot())
            return _response(200, "OK", body, "text/plain; version=0.0.4; charset=utf-8")
        name = "index.html" if path in ("/", "") else path.lstrip("/")
        file = (self.config.static_dir / name).resolve()
        if file.parent != self.config.static_dir.resolve() or not file.is_file() \
                or file.suffix not in STATIC_TYPES:
            return connection.respond(http.HTTPStatus.NOT_FOUND, "not found\n")
        return _response(200, "OK", file.read_bytes(), STATIC_TYPES[file.suffix])


def _response(status: int, reason: str, body: bytes, content_type: str) -> Response:
    headers = Headers([("Content-Type", content_type), ("Content-Length", str(len(body))),
                       ("Cache-Control", "no-store")])
    return Response(status, reason, headers, body)


async def serve_forever(loaded: LoadedModel, config: ServerConfig,
                        cache: CacheConfig | None = None) -> None:
    """Run until SIGTERM or SIGINT, then drain (see `StreamgrokServer.drain`)."""
    server = StreamgrokServer(loaded, config, cache)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"streamgrok serving {config.pipeline_path} on http://{config.host}:{server.port}/ "
          f"(websocket /ws, metrics /metrics)", flush=True)
    try:
        await stop.wait()
        print(f"streamgrok: draining (up to {config.shutdown_timeout_s:g} s for answers in "
              "flight)", flush=True)
        await server.drain(config.shutdown_timeout_s)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await server.stop()
