"""`streamgrok bench live`: many live websocket clients against a real server, one row per N.

A `streamgrok serve` process starts on loopback (or `--url` names a running server). For each
N in `--clients` (the first row, N=1 by default, is the baseline of the same run), N clients
each stream generated JPEG frames at `--fps` and a second of PCM audio a second: espeak-ng
sentences in several voices with pauses of room noise between them, speech about half the
time (`--no-speech`: room noise only). Each asks a question every `--question-every` seconds
for `--seconds`, about what is shown and, every other time, about what was said. Per row:
questions asked / answered / failed / refused (`busy`, `too_many_queries`) / unanswered, TTFT
p50/p95/p99, TBT p95, frames sent / processed / dropped by reason, effective fps per session,
server CPU (cores, media workers and the programs they ran included) and RSS; sentences said
/ transcribed / transcribed within 3 s of their end, the transcripts' delay and WER. A PNG
plot of TTFT and answered fraction against N goes next to the table.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import psutil

from streamgrok.bench.live_client import PHOTOS, ClientResult, frame_bytes, live_client
from streamgrok.bench.server_process import ServerProcess, serve_arguments, settle
from streamgrok.bench.speech_track import (
    SpeechTrack,
    sentence_clips,
    speech_line,
    speech_summary,
)
from streamgrok.bench.timing import milliseconds, percentile
from streamgrok.openmp_wait import set_idle_spin
from streamgrok.server.load import tree_cpu_seconds
from streamgrok_kernels.cpu_native import CPU_ISA_ENV, isa_cap, simd_flags


@dataclass
class Row:
    """One N: what its clients saw and what the server used."""

    clients: int
    results: list[ClientResult]
    seconds: float
    cpu_cores: float
    rss_mb: float
    speech_server: dict[str, dict] | None = None  # the server's recogniser counters in the row

    @property
    def admitted(self) -> int:
        """Clients whose session started (after retrying `busy` as the server suggested)."""
        return sum(1 for r in self.results if not r.session_refused and not r.handshake_failed)

    def ttft(self, q: float) -> float:
        return percentile([t for r in self.results for t in r.ttfts], q)

    @property
    def tbt_p95(self) -> float:
        return percentile([t for r in self.results for t in r.tbts], 95)

    def total(self, name: str) -> int:
        return sum(getattr(r, name) for r in self.results)

    @property
    def refused(self) -> Counter:
        counts: Counter = Counter()
        for r in self.results:
            counts.update(r.refused)
            if r.session_refused:
                counts[f"session {r.session_refused}"] += 1
        return counts

    def drops(self) -> Counter:
        counts: Counter = Counter()
        for r in self.results:
            counts.update({k: v for k, v in r.drops.items() if isinstance(v, int)})
        return counts

    def speech(self, within_s: float = 3.0) -> dict | None:
        """`speech_summary` of the row's clients."""
        return speech_summary(self.results, within_s)

    def recognisers(self) -> dict[str, dict]:
        """What the server's shared speech recognisers did during the row: from its
        /metrics before and after the row where the bench started the server, else from the
        clients' first and last `stats`."""
        if self.speech_server is not None:
            return self.speech_server
        last = max((r.stats for r in self.results if r.stats),
                   key=lambda st: st.get("stream_time", 0.0), default={})
        first = next((r.first_stats for r in self.results if r.first_stats), {})
        return _difference(first.get("speech", {}), last.get("speech", {}))

    @property
    def processed(self) -> int:
        return sum(r.stats.get("frames", {}).get("processed", 0) for r in self.results)

    @property
    def fps_per_session(self) -> float:
        served = sum(1 for r in self.results if r.stats)
        return self.processed / served / self.seconds if served else float("nan")


async def run_row(url: str, server: ServerProcess | None, clients: int, args,
                  clips: list | None = None) -> Row:
    frames = [frame_bytes(i) for i in range(10 * len(PHOTOS))]
    cpu_before = _cpu_seconds(server)
    heard_before = await asyncio.to_thread(server.speech_metrics) if server else None
    started = time.monotonic()
    rss_peak = 0.0

    async def sample_rss() -> None:
        nonlocal rss_peak
        while server is not None:
            rss_peak = max(rss_peak, sum(server.rss_mb()))
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample_rss())
    try:
        results = await asyncio.gather(*(
            live_client(url, f"n{clients}-c{i:02d}", frames, args.seconds, args.fps,
                        args.question_every,
                        offset=2.0 + args.question_every * i / clients,
                        answer_timeout=args.answer_timeout,
                        speech=SpeechTrack(clips, first=i, seed=i) if clips else None)
            for i in range(clients)))
    finally:
        sampler.cancel()
    wall = time.monotonic() - started
    cpu = (_cpu_seconds(server) - cpu_before) / wall if server is not None else float("nan")
    heard = None
    if server is not None:
        heard = _difference(heard_before, await asyncio.to_thread(server.speech_metrics))
    return Row(clients, list(results), args.seconds, cpu, rss_peak or float("nan"), heard)


def _difference(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict]:
    """What each recogniser's counters grew by between two reads (its wait p95: the later)."""
    return {name: {**now, **{k: now[k] - before.get(name, {}).get(k, 0) for k in
                             ("segments", "calls", "audio_s", "busy_s", "dropped")}}
            for name, now in after.items()}


def _cpu_seconds(server: ServerProcess | None) -> float:
    """CPU seconds of the server and every process under it (with the programs they ran and
    waited for, such as Tesseract)."""
    if server is None:
        return 0.0
    try:
        return sum(tree_cpu_seconds(psutil.Process(server.process.pid)))
    except psutil.NoSuchProcess:
        return 0.0


