"""`streamgrok bench long-stream`: one session streams past a million tokens through
`streamgrok serve`, with answers checked and memory watched along the way.

A real server process on loopback (defaults, `answer_context=stream` so the streamed text is
in the KV cache and questions are answered from it). One protocol v1 session sends
`input.text` as fast as the server takes it (a few texts ahead; what the server refuses with
`text_backlog` is sent again). At `--checks` points spread over the stream (the first, early,
is the baseline) it lets the server catch up, states a fresh fact ("the password for gate K
is WORD") and asks for it: a correct answer names the word. Server RSS and KV pages in use
are sampled every second. Prints a table, the checks' correctness and memory at the first vs
the last check, and writes a JSON file and a PNG plot.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
from websockets.asyncio.client import connect

from streamgrok.bench.resume import filler, recv_until
from streamgrok.bench.server_process import ServerProcess, serve_arguments
from streamgrok.bench.timing import percentile
from streamgrok.server.connection import TEXT_RETRY_MS
from streamgrok_kernels.cpu_native import simd_flags

PASSWORDS = ("amber", "falcon", "granite", "harvest", "juniper", "lagoon", "marble",
             "nectar", "orchid", "pepper", "quartz", "saffron", "thistle", "walnut")
CHUNK_WORDS = 600  # words of filler per input.text (about 1,500 tokens)
AHEAD = 4  # input.text sent before the client waits for the server to have taken them


@dataclass
class Check:
    """One fact stated and asked for, at `streamed` tokens into the stream."""

    streamed: int
    gate: int
    password: str
    answer: str = ""
    correct: bool = False
    ttft_ms: float = 0.0
    rss_mb: float = 0.0
    kv_pages: float = 0.0


@dataclass
class LongStreamResult:
    """The whole run: checks, memory samples, throughput."""

    tokens: int
    checks: list[Check] = field(default_factory=list)
    samples: list[tuple[float, float, float, float]] = field(default_factory=list)
    # (seconds, tokens streamed, server RSS MB, KV pages in use)
    seconds: float = 0.0


async def streamed_tokens(server: ServerProcess) -> int:
    """Tokens the server has prefilled so far (the stream and the questions)."""
    value = await asyncio.to_thread(server.metric, "streamgrok_prefill_tokens_total")
    return 0 if value != value else int(value)


async def sample_memory(server: ServerProcess, result: LongStreamResult,
                        started: float) -> None:
    """Every second: (time, tokens streamed, server RSS, KV pages in use)."""
    while True:
        pages = await asyncio.to_thread(server.metric, "streamgrok_kv_pages_in_use")
        result.samples.append((time.monotonic() - started, await streamed_tokens(server),
                               server.rss_mb()[0], pages))
        await asyncio.sleep(1.0)


class Conversation:
    """One websocket session's messages, read by one task: `text_backlog` refusals (the
    texts to send again), the marker errors that say every earlier message was handled, and
    finished answers."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.refused: deque[str] = deque()  # ids of input.text the server did not accept
        self._markers: dict[str, asyncio.Future] = {}
        self._answers: dict[str, asyncio.Future] = {}
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        async for raw in self.ws:
            message = json.loads(raw)
            kind = message["type"]
            if kind == "error" and message.get("code") == "text_backlog":
                self.refused.append(message["message_id"])
            elif kind == "error" and message.get("message_id") in self._markers:
                self._markers.pop(message["message_id"]).set_result(None)
            elif kind == "error":
                raise RuntimeError(f"the server said {message}")
            elif kind == "response.done" and message.get("query_id") in self._answers:
                self._answers.pop(message["query_id"]).set_result(message)

    async def send(self, message: dict) -> None:
        await self.ws.send(json.dumps(message))

    async def handled(self, name: str) -> None:
        """Wait until the server has handled every message sent so far (they are handled in
        order: a cancel of no query comes back as an error after them)."""
        future = self._markers[name] = asyncio.get_running_loop().create_future()
        await self.send({"type": "response.cancel", "query_id": "none", "id": name})
        await asyncio.wait_for(future, 600)

    async def ask(self, query_id: str, text: str) -> dict:
        future = self._answers[query_id] = asyncio.get_running_loop().create_future()
        await self.send({"type": "query", "id": query_id, "text": text})
        return await asyncio.wait_for(future, 600)

    async def close(self) -> None:
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


