"""`streamgrok bench serve`: `streamgrok serve` over HTTP, as users run it, against the peer
`llama-server` on the same GGUF, threads and client (`--peer llama-server --peer-bin DIR`).

Each round starts one server, sends one warm-up request, then for each N fires N concurrent
streaming chat completions (greedy, distinct prompts) and stops the server; the servers
alternate between rounds and each figure is the median over rounds. Printed per N: aggregate
tok/s, per-request decode tok/s, TTFT p50/p95, TBT p95, the server's peak RSS (its process
tree) and the ratios to the peer.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from streamgrok.bench.http_load import RowResult, run_row
from streamgrok.bench.llama_cpp_peer import PeerUnavailable
from streamgrok.bench.server_process import free_port
from streamgrok.bench.timing import measurement_env
from streamgrok_kernels.cpu_native import CPU_ISA_ENV, isa_cap, simd_flags

PEER_CONTEXT = 512  # llama-server's context per parallel slot: prompt + answer fit


@dataclass
class ServeBenchOptions:
    model: Path
    threads: int
    concurrency: list[int]
    max_tokens: int = 64
    rounds: int = 3
    peer_bin: Path | None = None  # llama-server's folder; None: streamgrok alone
    serve_args: tuple[str, ...] = ()  # more `streamgrok serve` options


class Server:
    """A server child process on a free loopback port, ready once /health says so."""

    def __init__(self, name: str, command: list[str], port: int) -> None:
        self.name, self.command, self.port = name, command, port
        self.process: asyncio.subprocess.Process | None = None
        self.model_id = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, timeout_s: float = 900.0) -> None:
        self.process = await asyncio.create_subprocess_exec(
            *self.command, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            env=measurement_env())
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=5.0) as client:
            while time.monotonic() < deadline:
                if self.process.returncode is not None:
                    error = (await self.process.stderr.read()).decode()[-600:]
                    raise RuntimeError(f"{self.name} exited ({self.process.returncode}): {error}")
                try:  # both servers answer /health with 200 once their model is loaded
                    health = await client.get(f"{self.url}/health")
                    response = await client.get(f"{self.url}/v1/models")
                    if health.status_code == 200 and response.status_code == 200:
                        self.model_id = response.json()["data"][0]["id"]
                        asyncio.get_running_loop().create_task(self._drain())
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.5)
        raise RuntimeError(f"{self.name} did not serve within {timeout_s:.0f} s")

    async def _drain(self) -> None:
        while self.process is not None and await self.process.stderr.readline():
            pass

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 60)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()


def streamgrok_server(options: ServeBenchOptions) -> Server:
    port = free_port()
    return Server("streamgrok", [sys.executable, "-m", "streamgrok", "serve", "--port",
                                 str(port), "--model", str(options.model), "--threads",
                                 str(options.threads), *options.serve_args], port)


def peer_server(options: ServeBenchOptions) -> Server:
    binary = Path(options.peer_bin) / "llama-server"
    if not binary.is_file():
        raise PeerUnavailable(f"llama-server not found in {options.peer_bin} (build llama.cpp: "
                              "see docs/benchmarks.md; give --peer-bin DIR)")
    slots = max(options.concurrency)
    port = free_port()
    return Server("llama-server", [str(binary), "-m", str(options.model), "-t",
                                   str(options.threads), "-tb", str(options.threads),
                                   "-np", str(slots), "-c", str(slots * PEER_CONTEXT), "-cb",
                                   "--host", "127.0.0.1", "--port", str(port)], port)


async def one_round(server: Server, options: ServeBenchOptions, round_index: int
                    ) -> list[RowResult]:
    await server.start()
    try:
        pid = server.process.pid
        await run_row(server.name, server.url, server.model_id, pid, 1, -1 - round_index, 8)
        rows = []
        for n in options.concurrency:
            rows.append(await run_row(server.name, server.url, server.model_id, pid, n,
                                      round_index * 100 + n, options.max_tokens))
        return rows
    finally:
        await server.stop()


def summary(rows: list[RowResult]) -> dict:
    """The medians over rounds of one server's rows at one N."""
    med = statistics.median
    return {"tok_s": med(r.throughput() for r in rows),
            "per_request_tok_s": med(r.per_request_rate() for r in rows),
            "ttft_p50_ms": med(r.ttft(50) for r in rows) * 1e3,
            "ttft_p95_ms": med(r.ttft(95) for r in rows) * 1e3,
            "tbt_p95_ms": med(r.tbt_p95() for r in rows) * 1e3,
            "peak_rss_mb": max(r.peak_rss_mb for r in rows),
            "failed": sum(r.failed for r in rows),
            "first_error": next((q.error for r in rows for q in r.requests if q.error), None),
            "tokens": med(r.tokens for r in rows)}


