"""`streamgrok serve PIPELINE.py`: websocket sessions, the OpenAI-compatible HTTP API, the
demo page and /metrics on one port (Starlette on uvicorn)."""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import uvicorn

from streamgrok.cache.config import CacheConfig
from streamgrok.cache.kv_group import KVGroup
from streamgrok.engine import Engine
from streamgrok.engine.config import EngineConfig
from streamgrok.errors import StreamgrokError
from streamgrok.loading.loader import LoadedModel
from streamgrok.media.native_pool import NativeMediaPool
from streamgrok.pipeline.loader import load_pipeline
from streamgrok.pipeline.options import check_client_options
from streamgrok.pipeline.pipeline import Pipeline
from streamgrok.pipeline.resources import SharedResources
from streamgrok.server.access import Access
from streamgrok.server.config import ServerConfig
from streamgrok.server.connection import ClientConnection
from streamgrok.server.load import (
    CpuMeter,
    LoadGovernor,
    LoadReading,
    Refusal,
    decode_rate,
)
from streamgrok.server.metrics import ServerMetrics
from streamgrok.server.refusals import RefusalLog
from streamgrok.server.resumption import ResumeShelf, handle_key
from streamgrok.server.session_context import SessionContext
from streamgrok.server.session_store import Refused, SessionStore