async def stream_until(talk: Conversation, server: ServerProcess, point: int,
                       texts: dict[str, str]) -> None:
    """Send filler text (and again what the server refused) until it has prefilled `point`
    tokens; every `AHEAD` texts, wait until the server has taken them (its text queue is the
    only backlog, not the socket's buffers)."""
    while await streamed_tokens(server) < point:
        if len(texts) % AHEAD == 0:
            await talk.handled(f"sent{len(texts)}")
        if talk.refused:  # the model is behind: give it a moment, then resend
            await asyncio.sleep(TEXT_RETRY_MS / 1e3)
            while talk.refused:
                name = talk.refused.popleft()
                await talk.send({"type": "input.text", "id": name, "text": texts[name]})
            continue
        name = f"c{len(texts)}"
        texts[name] = filler(len(texts), CHUNK_WORDS)
        await talk.send({"type": "input.text", "id": name, "text": texts[name]})


async def check(talk: Conversation, server: ServerProcess, gate: int,
                rng: random.Random) -> Check:
    """State a fresh fact (sent again until the server takes it), ask for it, and score
    the answer."""
    password = rng.choice(PASSWORDS)
    await caught_up(server)
    result = Check(await streamed_tokens(server), gate, password)
    fact = f"Important: the password for gate {gate} is {password}."
    while True:
        await talk.handled(f"before-fact{gate}")
        talk.refused.clear()  # filler still refused: not needed any more
        await talk.send({"type": "input.text", "id": f"fact{gate}", "text": fact})
        await talk.handled(f"after-fact{gate}")
        if f"fact{gate}" not in talk.refused:
            break
        await asyncio.sleep(TEXT_RETRY_MS / 1e3)
    done = await talk.ask(f"q{gate}", f"What is the password for gate {gate}?")
    if done.get("finish_reason") == "error":
        raise RuntimeError(f"the question failed: {done}")
    result.answer = done.get("text", "")
    result.correct = password in result.answer.lower()
    result.ttft_ms = done.get("ttft_ms") or 0.0
    result.rss_mb = server.rss_mb()[0]
    result.kv_pages = await asyncio.to_thread(server.metric, "streamgrok_kv_pages_in_use")
    return result


async def caught_up(server: ServerProcess, quiet_s: float = 1.0) -> None:
    """Wait until the server has prefilled everything queued (its count stands still)."""
    last = -1
    while (now := await streamed_tokens(server)) != last:
        last = now
        await asyncio.sleep(quiet_s)


def check_points(tokens: int, checks: int, first: int) -> list[int]:
    """Where the checks fall: `first`, then evenly up to `tokens`."""
    if checks < 2:
        return [tokens]
    step = (tokens - first) / (checks - 1)
    return [int(first + i * step) for i in range(checks)]


async def _run(args) -> LongStreamResult:
    arguments = serve_arguments(args) + ["--set", "answer_context=stream",
                                         "--set", "transcribe=false", "--load-tick", "0"]
    server = ServerProcess(arguments)
    await server.start()
    result = LongStreamResult(args.tokens)
    rng = random.Random(args.seed)
    points = check_points(args.tokens, args.checks, first=2 * args.kv_budget)
    started = time.monotonic()
    sampler = asyncio.get_running_loop().create_task(sample_memory(server, result, started))
    try:
        async with connect(f"ws://127.0.0.1:{server.port}/ws", max_size=2**24) as ws:
            await ws.send(json.dumps({"type": "session.start", "id": "s"}))
            await recv_until(ws, "session.started")
            talk = Conversation(ws)
            texts: dict[str, str] = {}
            for gate, point in enumerate(points, 1):
                await stream_until(talk, server, point, texts)
                result.checks.append(await check(talk, server, gate, rng))
                print(row(result.checks[-1], time.monotonic() - started), flush=True)
            await talk.close()
            await ws.send(json.dumps({"type": "session.end"}))
        result.seconds = time.monotonic() - started
        return result
    finally:
        sampler.cancel()
        await server.stop()