def print_rows(rows: list[Row]) -> None:
    print(f"\n{'N':>3} {'admitted':>8} {'asked':>5} {'answered':>8} {'failed':>6} {'refused':>7} "
          f"{'no-answer':>9} {'TTFT p50':>8} {'p95':>6} {'p99':>6} {'TBT p95':>7} "
          f"{'frames sent':>11} {'processed':>9} {'fps/sess':>8} {'CPU cores':>9} "
          f"{'RSS MB':>6}")
    for row in rows:
        print(f"{row.clients:3d} {row.admitted:8d} {row.total('asked'):5d} "
              f"{row.total('answered'):8d} "
              f"{row.total('failed'):6d} {sum(row.refused.values()):7d} "
              f"{row.total('unanswered'):9d} {milliseconds(row.ttft(50)):>8} "
              f"{milliseconds(row.ttft(95)):>6} {milliseconds(row.ttft(99)):>6} "
              f"{milliseconds(row.tbt_p95):>7} {row.total('frames_sent'):11d} "
              f"{row.processed:9d} {row.fps_per_session:8.2f} {row.cpu_cores:9.2f} "
              f"{row.rss_mb:6.0f}")
    print()
    for row in rows:
        drops = ", ".join(f"{k} {v}" for k, v in sorted(row.drops().items()) if v) or "none"
        refused = ", ".join(f"{k} {v}" for k, v in sorted(row.refused.items())) or "none"
        latency = next((r.stats["latency"] for r in row.results if r.stats), {})
        load = next((r.stats["load"] for r in row.results if r.stats), {})
        print(f"N={row.clients}: frames dropped by reason: {drops}; refused: {refused}; engine "
              f"step p50 {latency.get('step_ms_p50', float('nan')):.0f} ms, p95 "
              f"{latency.get('step_ms_p95', float('nan')):.0f} ms; live fps at the end "
              f"{load.get('fps', float('nan')):.2f} ({load.get('reason') or 'not degraded'})")
    for row in rows:
        for name, asr in row.recognisers().items():
            print(f"N={row.clients} recogniser {name}: {asr['segments']} segments in "
                  f"{asr['calls']} calls ({asr['audio_s']:.0f} s of speech), busy "
                  f"{asr['busy_s']:.0f} s ({asr['busy_s'] / row.seconds:.2f} cores), queue wait "
                  f"p95 {milliseconds(asr['wait_p95_s'] or float('nan'))} ms, "
                  f"{asr['dropped']} left unrecognised (queue full)")
        if (speech := row.speech()) is not None:
            print(f"N={row.clients} speech: {speech_line(speech)}")
    for row in rows:
        served = [r for r in row.results if r.asked]
        if len(served) > 1:
            p95s = [percentile(r.ttfts, 95) for r in served if r.ttfts]
            shares = [r.answered / r.asked for r in served]
            print(f"N={row.clients} fairness: answered per client {min(shares):.0%}..."
                  f"{max(shares):.0%}; per-client TTFT p95 "
                  f"{milliseconds(min(p95s, default=float('nan')))}..."
                  f"{milliseconds(max(p95s, default=float('nan')))} ms")
    base = rows[0]
    for row in rows[1:]:
        print(f"N={row.clients} vs N={base.clients}: TTFT p95 x{row.ttft(95) / base.ttft(95):.1f}"
              f", answered {_fraction(row)} vs {_fraction(base)}")


def _fraction(row: Row) -> str:
    asked = row.total("asked")
    return f"{row.total('answered')}/{asked}" if asked else "0/0"


def plot(rows: list[Row], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    n = [r.clients for r in rows]
    for q in (50, 95, 99):
        left.plot(n, [r.ttft(q) for r in rows], marker="o", label=f"TTFT p{q}")
    left.set_xlabel("live clients")
    left.set_ylabel("seconds")
    left.legend()
    right.plot(n, [r.total("answered") / max(1, r.total("asked")) for r in rows], marker="o",
               label="answered")
    right.plot(n, [r.fps_per_session / max(1e-9, r.results[0].frames_sent / r.seconds)
                   for r in rows], marker="o", label="processed / sent frames")
    right.set_xlabel("live clients")
    right.set_ylim(0, 1.05)
    right.legend()
    fig.tight_layout()
    path = out / "live.png"
    fig.savefig(path, dpi=100)
    return path


async def run_live(args) -> None:
    server = None
    url = args.url
    if url is None:
        server = ServerProcess(serve_arguments(args))
        await server.start()
        url = f"ws://127.0.0.1:{server.port}/ws"
        print(f"server pid {server.process.pid} on {url}")
    clips = sentence_clips() if args.speech else None
    if args.speech and clips is None:
        print("espeak-ng is not installed: the clients send room noise, not speech")
    print(f"cpu: {simd_flags()}, {psutil.cpu_count()} cores; native kernels built for "
          f"{isa_cap()} ({CPU_ISA_ENV})")
    rows = []
    try:
        for clients in [int(n) for n in args.clients.split(",")]:
            print(f"N={clients}: {args.seconds:g} s at {args.fps:g} fps, a question every "
                  f"{args.question_every:g} s, "
                  f"{'speech about half the time' if clips else 'room noise'}", flush=True)
            rows.append(await run_row(url, server, clients, args, clips))
            if server is not None:
                await settle(server)
                await asyncio.sleep(3.0)  # a load-governor tick with nobody on: a fresh row
    finally:
        if server is not None:
            await server.stop()
    print_rows(rows)
    print(f"plot: {plot(rows, Path(args.out))}")


def run_live_bench(args) -> None:
    """Entry point of `streamgrok bench live`."""
    set_idle_spin()  # the server it starts inherits it
    asyncio.run(run_live(args))