log = logging.getLogger(__name__)


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: `serve_forever` drains on SIGTERM itself."""

    def capture_signals(self):  # noqa: D102
        import contextlib

        return contextlib.nullcontext()


class StreamgrokServer:
    """One engine shared by every client session; one port for websockets and HTTP.

    Give `loaded=None` to start serving (`/health` says 503) before the model is loaded, and
    `await load(model)` when it is."""

    def __init__(self, loaded: LoadedModel | None, config: ServerConfig,
                 cache: CacheConfig | None = None, engine: EngineConfig | None = None,
                 kv_group: KVGroup | None = None) -> None:
        self.config = config
        self.kv_group = kv_group  # KV parallelism: this is rank 0 of these ranks
        self.engine_config = engine
        self.loaded: LoadedModel | None = None
        self.resources = SharedResources(NativeMediaPool(config.media_workers))
        self.cache_config = cache or CacheConfig()
        self.metrics = ServerMetrics(
            self.drops, lambda: self.engine.snapshot() if self.engine is not None else None,
            lambda: self.model_name, self.resumption_numbers, self.resources.speech_stats,
            lambda: {"media": self.governor.session_cpu,
                     "speech": self.governor.session_speech,
                     "engine": self.governor.session_engine})
        self.cpu = CpuMeter()
        self.governor = LoadGovernor(self.resources.degradation, config.load_limits,
                                     cores=self.cpu.cores)
        self.session_refusals = RefusalLog("session", self.metrics.refused)
        self.question_refusals = RefusalLog("question", self.metrics.refused_questions)
        self.answers_shortened = RefusalLog("answer", self.metrics.shortened_answers,
                                            "shortened", "full length")
        self._governing: asyncio.Task | None = None
        self.closed_drops: Counter = Counter()  # what finished sessions dropped
        self.closed_frames = 0  # frames finished sessions received
        self.engine: Engine | None = None
        self.active_sessions = 0
        self.connections: set[ClientConnection] = set()
        self.access = Access(config.token, config.allowed_origins)
        self.shelf = ResumeShelf(config.resume_ttl_s, config.max_detached)
        self.store: SessionStore | None = None  # with --state-dir, once the engine runs
        self._sweeping: asyncio.Task | None = None
        self.accepting = True  # False while draining: new sessions and requests get 503
        self.http: _Uvicorn | None = None
        self._socket: socket.socket | None = None
        self.pipeline: Pipeline | None = None
        self._media_loading: asyncio.Future | None = None
        if loaded is not None:
            self._prepare(loaded)

    def _prepare(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.pipeline = self.session_pipeline(None)  # fail early; the client allow-list

    def _load_media_models(self) -> None:
        ingest = self.pipeline.ingest
        if ingest.audio:
            self.resources.speech_model()
            if ingest.transcribe:
                self.resources.transcriber(ingest.speech_model).warm_up()

    async def media_models(self) -> None:
        """Load the pipeline's speech models (voice activity, the transcriber) on a worker
        thread, once, when the first live session needs them: an idle server, and one
        answering only HTTP text requests, never holds them; a session starting meanwhile
        waits for the load instead of stalling the event loop."""
        if self._media_loading is None:
            self._media_loading = asyncio.ensure_future(
                asyncio.to_thread(self._load_media_models))
        try:
            await asyncio.shield(self._media_loading)
        except Exception:
            self._media_loading = None  # the next session tries again (and reports it)
            raise

    @property
    def ready(self) -> bool:
        """The model is loaded and the engine runs."""
        return self.engine is not None

    @property
    def model_name(self) -> str:
        """The model id the HTTP API lists and accepts."""
        if self.config.model_name:
            return self.config.model_name
        return self.loaded.source.stem if self.loaded is not None else "loading"

    @property
    def replica(self) -> str:
        """This server's name among replicas (in `session.started` and `/health`), so a
        client behind a proxy knows which one holds its session."""
        return self.config.replica or f"{socket.gethostname()}:{self.port}"

    def session_pipeline(self, client_options: dict | None) -> Pipeline:
        """The pipeline of a new session: the server's options, plus what the client may set
        (checked against the pipeline's allow-list); encoders are shared, not reloaded."""
        options = {**self.config.pipeline_options, "live": "true",
                   "hidden_size": self.loaded.config.hidden_size}
        if client_options is not None:
            options.update(check_client_options(self.pipeline.client_options, client_options))
        return load_pipeline(self.config.pipeline_path, options, self.resources)

    async def start(self) -> None:
        """Listen on the port; with a model given at construction, start the engine too."""
        from streamgrok.server.http_app import build_app

        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.config.host, self.config.port))
        except OSError as exc:
            sock.close()
            reason = "is in use" if exc.errno == errno.EADDRINUSE else f"failed: {exc.strerror}"
            raise StreamgrokError(f"cannot listen on {self.config.host}:{self.config.port}: "
                                  f"the port {reason}") from None
        sock.listen(128)
        sock.setblocking(False)
        self._socket = sock
        port = sock.getsockname()[1]  # the real port, also when 0 asked for any
        self.access.origins.update(f"http://{h}:{port}"
                                   for h in ("127.0.0.1", "localhost", self.config.host))
        http_config = uvicorn.Config(
            build_app(self), lifespan="off", ws="websockets-sansio",
            ws_max_size=4 * self.config.max_message_bytes, ws_ping_interval=20.0,
            log_level="warning", access_log=False, server_header=False,
            headers=[("server", "streamgrok")], timeout_graceful_shutdown=5,
        )
        self.http = _Uvicorn(http_config)
        http_config.load()
        self.http.lifespan = http_config.lifespan_class(http_config)
        await self.http.startup(sockets=[sock])
        if self.shelf.enabled:
            self._sweeping = asyncio.create_task(self._sweep_detached())
        if self.loaded is not None:
            self._start_engine()

    def state_identity(self) -> dict:
        """What saved sessions must match to be restored: the model and the KV format."""
        model, cache = self.loaded.config, self.engine.cache.config
        source = self.loaded.source
        return {"model": self.loaded.name,
                "model_bytes": source.stat().st_size if source.is_file() else 0,
                "layers": model.num_layers, "kv_heads": model.num_kv_heads,
                "head_dim": model.head_dim, "vocab": model.vocab_size,
                "kv_dtype": cache.kv_dtype, "page_size": cache.page_size}

    async def restore_saved(self, handle: object) -> None:
        """A resume for a handle this process does not hold: the session saved under it
        in `--state-dir` (by this server's previous process, or by another replica sharing
        the folder) is restored, detached, so the resume can claim it. One of another model
        or KV format, or past its resume time, is remembered as ended, with why."""
        if self.store is None or not isinstance(handle, str):
            return
        key = handle_key(handle)
        if key in self.shelf.entries:
            return
        saved = await asyncio.to_thread(self.store.load, key)
        if saved is None:
            return
        if isinstance(saved, Refused):
            self.shelf.retire(key, f"the saved session could not be restored: {saved.reason}")
            return
        self.store.remove(key)
        if time.time() - saved.detached_wall >= self.shelf.ttl_s:
            self.shelf.retire(key, "the saved session's resume time ran out")
            return
        try:
            ClientConnection.restored(self.session_context(), saved)
        except Exception as exc:
            log.error("saved session %s not restored: %s", key[:12], exc)
            self.shelf.retire(key, f"the saved session could not be restored: {exc}")

    async def _save_sessions(self) -> set[ClientConnection]:
        """Save every resumable session to the state directory; returns those saved."""
        saved = set()
        for connection in list(self.connections):
            try:
                if await connection.save(self.store):
                    saved.add(connection)
            except Exception:
                log.exception("saving a session failed")
        return saved

    async def _sweep_detached(self) -> None:
        """End detached sessions whose resume time ran out (checked every second), and
        delete saved ones past it in `--state-dir` (once the engine runs, then every minute:
        replicas sharing the folder may leave sessions nobody resumes; the others are
        restored when their clients resume them, see `restore_saved`)."""
        tick = min(1.0, self.shelf.ttl_s)
        last_cleanup = float("-inf")
        while True:
            await asyncio.sleep(tick)
            for connection in self.shelf.expired(time.monotonic()):
                try:
                    await connection.expire("expired")
                except Exception:
                    log.exception("ending an expired session failed")
            if self.store is not None and time.monotonic() - last_cleanup >= 60.0:
                last_cleanup = time.monotonic()
                removed = await asyncio.to_thread(self.store.remove_expired,
                                                  self.shelf.ttl_s, time.time())
                if removed:
                    log.info("%d saved sessions had expired: removed from %s", removed,
                             self.config.state_dir)

    def attached_sessions(self) -> int:
        """Sessions with a client now (what the load governor weighs: a detached session
        receives no media and, parked, holds no KV pages)."""
        return self.active_sessions - len(self.shelf.detached())

    def resumption_numbers(self) -> dict[str, int]:
        """Detached sessions now, and what became of detached sessions and resumes."""
        stats = self.shelf.stats
        return {"detached": len(self.shelf.detached()), "resumed": stats.resumed,
                "expired": stats.expired, "evicted": stats.evicted, "refused": stats.refused}

    async def make_room(self) -> None:
        """Before a new session starts: when the server is at `max_sessions` and some are
        detached, the oldest detached one ends to make room."""
        while self.active_sessions >= self.config.max_sessions and self.shelf.detached():
            self.shelf.stats.evicted += 1
            await self.shelf.detached()[0].connection.expire("evicted")

    async def load(self, loaded: LoadedModel) -> None:
        """The model is loaded: prepare the pipeline and start the engine (then /health is
        200)."""
        await asyncio.to_thread(self._prepare, loaded)
        self._start_engine()

    def _start_engine(self) -> None:
        self.engine = Engine(self.loaded, self.cache_config, self.engine_config, self.kv_group)
        self.engine.start()
        if self.config.state_dir and self.shelf.enabled:
            self.store = SessionStore(self.config.state_dir, self.state_identity())
        if self.config.load_tick_s is not None:
            self.governor.measuring = True
            self._governing = asyncio.create_task(self._govern())
        log.info("model %s loaded; serving", self.model_name)

    async def _govern(self) -> None:
        """Measure the load every tick and let the governor degrade, restore or refuse."""
        received = stale = 0
        snapshot = self.engine.snapshot()
        decoded, decoding = snapshot.decode_tokens, snapshot.decode_seconds
        self.cpu.read()
        heard, heard_at = self.resources.speech_busy_s(), time.monotonic()
        while True:
            await asyncio.sleep(self.config.load_tick_s)
            snapshot, now = self.engine.snapshot(), time.monotonic()
            rate = decode_rate(snapshot.decode_tokens - decoded,
                               snapshot.decode_seconds - decoding)
            decoded, decoding = snapshot.decode_tokens, snapshot.decode_seconds
            drops = self.drops()
            frames = self.closed_frames + sum(c.live.frame_index for c in self.connections
                                              if c.live is not None)
            new_stale = drops.get("frames_stale", 0) - stale
            new_frames = frames - received
            received, stale = frames, drops.get("frames_stale", 0)
            cpu, media_cpu = self.cpu.read()
            worked = self.resources.speech_busy_s()
            busy, heard = worked - heard, worked
            tick_s, heard_at = now - heard_at, now
            self.governor.tick(LoadReading(
                cpu=cpu,
                media_cpu=media_cpu,
                ttft_s=max(self.governor.recent_ttft(now), self.oldest_wait(now)),
                speech_wait_s=self.resources.speech_wait(),
                recogniser_busy=min(1.0, busy / tick_s) if tick_s > 0 else 0.0,
                stale=new_stale / new_frames if new_frames > 0 else 0.0,
                sessions=self.attached_sessions(),
                decode_rate=rate,
            ), now)
            self.metrics.degraded.set(self.resources.degradation.fps_scale)

    def admission(self) -> Refusal | None:
        """Why a new session is refused now (`busy`), or None when there is room; counted and
        logged (`session_refusals`) either way."""
        refused = self._session_refusal()
        if refused is None:
            self.session_refusals.admitted()
        else:
            self.session_refusals.refused(refused)
        return refused

    def _session_refusal(self) -> Refusal | None:
        if not self.accepting:
            return Refusal("shutting_down", "the server is shutting down")
        if self.active_sessions >= self.config.max_sessions:
            return Refusal("max_sessions", f"the server is configured for at most "
                                           f"{self.config.max_sessions} sessions")
        refused = self.governor.admit(self.attached_sessions())
        if refused is None:
            return None
        return replace(refused, detail=f"the server is at its sustainable load: {refused.detail}")

    def oldest_wait(self, now: float) -> float:
        """How long the oldest question still without a first token has waited."""
        return max((c.oldest_wait(now) for c in self.connections), default=0.0)

    def backlog_tokens(self) -> int:
        """Tokens the answers in flight may still generate, over every session."""
        return sum(a.remaining_tokens for c in self.connections for a in c.answers.values())

    def question_admission(self, max_tokens: int) -> Refusal | None:
        """Why a stateless HTTP request (of up to `max_tokens`) is refused now (`busy`), or
        None to queue it; counted and logged (`question_refusals`) either way. A live
        session's questions are never refused for load (see `answer_length`)."""
        refused = None
        if self.config.load_tick_s is not None:  # the governor is on
            now = time.monotonic()
            refused = self.governor.admit_question(self.oldest_wait(now), self.backlog_tokens(),
                                                   max_tokens, now)
        if refused is None:
            self.question_refusals.admitted()
        else:
            self.question_refusals.refused(refused)
        return refused

    def answer_length(self, max_tokens: int) -> int:
        """How long a live session's answer may be now: `max_tokens`, or shorter while the
        engine is behind (counted by rule in `/metrics` and logged once per burst)."""
        if self.config.load_tick_s is None:  # the governor is off
            return max_tokens
        now = time.monotonic()
        tokens, shortened = self.governor.answer_tokens(self.backlog_tokens(), max_tokens,
                                                        self.oldest_wait(now), now)
        if shortened is None:
            self.answers_shortened.admitted()
        else:
            self.answers_shortened.refused(shortened)
        return tokens

    async def stop(self) -> None:
        """Close every connection, end every session (detached ones too) and stop the
        engine and media workers (idempotent)."""
        self.accepting = False  # a connection closed from here on ends its session
        if self._governing is not None:
            self._governing.cancel()
        if self._sweeping is not None:
            self._sweeping.cancel()
        if self.http is not None:
            http, self.http = self.http, None
            http.should_exit = True
            await http.shutdown(sockets=[self._socket])
        for entry in self.shelf.detached():
            await entry.connection.expire("shutdown")
        if self.engine is not None:
            await self.engine.stop()
        self.resources.close()

    def drops(self) -> dict[str, int]:
        """Everything every session dropped so far, by reason."""
        total = Counter(self.closed_drops)
        for connection in self.connections:
            if connection.runner is not None:
                total.update(connection.drops())
        # speech segments the shared recogniser's full queue left unrecognised
        total["speech_unrecognised"] = sum(s["dropped"]
                                           for s in self.resources.speech_stats().values())
        return dict(total)

    def session_opened(self) -> None:
        """A client's session started (or was restored): counted until `session_closed`."""
        self.active_sessions += 1
        self.metrics.sessions.set(self.active_sessions)

    def session_closed(self, drops: dict[str, int], frames: int) -> None:
        """A session ended: what it dropped and received joins the server's totals."""
        self.closed_drops.update(drops)
        self.closed_frames += frames
        self.active_sessions -= 1
        self.metrics.sessions.set(self.active_sessions)

    def session_context(self) -> SessionContext:
        """What a connection may use of this server (the engine must be running)."""
        if self.engine is None or self.loaded is None:
            raise RuntimeError("no session before the engine runs")
        return SessionContext(
            self.config, self.engine, self.resources, self.metrics, self.governor, self.shelf,
            self.connections, self.model_name, self.loaded.name, self.replica,
            admission=self.admission, accepting=lambda: self.accepting,
            session_pipeline=self.session_pipeline, media_models=self.media_models,
            make_room=self.make_room, answer_length=self.answer_length,
            restore_saved=self.restore_saved, session_opened=self.session_opened,
            session_closed=self.session_closed)

    @property
    def port(self) -> int:
        return self._socket.getsockname()[1] if self._socket is not None else self.config.port

    async def serve_websocket(self, ws, kind: type[ClientConnection] = ClientConnection) -> None:
        """One client on an accepted websocket: protocol v1, or `kind` (Realtime)."""
        connection = kind(self.session_context(), ws)
        self.connections.add(connection)
        try:
            await connection.serve()
        finally:
            if not connection.detached:  # a detached session waits for its client
                self.connections.discard(connection)

    def live_session(self, session_id: str) -> ClientConnection | None:
        """The websocket client whose running session has this id (for HTTP questions about
        a live stream)."""
        return next((c for c in self.connections if c.runner is not None and not c.detached
                     and c.runner.session is not None
                     and str(c.runner.session.id) == str(session_id)), None)

    async def drain(self, timeout_s: float) -> None:
        """Graceful stop: accept no one new, let in-flight answers finish for up to
        `timeout_s`, then end every session (`session.ended`, close 1001) and stop."""
        self.accepting = False
        for connection in list(self.connections):
            if connection.runner is not None and not connection.detached:
                connection.send("session.going_away", seconds=timeout_s,
                                resumable=self.store is not None
                                and connection.resume_key is not None,
                                reason="server shutting down")
        if self.http is not None:
            for listener in self.http.servers:
                listener.close()
        deadline = asyncio.get_running_loop().time() + timeout_s
        while any(c.answers_in_flight() for c in self.connections):
            if asyncio.get_running_loop().time() >= deadline:
                log.warning("shutdown timeout: cancelling %d answers",
                            sum(c.answers_in_flight() for c in self.connections))
                break
            await asyncio.sleep(0.05)
        saved = await self._save_sessions() if self.store is not None else set()
        await asyncio.gather(*(c.shutdown("server shutting down", saved=c in saved)
                               for c in list(self.connections)), return_exceptions=True)
        await self.stop()