HEADER = "  streamed  gate  correct  TTFT ms  RSS MB  KV pages  elapsed  answer"


def row(c: Check, elapsed: float) -> str:
    answer = c.answer.replace("\n", " ")[:60]
    return (f"{c.streamed:10d}  {c.gate:4d}  {'yes' if c.correct else 'no':>7}  "
            f"{c.ttft_ms:7.0f}  {c.rss_mb:6.0f}  {c.kv_pages:8.0f}  {elapsed:6.0f}s  {answer}")


def summary(result: LongStreamResult) -> list[str]:
    """The closing lines: correctness, and memory at the first check (the baseline) vs the
    last."""
    checks = result.checks
    first, last = checks[0], checks[-1]
    correct = sum(c.correct for c in checks)
    streamed = max((s[1] for s in result.samples), default=last.streamed)
    rss = [s[2] for s in result.samples if s[1] >= first.streamed]
    pages = [s[3] for s in result.samples if s[1] >= first.streamed]
    lines = [
        f"streamed {streamed} tokens in {result.seconds:.0f} s "
        f"({streamed / max(result.seconds, 1e-9):.0f} tok/s through serve)",
        f"answers correct: {correct}/{len(checks)}; "
        f"TTFT p50 {percentile([c.ttft_ms for c in checks], 50):.0f} ms",
        f"baseline (first check, {first.streamed} tokens) vs last ({last.streamed} tokens): "
        f"RSS {first.rss_mb:.0f} -> {last.rss_mb:.0f} MB "
        f"({last.rss_mb / max(first.rss_mb, 1e-9):.2f}x), KV pages {first.kv_pages:.0f} -> "
        f"{last.kv_pages:.0f}, TTFT {first.ttft_ms:.0f} -> {last.ttft_ms:.0f} ms",
    ]
    if rss:
        lines.append(f"after the first check: RSS {min(rss):.0f}..{max(rss):.0f} MB, "
                     f"KV pages {min(pages):.0f}..{max(pages):.0f}")
    return lines


def run_long_stream_bench(args) -> LongStreamResult:
    """Run the benchmark (see the module docstring) and report it."""
    print(f"cpu: {simd_flags()}, {psutil.cpu_count()} cores; path: streamgrok serve, "
          f"protocol v1 input.text into one session (answer_context=stream), KV budget "
          f"{args.kv_budget} tokens per layer; {args.checks} checks over {args.tokens} tokens")
    print(HEADER, flush=True)
    result = asyncio.run(_run(args))
    for line in summary(result):
        print(line)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "long_stream.json").write_text(json.dumps(asdict(result), indent=1))
    plot(result, out / "long_stream.png")
    print(f"wrote {out / 'long_stream.json'} and {out / 'long_stream.png'}")
    return result


def plot(result: LongStreamResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    tokens = [s[1] for s in result.samples]
    left.plot(tokens, [s[2] for s in result.samples], label="server RSS (MB)")
    left.set(xlabel="tokens streamed", ylabel="MB", title="Server memory along the stream")
    pages = left.twinx()
    pages.plot(tokens, [s[3] for s in result.samples], color="tab:orange", label="KV pages")
    pages.set_ylabel("KV pages in use")
    left.legend(loc="upper left")
    pages.legend(loc="lower right")
    right.plot([c.streamed for c in result.checks], [c.ttft_ms for c in result.checks], "o-")
    for c in result.checks:
        right.annotate("ok" if c.correct else "wrong", (c.streamed, c.ttft_ms))
    right.set(xlabel="tokens streamed", ylabel="TTFT (ms)", title="Fact checks along the stream")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