def run_http_serve_bench(options: ServeBenchOptions, out_dir: Path) -> dict:
    """Run the rounds, print the table and ratios, write JSON and a plot; return results."""
    print(f"\n[serve over HTTP] {options.model.name}, {options.threads} threads, "
          f"{options.max_tokens} tokens per answer, {options.rounds} rounds alternating, "
          f"medians; cpu: {simd_flags() or 'unknown'}; native kernels built for "
          f"{isa_cap()} ({CPU_ISA_ENV})", flush=True)
    makers = [streamgrok_server] + ([peer_server] if options.peer_bin else [])
    results: dict[str, dict[int, list[RowResult]]] = {}
    failed: set = set()
    for round_index in range(options.rounds):
        order = makers if round_index % 2 == 0 else makers[::-1]
        for make in [m for m in order if m not in failed]:
            server = make(options)
            try:
                rows = asyncio.run(one_round(server, options, round_index))
            except (RuntimeError, PeerUnavailable) as error:  # a server that would not serve
                print(f"  round {round_index + 1}: {server.name} failed: {error}", flush=True)
                failed.add(make)
                continue
            for row in rows:
                results.setdefault(server.name, {}).setdefault(row.concurrent, []).append(row)
            print(f"  round {round_index + 1}: {server.name} done", flush=True)
    table = {name: {n: summary(rows) for n, rows in by_n.items()}
             for name, by_n in results.items()}
    _print(table, options)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "serve_http.json").write_text(json.dumps(
        {"cpu": simd_flags(), "threads": options.threads, "model": options.model.name,
         "rows": {name: {str(n): row for n, row in by_n.items()}
                  for name, by_n in table.items()}}, indent=2))
    _plot(table, out_dir / "serve_http.png")
    return table


def _print(table: dict, options: ServeBenchOptions) -> None:
    header = (f"{'server':>12} {'N':>3} {'tok/s':>7} {'req tok/s':>9} {'TTFT p50':>9} "
              f"{'TTFT p95':>9} {'TBT p95':>8} {'peak RSS':>9} {'failed':>6}")
    print(header)
    for name, by_n in table.items():
        for n, row in sorted(by_n.items()):
            print(f"{name:>12} {n:>3} {row['tok_s']:>7.1f} {row['per_request_tok_s']:>9.1f} "
                  f"{row['ttft_p50_ms']:>7.0f}ms {row['ttft_p95_ms']:>7.0f}ms "
                  f"{row['tbt_p95_ms']:>6.0f}ms {row['peak_rss_mb']:>7.0f}MB "
                  f"{row['failed']:>6}")
            if row["first_error"]:
                print(f"{'':>12} first failure: {row['first_error']}")
    ours, peer = table.get("streamgrok"), table.get("llama-server")
    if not (ours and peer):
        return
    print("ratios streamgrok / llama-server (same run):")
    for n in sorted(ours):
        a, b = ours[n], peer[n]
        print(f"  N={n:<3} tok/s {a['tok_s'] / b['tok_s']:.2f}x, per-request decode "
              f"{a['per_request_tok_s'] / b['per_request_tok_s']:.2f}x, TTFT p95 "
              f"{a['ttft_p95_ms'] / b['ttft_p95_ms']:.2f}x, peak RSS "
              f"{a['peak_rss_mb'] / b['peak_rss_mb']:.2f}x")


def _plot(table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for name, by_n in table.items():
        ns = sorted(by_n)
        axes[0].plot(ns, [by_n[n]["tok_s"] for n in ns], marker="o", label=name)
        axes[1].plot(ns, [by_n[n]["ttft_p95_ms"] for n in ns], marker="o", label=name)
    axes[0].set(xlabel="concurrent requests", ylabel="aggregate tok/s",
                title="Decode throughput over HTTP")
    axes[1].set(xlabel="concurrent requests", ylabel="TTFT p95 (ms)", title="First token")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