async def serve_forever(load: Callable[[], LoadedModel], config: ServerConfig,
                        cache: CacheConfig | None = None,
                        engine: EngineConfig | None = None,
                        kv_group: KVGroup | None = None) -> None:
    """Listen at once (`/health` is 503 while `load()` loads the model in a thread, 200
    after), then run until SIGTERM or SIGINT, then drain (see `StreamgrokServer.drain`).
    With `kv_group`, this is rank 0 of a KV-parallel server (the other ranks `follow`)."""
    server = StreamgrokServer(None, config, cache, engine, kv_group)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
        log.info("listening on %s:%d; loading the model", config.host, server.port)
        loading = asyncio.ensure_future(asyncio.to_thread(load))
        await asyncio.wait([loading, asyncio.ensure_future(stop.wait())],
                           return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            return
        await server.load(loading.result())
        print(f"streamgrok serving {config.pipeline_path} on http://{config.host}:{server.port}/ "
              f"(websocket /ws and /v1/realtime, OpenAI API /v1, health /health, metrics "
              f"/metrics)", flush=True)
        await stop.wait()
        print(f"streamgrok: draining (up to {config.shutdown_timeout_s:g} s for answers in "
              "flight)", flush=True)
        log.info("draining")
        await server.drain(config.shutdown_timeout_s)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await server.stop()
