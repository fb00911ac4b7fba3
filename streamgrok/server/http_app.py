"""The server's ASGI app: protocol v1 on `/ws`, the OpenAI-compatible API under `/v1`,
`/health`, `/version`, `/metrics` and the demo page, all on one port."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

import streamgrok
from streamgrok.server.asgi_socket import AsgiSocket
from streamgrok.server.openai_api import OpenAIApi
from streamgrok.server.realtime import RealtimeConnection

if TYPE_CHECKING:
    from streamgrok.server.app import StreamgrokServer

STATIC_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".css": "text/css; charset=utf-8"}


def build_app(server: StreamgrokServer) -> Starlette:
    """The routes of one server."""
    api = OpenAIApi(server)
    access = server.access

    def refused(request: Request, api_shaped: bool = False) -> Response | None:
        """403 for a browser Origin not allowed, 401 without the API key, else None."""
        if not access.origin_allowed(request.headers):
            return api.error(403, "this Origin is not allowed", "permission_error") \
                if api_shaped else PlainTextResponse("origin not allowed\n", 403)
        if not access.authorized(request.headers, request.query_params):
            return api.error(401, "missing or wrong API key (Authorization: Bearer KEY)",
                             "authentication_error", code="invalid_api_key") \
                if api_shaped else PlainTextResponse("unauthorized\n", 401)
        return None

    async def websocket_gate(websocket: WebSocket) -> AsgiSocket | None:
        """Origin, API key and readiness for a websocket: the accepted socket (with the key
        it came with and its resume request), or None after refusing with an HTTP status."""
        status, text = 0, ""
        principal = access.principal(websocket.headers, websocket.query_params)
        if not access.origin_allowed(websocket.headers):
            status, text = 403, "origin not allowed\n"
        elif principal is None:
            status, text = 401, "unauthorized\n"
        elif not server.ready or not server.accepting:
            status, text = 503, "the model is loading\n" if not server.ready \
                else "shutting down\n"
        if status:
            await websocket.send_denial_response(PlainTextResponse(text, status))
            return None
        await websocket.accept()
        resume = (websocket.headers.get("x-streamgrok-resume")
                  or websocket.query_params.get("resume"))
        asked = (websocket.headers.get("x-streamgrok-resumable")
                 or websocket.query_params.get("resumable") or "").lower()
        return AsgiSocket(websocket, principal, resume, asked in ("1", "true"))

    async def protocol_v1(websocket: WebSocket) -> None:
        if (socket := await websocket_gate(websocket)) is not None:
            await server.serve_websocket(socket)

    async def realtime(websocket: WebSocket) -> None:
        if (socket := await websocket_gate(websocket)) is not None:
            await server.serve_websocket(socket, RealtimeConnection)

    async def health(request: Request) -> Response:
        if not server.ready:
            return JSONResponse({"status": "loading"}, 503)
        if not server.accepting:
            return JSONResponse({"status": "draining"}, 503)
        return JSONResponse({"status": "ok", "model": server.model_name,
                             "sessions": server.active_sessions, "replica": server.replica})

    async def version(request: Request) -> Response:
        return JSONResponse({"version": streamgrok.__version__})

    async def metrics(request: Request) -> Response:
        if (denied := refused(request)) is not None:
            return denied
        return Response(server.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def static(request: Request) -> Response:
        path = request.path_params.get("name", "")
        name = "index.html" if path in ("", "/") else path.lstrip("/")
        folder = server.config.static_dir.resolve()
        file = (folder / name).resolve()
        if file.parent != folder or not file.is_file() or file.suffix not in STATIC_TYPES:
            return PlainTextResponse("not found\n", 404)
        return Response(file.read_bytes(), media_type=STATIC_TYPES[file.suffix],
                        headers={"Cache-Control": "no-store"})

    def guarded(endpoint):
        async def checked(request: Request) -> Response:
            if (denied := refused(request, api_shaped=True)) is not None:
                return denied
            return await endpoint(request)
        return checked

    routes = [
        WebSocketRoute("/ws", protocol_v1),
        WebSocketRoute("/v1/realtime", realtime),
        Route("/health", health),
        Route("/version", version),
        Route("/metrics", metrics),
        Route("/v1/models", guarded(api.models)),
        Route("/v1/chat/completions", guarded(api.chat_completions), methods=["POST"]),
        Route("/v1/completions", guarded(api.completions), methods=["POST"]),
        Route("/", static),
        Route("/{name:path}", static),
    ]
    # browsers on an --allow-origin page may call the HTTP API too (their preflights included)
    middleware = [Middleware(CORSMiddleware, allow_origins=sorted(
        o.rstrip("/") for o in server.config.allowed_origins), allow_methods=["GET", "POST"],
        allow_headers=["Authorization", "Content-Type", "X-Streamgrok-Session"])] \
        if server.config.allowed_origins else []
    return Starlette(routes=routes, middleware=middleware)
