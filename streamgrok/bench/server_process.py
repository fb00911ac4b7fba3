"""A `streamgrok serve` child process for the server benchmarks (soak, live)."""

from __future__ import annotations

import asyncio
import re
import socket
import sys
import time
import urllib.request

import psutil


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_arguments(args) -> list[str]:
    """`streamgrok serve` arguments from a server benchmark's options (pipeline, model, KV
    budget and memory, pipeline options)."""
    arguments = [args.pipeline, "--kv-budget", str(args.kv_budget)]
    if args.kv_memory_gib is not None:
        arguments += ["--kv-memory-gib", str(args.kv_memory_gib)]
    if args.model:
        arguments += ["--model", args.model]
    for pair in args.set or []:
        arguments += ["--set", pair]
    return arguments


class ServerProcess:
    """`streamgrok serve` started as a child process on a free loopback port."""

    def __init__(self, args: list[str]) -> None:
        self.args = args
        self.process: asyncio.subprocess.Process | None = None
        self.port = 0

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "streamgrok", "serve", *self.args, "--port", "0",
            stdout=asyncio.subprocess.PIPE,
        )
        while True:
            line = (await asyncio.wait_for(self.process.stdout.readline(), 600)).decode()
            if not line:
                raise RuntimeError("the server exited before it served")
            if match := re.search(r"on http://127\.0\.0\.1:(\d+)/", line):
                self.port = int(match.group(1))
                asyncio.get_running_loop().create_task(self._drain_stdout())
                return

    async def _drain_stdout(self) -> None:
        while await self.process.stdout.readline():
            pass

    def rss_mb(self) -> tuple[float, float]:
        """(server process RSS, its media workers' RSS) in MB."""
        proc = psutil.Process(self.process.pid)
        workers = sum(c.memory_info().rss for c in proc.children(recursive=True))
        return proc.memory_info().rss / 2**20, workers / 2**20

    def _metrics_text(self) -> str:
        url = f"http://127.0.0.1:{self.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.read().decode()

    def metric(self, name: str) -> float:
        match = re.search(rf"^{name} ([0-9.e+-]+)$", self._metrics_text(), re.M)
        return float(match.group(1)) if match else float("nan")

    def speech_metrics(self) -> dict[str, dict]:
        """The shared speech recognisers' counters from /metrics, by recogniser: segments,
        calls, audio_s, busy_s, dropped and wait_p95_s (see `BatcherStats.as_dict`)."""
        text = self._metrics_text()
        names = {"segments_total": "segments", "calls_total": "calls",
                 "audio_seconds_total": "audio_s", "busy_seconds_total": "busy_s",
                 "dropped_total": "dropped", "queue_wait_p95_seconds": "wait_p95_s"}
        out: dict[str, dict] = {}
        for name, who, value in re.findall(
                r'^streamgrok_speech_(\w+)\{recogniser="([^"]*)"\} ([0-9.e+-]+)$', text, re.M):
            if name in names:
                key = names[name]
                number = float(value)
                out.setdefault(who, {"wait_p95_s": None})[key] = \
                    int(number) if key in ("segments", "calls", "dropped") else number
        return out

    async def stop(self) -> int:
        self.process.terminate()
        return await asyncio.wait_for(self.process.wait(), 120)


async def settle(server: ServerProcess, seconds: float = 30.0) -> None:
    """Wait until the server holds no KV pages and no session with a client (sessions
    whose clients dropped may wait, detached and parked, for a resume), or time runs out."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pages = await asyncio.to_thread(server.metric, "streamgrok_kv_pages_in_use")
        sessions = await asyncio.to_thread(server.metric, "streamgrok_active_sessions")
        detached = await asyncio.to_thread(server.metric, "streamgrok_detached_sessions")
        if pages == 0 and sessions - detached == 0:
            return
        await asyncio.sleep(0.5)
