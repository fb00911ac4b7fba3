"""The server's limits and security settings (`streamgrok serve`'s flags)."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

from streamgrok.server.load import LoadLimits

STATIC_DIR = Path(__file__).resolve().parent / "static"
TOKEN_ENVS = ("STREAMGROK_API_KEY", "STREAMGROK_TOKEN")


@dataclass
class ServerConfig:
    """Limits and security settings of the server."""

    pipeline_path: str
    host: str = "127.0.0.1"
    port: int = 8765
    token: str | None = None  # the API key (`--api-key`, formerly `--token`)
    allowed_origins: list[str] = field(default_factory=list)
    pipeline_options: dict = field(default_factory=dict)
    max_message_bytes: int = 2 * 2**20
    max_text_chars: int = 32_768  # input.text and query text (the engine bounds tokens too)
    # how long an input.text may wait for room in its session's text queue before it is
    # refused (`text_backlog`); while a connection is backlogged, at once
    text_wait_s: float = 5.0
    max_inflight_queries: int = 4
    max_media_per_second: int = 30
    media_lane: int = 32  # a client's media messages queued apart from its control messages
    idle_timeout_s: float = 300.0
    outbound_queue: int = 256
    stats_interval_s: float = 2.0
    max_sessions: int = 32
    media_workers: int = 2  # processes for image decoding and OpenCV detectors
    load_tick_s: float | None = 2.0  # how often the load governor measures (None: never)
    load_limits: LoadLimits = field(default_factory=LoadLimits)
    shutdown_timeout_s: float = 30.0  # SIGTERM: how long in-flight answers may finish
    static_dir: Path = STATIC_DIR
    max_request_bytes: int = 8 * 2**20  # an HTTP request body (images travel base64 in it)
    max_completion_tokens: int = 1024  # the most an HTTP request may ask to generate
    max_images: int = 8  # images in one HTTP request
    model_name: str | None = None  # the id /v1/models lists (default: the model file's name)
    replica: str | None = None  # this server's name among replicas (default: host:port)
    resume_ttl_s: float = 300.0  # how long a session outlives its dropped connection (0: not)
    max_detached: int = 8  # sessions kept for resumption at once (the oldest ends first)
    state_dir: str | None = None  # where a draining server saves sessions for the next one

    def __post_init__(self) -> None:
        self.token = self.token or next(
            (os.environ[name] for name in TOKEN_ENVS if os.environ.get(name)), None)
        if not _is_loopback(self.host) and not self.token:
            raise ValueError(
                f"binding to {self.host} (not loopback) requires an API key: pass --api-key "
                f"or set {TOKEN_ENVS[0]}"
            )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
