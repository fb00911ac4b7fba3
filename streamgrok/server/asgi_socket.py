"""An ASGI websocket with the small interface a client connection uses: recv, send, close."""

from __future__ import annotations

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState


class ClientGone(Exception):
    """The client closed the connection (or it broke); `code` is the close code."""

    def __init__(self, code: int = 1006, reason: str = "") -> None:
        super().__init__(f"connection closed ({code} {reason})".strip())
        self.code = code
        self.reason = reason


class AsgiSocket:
    """Wraps a Starlette `WebSocket` that is already accepted."""

    def __init__(self, websocket: WebSocket, principal: str = "",
                 resume: str | None = None, resumable: bool = False) -> None:
        self.websocket = websocket
        self.principal = principal  # the API key it was let in with ("" without keys)
        # Realtime: a resume handle given with the upgrade request, and whether the client
        # asked for a resumable session
        self.resume = resume
        self.resumable = resumable

    async def recv(self) -> str | bytes:
        """The next message, text or binary; raises `ClientGone` when the client left."""
        if self.websocket.client_state != WebSocketState.CONNECTED:
            raise ClientGone()
        try:
            message = await self.websocket.receive()
        except (WebSocketDisconnect, RuntimeError) as exc:
            raise ClientGone(getattr(exc, "code", 1006)) from exc
        if message["type"] == "websocket.disconnect":
            raise ClientGone(message.get("code", 1005), message.get("reason") or "")
        if message.get("text") is not None:
            return message["text"]
        return message.get("bytes") or b""

    async def send(self, text: str) -> None:
        """Send a text message; raises `ClientGone` when the client left."""
        try:
            await self.websocket.send_text(text)
        except (WebSocketDisconnect, RuntimeError, OSError) as exc:
            raise ClientGone() from exc

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Close with `code` (nothing happens when it is closed already)."""
        if self.websocket.application_state == WebSocketState.DISCONNECTED:
            return
        try:
            await self.websocket.close(code, reason)
        except (RuntimeError, OSError):
            pass
