"""The HTTP client of `streamgrok bench serve`: N concurrent streaming chat completions against
an OpenAI-compatible server (`streamgrok serve`, or the peer `llama-server`), each request's
first-token time, gaps between tokens and tokens, and the server's peak RSS meanwhile."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
import psutil

from streamgrok.bench.timing import percentile

TOPICS = ["a lighthouse keeper", "a lost robot", "the first snow of winter", "a busy harbour",
          "a chess tournament", "an old bakery", "a night train", "a desert garden",
          "a clockmaker's apprentice", "a storm at sea", "a mountain village", "a city library"]


def prompts(count: int, row: int) -> list[str]:
    """`count` distinct prompts (distinct across rows too: no server reuses a cached prefix)."""
    return [f"Request {row}-{i}: write a long, detailed story about {TOPICS[i % len(TOPICS)]}."
            for i in range(count)]


@dataclass
class RequestResult:
    """One streamed completion: when it was sent, when each content chunk came, its tokens."""

    sent: float
    arrivals: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.arrivals[0] - self.sent if self.arrivals else None

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]

    def decode_rate(self) -> float | None:
        """Tokens per second after the first: this request's own decode speed."""
        if self.tokens < 2 or len(self.arrivals) < 2:
            return None
        return (self.tokens - 1) / max(self.arrivals[-1] - self.arrivals[0], 1e-9)


@dataclass
class RowResult:
    """N concurrent requests against one server."""

    server: str
    concurrent: int
    requests: list[RequestResult]
    wall_s: float
    peak_rss_mb: float

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.requests)

    @property
    def failed(self) -> int:
        return sum(r.error is not None for r in self.requests)

    def throughput(self) -> float:
        return self.tokens / max(self.wall_s, 1e-9)

    def per_request_rate(self) -> float:
        rates = [r for r in (q.decode_rate() for q in self.requests) if r is not None]
        return sorted(rates)[len(rates) // 2] if rates else float("nan")

    def ttft(self, q: float) -> float:
        values = [r.ttft for r in self.requests if r.ttft is not None]
        return percentile(values, q) if values else float("nan")

    def tbt_p95(self) -> float:
        gaps = [g for r in self.requests for g in r.gaps()]
        return percentile(gaps, 95) if gaps else float("nan")


async def stream_one(client: httpx.AsyncClient, url: str, model: str, prompt: str,
                     max_tokens: int) -> RequestResult:
    """One greedy streaming chat completion; tokens from the final usage where the server
    reports it, else one per content chunk."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    result = RequestResult(time.perf_counter())
    chunks = 0
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                for choice in event.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        result.arrivals.append(time.perf_counter())
                        chunks += 1
                if event.get("usage"):
                    result.tokens = int(event["usage"].get("completion_tokens") or 0)
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        result.error = f"{type(error).__name__}: {error}"
    result.tokens = result.tokens or chunks
    return result


async def run_row(server: str, url: str, model: str, pid: int, concurrent: int, row: int,
                  max_tokens: int, api_key: str | None = None) -> RowResult:
    """`concurrent` requests at once (with `api_key` as the bearer token where given); the
    server process tree's RSS sampled meanwhile."""
    peak = 0.0
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, tree_rss_mb(pid))
            await asyncio.sleep(0.1)

    limits = httpx.Limits(max_connections=concurrent + 4)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits,
                                 headers=headers) as client:
        sampler = asyncio.create_task(sample())
        started = time.perf_counter()
        requests = await asyncio.gather(*(stream_one(client, url, model, prompt, max_tokens)
                                          for prompt in prompts(concurrent, row)))
        wall = time.perf_counter() - started
        done.set()
        await sampler
    return RowResult(server, concurrent, list(requests), wall, peak)


def tree_rss_mb(pid: int) -> float:
    """RSS of a process and its children, MB (0 once it is gone)."""
    try:
        process = psutil.Process(pid)
        members = [process, *process.children(recursive=True)]
        return sum(p.memory_info().rss for p in members) / 2**20
    except psutil.Error:
        return 0.0
