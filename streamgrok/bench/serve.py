"""`streamgrok bench serve`: many live sessions at once vs the same sessions one at a time.

Each session streams frame tokens (2 fps, 4 tokens each) and a timestamped note every 2 s
while it asks two questions; the baseline runs sessions one after another on the same engine.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import torch

from streamgrok.bench.timing import percentile
from streamgrok.cache.config import CacheConfig
from streamgrok.engine import Engine, EngineConfig
from streamgrok.engine.metrics import AnswerMetrics
from streamgrok.loading.loader import LoadedModel
from streamgrok.model.sampling import SamplingParams
from streamgrok_kernels.cpu_native import CPU_ISA_ENV, isa_cap, simd_flags

SYSTEM = "You are a helpful assistant watching a live video stream. Notes arrive with timestamps."
QUESTIONS = ["What is happening right now?", "Summarise the last notes in one sentence."]
NOTES = [
    "a person walks into the kitchen", "the kettle starts to boil", "a cat jumps on the table",
    "someone opens the window", "two people sit down and talk", "the lights are switched off",
]


@dataclass
class RunResult:
    answers: list[AnswerMetrics]
    done_at: list[float]
    wall_s: float
    frames_dropped: int

    @property
    def tokens(self) -> int:
        return sum(a.tokens for a in self.answers)

    def answering_seconds(self) -> float:
        """Time during which at least one answer was in flight (union of intervals)."""
        spans = sorted(zip((a.asked_at for a in self.answers), self.done_at))
        total, end = 0.0, float("-inf")
        for start, stop in spans:
            if stop > end:
                total += stop - max(start, end)
                end = stop
        return total

    def throughput(self) -> float:
        return self.tokens / max(self.answering_seconds(), 1e-9)

    def ttfts(self) -> list[float]:
        return [a.ttft for a in self.answers if a.ttft is not None]

    def gaps(self) -> list[float]:
        return [g for a in self.answers for g in a.gaps]


async def _session(engine: Engine, index: int, max_tokens: int, result: RunResult,
                   embed: torch.nn.Module) -> None:
    session = engine.new_session(SYSTEM)
    stop = asyncio.Event()

    async def feeder() -> None:
        frame = 0
        started = time.monotonic()
        while not stop.is_set():
            t = time.monotonic() - started
            ids = torch.randint(0, embed.num_embeddings, (4,))
            session.append_embeddings(embed(ids), timestamp=t, source=frame)
            if frame % 4 == 0:
                note = NOTES[(index + frame // 4) % len(NOTES)]
                await session.append_message(f"[00:{int(t):02d}] {note}", timestamp=t)
            frame += 1
            await asyncio.sleep(0.5)

    feeding = asyncio.create_task(feeder())
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=frozenset())
    try:
        for delay, question in zip((1.0, 1.5), QUESTIONS):
            await asyncio.sleep(delay)
            answer = session.ask(question, params)
            await answer.text()
            result.answers.append(answer.metrics)
            result.done_at.append(time.monotonic())
    finally:
        stop.set()
        await feeding
        result.frames_dropped += session.dropped_frames
        await session.close()


async def _run(engine: Engine, sessions: int, concurrent: bool, max_tokens: int) -> RunResult:
    result = RunResult([], [], 0.0, 0)
    embed = engine.loaded.model.embed
    started = time.monotonic()
    if concurrent:
        async def staggered(i: int) -> None:
            await asyncio.sleep(0.05 * i)
            await _session(engine, i, max_tokens, result, embed)
        await asyncio.gather(*(staggered(i) for i in range(sessions)))
    else:
        for i in range(sessions):
            await _session(engine, i, max_tokens, result, embed)
    result.wall_s = time.monotonic() - started
    return result


def _ms(values: list[float], q: float) -> str:
    return f"{percentile(values, q) * 1e3:7.0f}"


async def _bench(loaded: LoadedModel, counts: list[int], max_tokens: int, baseline_cap: int,
                 cache: CacheConfig, config: EngineConfig) -> dict:
    out = {}
    async with Engine(loaded, cache, config) as engine:
        await _run(engine, 1, False, 4)  # warm-up
        single = await _run(engine, min(baseline_cap, max(counts)), False, max_tokens)
        step_1 = percentile(single.gaps(), 50)
        print(f"baseline: {min(baseline_cap, max(counts))} sessions one at a time, "
              f"{single.throughput():.1f} tok/s, batch-1 step (TBT p50) {step_1 * 1e3:.0f} ms")
        header = (f"{'sessions':>8} {'tok/s':>7} {'x base':>7} {'TTFT p50':>9} {'p95':>7} "
                  f"{'p99':>7} {'TBT p50':>8} {'p95':>7} {'p99':>7} {'p95/step1':>10} "
                  f"{'dropped':>8}")
        print(header)
        for n in counts:
            run = await _run(engine, n, True, max_tokens)
            ratio = run.throughput() / single.throughput()
            ttft, gaps = run.ttfts(), run.gaps()
            print(f"{n:>8} {run.throughput():7.1f} {ratio:6.2f}x {_ms(ttft, 50):>9} "
                  f"{_ms(ttft, 95)} {_ms(ttft, 99)} {_ms(gaps, 50):>8} {_ms(gaps, 95)} "
                  f"{_ms(gaps, 99)} {percentile(gaps, 95) / step_1:9.2f}x "
                  f"{run.frames_dropped:>8}")
            out[n] = {"tok_s": run.throughput(), "ratio": ratio,
                      "ttft_p95_ms": percentile(ttft, 95) * 1e3,
                      "tbt_p95_ms": percentile(gaps, 95) * 1e3}
        snap = engine.snapshot()
        print(f"engine: {snap.steps} steps, step p50 {snap.step_ms_p50:.0f} ms, "
              f"p95 {snap.step_ms_p95:.0f} ms, evicted {snap.evicted_tokens} tokens")
    return out


async def _warm_up(loaded: LoadedModel, cache: CacheConfig, config: EngineConfig,
                   sessions: int, max_tokens: int) -> None:
    async with Engine(loaded, cache, config) as engine:
        await _run(engine, sessions, True, max_tokens)


def run_serve_bench(loaded: LoadedModel, counts: list[int], max_tokens: int = 24,
                    baseline_cap: int = 4, nano_batches: int = 1,
                    small_step_threads: tuple[int | None, ...] = (None,)) -> dict:
    """Print the serving table; the baseline runs `baseline_cap` sessions one at a time.
    Each `small_step_threads` value (threads of decode steps on CPU; None: the engine's
    default) gets its own engine, baseline and table, in this one run, after an untimed
    warm-up engine (repeat a value, e.g. 2,1,2,1, to see the run-to-run spread)."""
    threads = torch.get_num_threads()
    print(f"cpu: {simd_flags()} ({CPU_ISA_ENV}={isa_cap()})")
    print(f"model {loaded.name}  dtype {str(loaded.model.dtype).removeprefix('torch.')}  "
          f"threads {threads}  answer tokens {max_tokens}  nano-batches {nano_batches}")
    cache = CacheConfig(budget_tokens=1024, memory_gib=2.0)
    out = {}
    if len(small_step_threads) > 1:  # the process's first engine pays warm-ups the rest do not
        asyncio.run(_warm_up(loaded, cache, EngineConfig(nano_batches=nano_batches),
                             max(counts), max_tokens))
    for small in small_step_threads:
        config = EngineConfig(nano_batches=nano_batches, small_step_threads=small)
        label = threads if small is None else small
        print(f"\n[steps of <= {config.small_step_tokens} tokens on {label} thread(s), larger "
              f"on {threads}]")
        out[label] = asyncio.run(_bench(loaded, counts, max_tokens, baseline_cap, cache,
                                        config))
    return out
