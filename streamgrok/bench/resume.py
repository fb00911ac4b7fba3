"""`streamgrok bench resume`: how fast a dropped session comes back, through `streamgrok serve`.

A real server process on loopback; per KV size, one protocol v1 session streams text into its
context (`answer_context=stream`, so the text is in the KV cache) until a layer holds that many
tokens. Then, `--trials` times: the client drops the socket, the server parks the session's
KV in host memory (measured: parked bytes, server RSS), a new connection sends
`session.resume` (measured: the time to `session.resumed`) and asks a question (measured: its
time to first token, against the same question asked before the first drop, in the same
run). Prints a table and writes a JSON file and a PNG plot.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
from websockets.asyncio.client import connect

from streamgrok.bench.server_process import ServerProcess, serve_arguments
from streamgrok.bench.timing import percentile
from streamgrok_kernels.cpu_native import simd_flags

QUESTION = "What was the last number mentioned?"
WORDS = ("camera", "river", "window", "signal", "market", "engine", "garden", "ticket",
         "harbor", "lantern", "meadow", "pocket", "rocket", "saddle", "tunnel", "violin")


@dataclass
class SizeResult:
    """One KV size's measurements."""

    tokens: int  # tokens a layer of the session held when it dropped
    parked_mb: float = 0.0
    resume_ms: list[float] = field(default_factory=list)
    ttft_before_ms: float = 0.0
    ttft_after_ms: list[float] = field(default_factory=list)
    rss_attached_mb: float = 0.0
    rss_detached_mb: float = 0.0


def filler(index: int, words: int) -> str:
    """Distinct text of about `words` words (numbered sentences)."""
    out = []
    for i in range(words // 8):
        n = index * 100_000 + i
        picked = " ".join(WORDS[(n * 7 + k * 3) % len(WORDS)] for k in range(6))
        out.append(f"Item {n}: {picked}.")
    return " ".join(out)


async def recv_until(ws, kind: str, timeout: float = 600.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        message = json.loads(await asyncio.wait_for(ws.recv(), deadline - time.monotonic()))
        if message["type"] == kind:
            return message
        if message["type"] == "error":
            raise RuntimeError(f"the server said {message}")


async def layer_tokens(ws) -> int:
    stats = await recv_until(ws, "stats")
    tokens = stats["kv"]["layer_tokens"]
    return min(tokens) if tokens else 0


async def ask(ws, query_id: str) -> float:
    """A question's time to its first generated token, as the server measured it (ms; a
    given answer start is not a generated token); the answer is read to its end."""
    await ws.send(json.dumps({"type": "query", "id": query_id, "text": QUESTION}))
    while True:
        message = json.loads(await asyncio.wait_for(ws.recv(), 600))
        if message.get("query_id") == query_id and message["type"] == "response.done":
            if message.get("finish_reason") == "error" or message.get("ttft_ms") is None:
                raise RuntimeError(f"the question failed: {message}")
            return message["ttft_ms"]


async def measure_size(server: ServerProcess, tokens: int, trials: int) -> SizeResult:
    url = f"ws://127.0.0.1:{server.port}/ws"
    result = SizeResult(tokens)
    async with connect(url, max_size=2**24) as ws:
        await ws.send(json.dumps({"type": "session.start", "id": "s"}))
        handle = (await recv_until(ws, "session.started"))["resume"]["handle"]
        chunk, held, last = 0, 0, -1
        while held < tokens or held != last:  # until it holds `tokens` and prefill is done
            if held == last and held < tokens:  # the last chunk is in: send the next
                words = 2000 if tokens - held > 8000 else 300  # big steps while far off
                await ws.send(json.dumps({"type": "input.text",
                                          "text": filler(chunk, words)}))
                chunk += 1
            last, held = held, await layer_tokens(ws)
        result.tokens = held
        result.ttft_before_ms = await ask(ws, "before")
        result.rss_attached_mb = server.rss_mb()[0]
    for trial in range(trials):
        await wait_parked(server)
        result.parked_mb = server.metric("streamgrok_kv_parked_bytes") / 2**20
        result.rss_detached_mb = server.rss_mb()[0]
        async with connect(url, max_size=2**24) as ws:
            sent = time.monotonic()
            await ws.send(json.dumps({"type": "session.resume", "handle": handle}))
            resumed = await recv_until(ws, "session.resumed")
            result.resume_ms.append((time.monotonic() - sent) * 1e3)
            handle = resumed["resume"]["handle"]
            result.ttft_after_ms.append(await ask(ws, f"after{trial}"))
            if trial == trials - 1:
                await ws.send(json.dumps({"type": "session.end"}))
                await recv_until(ws, "session.ended")
    return result


async def wait_parked(server: ServerProcess, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if (server.metric("streamgrok_kv_pages_in_use") == 0
                and server.metric("streamgrok_kv_parked_bytes") > 0):
            return
        await asyncio.sleep(0.05)
    raise RuntimeError("the dropped session was not parked in time")


async def _run(args) -> list[SizeResult]:
    sizes = [int(s) for s in args.sizes.split(",")]
    args.kv_budget = max(sizes) + 2048  # nothing evicted: the whole stream stays in the KV
    arguments = serve_arguments(args) + ["--set", "answer_context=stream",
                                         "--set", "transcribe=false", "--load-tick", "0",
                                         "--max-inflight-queries", "4"]
    server = ServerProcess(arguments)
    await server.start()
    try:
        results = []
        for tokens in sizes:
            results.append(await measure_size(server, tokens, args.trials))
            print(row(results[-1]), flush=True)
        return results
    finally:
        await server.stop()


HEADER = ("KV tokens  parked MB  resume ms p50    p95  TTFT before  TTFT after p50  "
          "RSS attached  RSS detached")


def row(r: SizeResult) -> str:
    return (f"{r.tokens:9d}  {r.parked_mb:9.1f}  {percentile(r.resume_ms, 50):13.1f} "
            f"{percentile(r.resume_ms, 95):6.1f}  {r.ttft_before_ms:9.0f}ms  "
            f"{percentile(r.ttft_after_ms, 50):12.0f}ms  {r.rss_attached_mb:10.0f}MB  "
            f"{r.rss_detached_mb:10.0f}MB")


def run_resume_bench(args) -> list[SizeResult]:
    """Run the benchmark (see the module docstring) and report it."""
    print(f"cpu: {simd_flags()}, {psutil.cpu_count()} cores; path: streamgrok serve, "
          f"protocol v1 session.resume; {args.trials} drops per size")
    print(HEADER, flush=True)
    results = asyncio.run(_run(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "resume.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    plot(results, out / "resume.png")
    print(f"wrote {out / 'resume.json'} and {out / 'resume.png'}")
    return results


def plot(results: list[SizeResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [r.tokens for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(tokens, [percentile(r.resume_ms, 50) for r in results], "o-", label="p50")
    left.plot(tokens, [percentile(r.resume_ms, 95) for r in results], "s--", label="p95")
    left.set(xlabel="KV tokens per layer", ylabel="session.resume -> session.resumed (ms)",
             title="Time to resume")
    left.legend()
    right.plot(tokens, [r.parked_mb for r in results], "o-", label="parked KV")
    right.plot(tokens, [r.rss_detached_mb - r.rss_attached_mb for r in results], "s--",
               label="server RSS, detached - attached")
    right.set(xlabel="KV tokens per layer", ylabel="MB", title="Memory of a detached session")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
