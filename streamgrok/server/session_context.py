"""What a client connection may use of the server: the `SessionContext` the server hands
each websocket connection (protocol v1 and Realtime) instead of itself."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from streamgrok.engine import Engine
from streamgrok.pipeline.pipeline import Pipeline
from streamgrok.pipeline.resources import SharedResources
from streamgrok.server.config import ServerConfig
from streamgrok.server.load import LoadGovernor, Refusal
from streamgrok.server.metrics import ServerMetrics
from streamgrok.server.resumption import ResumeShelf

if TYPE_CHECKING:
    from streamgrok.server.connection import ClientConnection


@dataclass(frozen=True)
class SessionContext:
    """The server's parts and decisions a live session needs, and nothing else.

    The server owns everything named here; a connection reads the shared parts (engine,
    media resources, metrics, the resume shelf) and asks the server's questions through the
    callables: whether a session may start (`admission`), how long an answer may be now
    (`answer_length`), whether new sessions are accepted (`accepting`). The count of running
    sessions is the server's: a connection reports `session_opened` and `session_closed`.
    """

    config: ServerConfig
    engine: Engine
    resources: SharedResources
    metrics: ServerMetrics
    governor: LoadGovernor
    shelf: ResumeShelf
    connections: set[ClientConnection]  # every connection whose session the server holds
    model_name: str  # the id clients see (`/v1/models`, Realtime's session)
    model_file: str  # the loaded model's name (protocol v1's `session.started`)
    replica: str
    admission: Callable[[], Refusal | None]
    accepting: Callable[[], bool]
    session_pipeline: Callable[[dict | None], Pipeline]
    media_models: Callable[[], Awaitable[None]]
    make_room: Callable[[], Awaitable[None]]
    answer_length: Callable[[int], int]
    restore_saved: Callable[[str], Awaitable[Any]]
    session_opened: Callable[[], None]
    session_closed: Callable[[dict[str, int], int], None]
