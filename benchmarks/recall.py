"""`python -m benchmarks kv --parts recall`: what the host tier and recall win back.

Model-independent fidelity first (a 135M model answers retrieval questions poorly even with
the full cache): for streams of prose and of observer-style notes, at resident budgets of a
fraction of the context, an evicting cache answers a question with recall off and on, and is
compared with the full cache on the same tokens (all within the model's trained context):

* exact KV hit rate: the share of the full cache's attention (the question's last token and
  every answer token, every layer and head) that falls on tokens the evicting answer had
  resident when it ran; beside it the hit rate recall estimated from its page summaries;
* KL divergence and top-1 agreement of the next-token distributions over the answer tokens
  (the full cache's greedy answer, teacher-forced).

Then task accuracy (a pass key in prose, a plate number in camera notes, at several depths),
the cost (time from the question to its first token, recall's share of it, bytes moved, host
memory) and the working set over a long stream that asks questions with recall on.
"""

from __future__ import annotations

import itertools
import random
import statistics
import time
from dataclasses import dataclass

import psutil
import torch
from tqdm import tqdm

from benchmarks.caches import bench_cache
from benchmarks.corpus import long_ids, prose_text
from streamgrok.cache.paged_cache import PagedKVCache
from streamgrok.cache.streaming import feed
from streamgrok.cache.tiers.recall import attention_scale, causal_logits
from streamgrok.cache.tokens import STREAM
from streamgrok.loading.loader import LoadedModel
from streamgrok.model.batch import BatchMetadata

STREAM_KINDS = ("prose", "notes")
# recall off; recall of the budget only (the guard off); recall with the guard (the default)
MODES = {"off": None, "budget": 0.0, "guard": None}
TTFT_ROUNDS = 7  # timed question passes of each kind, taking turns
TIMING_FORK = 4  # the fork a timed question pass runs on (0: the stream)
QUESTIONS = {
    "prose": "\n\nQuestion: What does the text above explain? Answer in one sentence.\nAnswer:",
    "notes": "\n\nQuestion: What did camera 2 see, and when?\nAnswer:",
}


@dataclass
class RecallBenchOptions:
    """What the recall part runs (set from `python -m benchmarks kv` options)."""

    contexts: tuple[int, ...] = (4096, 7168)
    fractions: tuple[float, ...] = (0.05, 0.1, 0.25)
    policy: str = "redundancy"
    answer_tokens: int = 32
    depths: tuple[float, ...] = (0.05, 0.5, 0.95)
    trials: int = 2
    flat_tokens: int = 200_000
    flat_questions: int = 5
    parts: tuple[str, ...] = ("stream", "fidelity", "retrieval")
    budget: int = 2048
    chunk: int = 512
    in_stream: tuple[bool, ...] = (False, True)  # recall in the stream off, on (fidelity)


# -- streams --------------------------------------------------------------------------------

def notes_text(lines: int, seed: int) -> str:
    """Observer-style notes of a few cameras, one event per line, with times."""
    rng = random.Random(seed)
    colours = ["red", "grey", "blue", "white", "green", "black", "yellow"]
    events = [
        lambda: f"motion {rng.randint(2, 60)}% {rng.choice(['left', 'right', 'up', 'down'])}",
        lambda: f"colours now {rng.choice(colours)} and {rng.choice(colours)}",
        lambda: f"{rng.randint(1, 4)} people in view",
        lambda: f"a person {rng.choice(['enters', 'leaves'])} at the "
                f"{rng.choice(['left', 'right'])} edge",
        lambda: f"text read: {rng.choice(['EXIT', 'GATE', 'OPEN', 'NO PARKING', 'LOADING'])}",
        lambda: f"a {rng.choice(colours)} {rng.choice(['car', 'van', 'bike', 'truck'])} "
                f"passes {rng.choice(['left to right', 'right to left'])}",
        lambda: "scene cut",
    ]
    out = []
    for i in range(lines):
        t = 2 * i + rng.randint(0, 1)
        out.append(f"[{t // 60:02d}:{t % 60:02d}] camera {rng.randint(1, 4)}: "
                   f"{rng.choice(events)()}.")
    return "\n".join(out)


def stream_ids(loaded: LoadedModel, kind: str, tokens: int, seed: int = 0) -> list[int]:
    tok = loaded.tokenizer
    text = prose_text(tokens * 8, skip_chars=seed * 50_000) if kind == "prose" else \
        notes_text(tokens // 8, seed)
    ids = tok.encode(text)
    if len(ids) < tokens:
        raise RuntimeError(f"the {kind} stream holds only {len(ids)} tokens")
    return ids[:tokens]


# -- one answer -----------------------------------------------------------------------------

def prefill(model, cache: PagedKVCache, seq_id: int, ids: list[int], all_logits: bool = False
            ) -> torch.Tensor:
    """Append ids to a sequence without evicting (an answer's fork); returns logits."""
    part = torch.tensor(ids, dtype=torch.long, device=model.device)
    batch = BatchMetadata.build([seq_id], [len(ids)], model.device)
    if all_logits:
        batch.logit_rows = None
    with torch.inference_mode():
        return model(part, batch, cache.attention)


@dataclass
class Answer:
    """One answer on a fork: its logits over the answer positions and what recall did."""

    logits: torch.Tensor  # [A, vocab], rows: the question's last token, answer[:-1]
    recalled: int = 0
    estimated_hit: float | None = None
    bytes_moved: int = 0
    resident: list[torch.Tensor] | None = None  # per layer, stream indices it attended


def _question_pass(model, cache: PagedKVCache, fork: int, question: list[int], room: int,
                   mode: str) -> tuple[torch.Tensor, object, float]:
    """The question on a fresh fork of sequence 0, recalling as it is prefilled (as the
    engine does) unless `mode` is off: (its logits, recall's result, seconds taken)."""
    cache.fork(0, fork)
    started = time.perf_counter()
    if mode != "off":
        cache.recall_next_pass(fork, room=room, min_hit_rate=MODES[mode])
    first = prefill(model, cache, fork, question)
    result = cache.take_recall(fork) if mode != "off" else None
    return first, result, time.perf_counter() - started


def forced_answer(model, cache: PagedKVCache, fork: int, question: list[int],
                  answer: list[int], mode: str = "off") -> Answer:
    """The question on a fork of sequence 0 (recalling as it is prefilled, as the engine
    does, when asked), then the answer tokens teacher-forced. Untimed: `question_times`."""
    first, result, _ = _question_pass(model, cache, fork, question, len(answer) + 1, mode)
    rest = prefill(model, cache, fork, answer[:-1], all_logits=True) if len(answer) > 1 else \
        first[:0]
    resident = [rec.column(STREAM).clone() for rec in cache.sequences[fork].layers]
    cache.remove_sequence(fork)
    out = Answer(torch.cat([first[-1:], rest]).float(), resident=resident)
    if result is not None:
        out.recalled, out.estimated_hit = result.tokens, result.hit_rate
        out.bytes_moved = result.bytes_moved
    return out


def question_times(model, passes: dict[str, tuple[PagedKVCache, str]], question: list[int],
                   room: int, rounds: int = TTFT_ROUNDS) -> dict[str, tuple[float, float]]:
    """Per kind of question pass (a cache and a recall mode), the median seconds from the
    question's first token to the first answer token's logits and the median seconds of its
    recall, each pass on a fresh fork. The kinds take turns, round after round, so a drift
    in this machine's speed reaches all of them alike; one untimed round first, then the
    compilations it started are waited for."""
    times: dict[str, list[tuple[float, float]]] = {kind: [] for kind in passes}
    for round_ in range(rounds + 1):
        for kind, (cache, mode) in passes.items():
            _, result, seconds = _question_pass(model, cache, TIMING_FORK, question, room, mode)
            cache.remove_sequence(TIMING_FORK)
            if round_:
                times[kind].append((seconds, result.seconds if result is not None else 0.0))
        if not round_:
            for cache, _ in passes.values():
                wait_for_compiles(cache)
    return {kind: (statistics.median(t for t, _ in got), statistics.median(r for _, r in got))
            for kind, got in times.items()}


def timed_feed(model, cache: PagedKVCache, ids: list[int], chunk: int) -> float:
    """Stream `ids` into sequence 0 of `cache`; returns the seconds it took."""
    started = time.perf_counter()
    feed(model, cache, 0, ids, chunk=chunk)
    return time.perf_counter() - started


def wait_for_compiles(cache: PagedKVCache) -> None:
    """Let the paged reads and recall's scoring finish compiling (they compile on background
    threads that would otherwise share the cores with what is timed)."""
    cache.kernels.paged_reader.wait_compiled()
    cache.recaller.scorer.wait_compiled()


def full_answer(model, cache: PagedKVCache, fork: int, question: list[int], tokens: int
                ) -> tuple[list[int], torch.Tensor, list[torch.Tensor]]:
    """The full cache's greedy answer, its logits, and its attention probabilities of those
    answer positions over every cached token, per layer [A, heads, n]."""
    cache.fork(0, fork)
    prefill(model, cache, fork, question[:-1])
    cache.capture_queries(fork, keep=tokens)
    logits = [prefill(model, cache, fork, question[-1:])[-1]]
    answer = [int(logits[-1].argmax())]
    while len(answer) < tokens:
        logits.append(prefill(model, cache, fork, answer[-1:])[-1])
        answer.append(int(logits[-1].argmax()))
    probs = attention_probabilities(cache, fork)
    cache.remove_sequence(fork)
    return answer, torch.stack(logits).float(), probs


def attention_probabilities(cache: PagedKVCache, seq_id: int) -> list[torch.Tensor]:
    """Softmax attention [R, heads, n] of the sequence's captured queries over its tokens."""
    capture = cache.captured_queries(seq_id)
    scale = attention_scale(cache.model_config.head_dim)
    out = []
    for rec, queries in zip(cache.sequences[seq_id].layers, capture.layers):
        q_rot, k_rot, positions, _ = cache.recaller.rotated(rec, rec.length, queries)
        logits = causal_logits(q_rot, k_rot, positions, scale)
        out.append(logits.softmax(-1).reshape(q_rot.shape[0], q_rot.shape[1], -1).cpu())
    return out


def exact_hit_rate(probs: list[torch.Tensor], resident: list[torch.Tensor],
                   first_answer_stream: int) -> float:
    """Share of the full cache's attention on tokens the evicting answer had: its resident
    stream indices per layer, plus every token from the answer on (its own)."""
    shares = []
    for layer_probs, layer_streams in zip(probs, resident):
        n = layer_probs.shape[-1]
        stream = torch.arange(n, dtype=torch.float64)  # the full cache keeps every token
        held = torch.isin(stream, layer_streams) | (stream >= first_answer_stream)
        shares.append(float(layer_probs[..., held].sum(-1).mean()))
    return sum(shares) / len(shares)


def kl_top1(full: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    logp = torch.log_softmax(full, -1)
    logq = torch.log_softmax(other, -1)
    kl = float((logp.exp() * (logp - logq)).sum(-1).mean())
    return kl, float((full.argmax(-1) == other.argmax(-1)).float().mean())


def host_gib_for(loaded: LoadedModel, tokens: int) -> float:
    """A host tier that holds `tokens` evicted tokens of every layer (float storage)."""
    cfg = loaded.config
    per_token = 2 * cfg.num_kv_heads * cfg.head_dim * loaded.model.dtype.itemsize
    return tokens * per_token * cfg.num_layers * 1.1 / 2**30 + 0.01


# -- the parts ------------------------------------------------------------------------------

def run_recall(loaded: LoadedModel, options: RecallBenchOptions, out_dir) -> dict:
    """Fidelity, retrieval accuracy, cost and the long-stream working set."""
    trained = loaded.config.max_positions
    too_long = [c for c in options.contexts if c + 64 + options.answer_tokens > trained]
    if too_long:
        raise ValueError(f"recall contexts {too_long} do not fit the model's trained context "
                         f"({trained}) with a question and an answer")
    unknown = set(options.parts) - {"stream", "fidelity", "retrieval"}
    if unknown:
        raise ValueError(f"unknown recall parts {sorted(unknown)} (choose from stream, "
                         f"fidelity, retrieval)")
    results = {}
    if "stream" in options.parts:  # first: its RSS is then this part's own
        results["stream"] = long_stream(loaded, options)
    if "fidelity" in options.parts:
        results["fidelity"] = fidelity(loaded, options)
        _plot(results["fidelity"], options, out_dir)
    if "retrieval" in options.parts:
        results["retrieval"] = retrieval(loaded, options)
    return results


def fidelity(loaded: LoadedModel, options: RecallBenchOptions) -> list[dict]:
    model, tok = loaded.model, loaded.tokenizer
    rows = []
    total = len(STREAM_KINDS) * len(options.contexts) * (
        1 + len(options.fractions) * len(options.in_stream))
    bar = tqdm(total=total, desc="benchmarks kv recall fidelity", leave=False)
    for kind in STREAM_KINDS:
        question = tok.encode(QUESTIONS[kind])
        for context in options.contexts:
            ids = stream_ids(loaded, kind, context)
            full = bench_cache(loaded, "full", None)
            full.add_sequence(0)
            full_stream_s = timed_feed(model, full, ids, options.chunk)
            answer, full_logits, probs = full_answer(model, full, 1, question,
                                                     options.answer_tokens)
            bar.update()
            first_answer = context + len(question)
            for fraction, in_stream in itertools.product(options.fractions, options.in_stream):
                cache = bench_cache(loaded, options.policy, int(context * fraction),
                                    host_tier_gib=host_gib_for(loaded, context),
                                    recall_in_stream=in_stream)
                cache.add_sequence(0)
                stream_s = timed_feed(model, cache, ids, options.chunk)
                passes = {"full": (full, "off"), **{mode: (cache, mode) for mode in MODES}}
                times = question_times(model, passes, question, len(answer) + 1)
                for mode in MODES:
                    got = forced_answer(model, cache, 3, question, answer, mode)
                    kl, top1 = kl_top1(full_logits, got.logits)
                    rows.append({
                        "stream": kind, "context": context, "fraction": fraction,
                        "in_stream": in_stream, "recall": mode,
                        "hit": exact_hit_rate(probs, got.resident, first_answer),
                        "estimated": got.estimated_hit, "kl": kl, "top1": top1,
                        "recalled": got.recalled / loaded.config.num_layers,
                        "ttft_ms": times[mode][0] * 1e3, "recall_ms": times[mode][1] * 1e3,
                        "full_ttft_ms": times["full"][0] * 1e3, "bytes": got.bytes_moved,
                        "host_mib": cache.tier.used_bytes / 2**20, "stream_s": stream_s,
                        "full_stream_s": full_stream_s,
                    })
                del cache
                bar.update()
            del full
    bar.close()
    _print_fidelity(rows, options)
    return rows


def _print_fidelity(rows: list[dict], options: RecallBenchOptions) -> None:
    print(f"\n[recall fidelity] policy {options.policy}; budget = resident share of the "
          f"context; {options.answer_tokens} answer tokens (the full cache's greedy answer) "
          f"teacher-forced after a question; recall off, on with the budget only (budget: as "
          f"many tokens as the layer budget), or on with the hit-rate guard at 0.95 (guard); "
          f"in stream: whether the streamed chunks recalled too (recall_in_stream); "
          f"hit = share of the full cache's attention on tokens resident in the answer "
          f"(exact), est = recall's own estimate; TTFT = question to first answer logits, "
          f"median of {TTFT_ROUNDS} passes of each kind (full cache, off, budget, guard) "
          f"taking turns on the same stream; stream s = the stream's prefill (chunks of "
          f"{options.chunk}) and eviction")
    print(f"{'stream':<6} {'context':>7} {'budget':>6} {'in stream':>9} {'recall':>6} "
          f"{'hit':>6} {'est':>6} {'KL':>7} {'top-1':>6} {'recalled/layer':>14} "
          f"{'TTFT ms':>8} {'recall ms':>9} {'full TTFT':>9} {'MiB moved':>9} "
          f"{'host MiB':>8} {'stream s':>8} {'full s':>6}")
    for r in rows:
        est = "-" if r["estimated"] is None else f"{r['estimated']:.3f}"
        print(f"{r['stream']:<6} {r['context']:>7} {r['fraction']:>6.0%} "
              f"{_on(r['in_stream']):>9} {r['recall']:>6} {r['hit']:>6.3f} {est:>6} "
              f"{r['kl']:>7.4f} {r['top1']:>6.0%} {r['recalled']:>14.0f} "
              f"{r['ttft_ms']:>8.0f} {r['recall_ms']:>9.0f} {r['full_ttft_ms']:>9.0f} "
              f"{r['bytes'] / 2**20:>9.1f} {r['host_mib']:>8.1f} {r['stream_s']:>8.1f} "
              f"{r['full_stream_s']:>6.1f}")
    for fraction, in_stream in itertools.product(options.fractions, options.in_stream):
        chosen = {mode: [r for r in rows if r["fraction"] == fraction and r["recall"] == mode
                         and r["in_stream"] == in_stream] for mode in MODES}
        where = f"at {fraction:.0%}, in stream {_on(in_stream):<3}"
        for mode in MODES:
            if not chosen[mode]:
                continue
            mean = {k: statistics.mean(r[k] for r in chosen[mode])
                    for k in ("hit", "kl", "top1", "ttft_ms", "full_ttft_ms")}
            print(f"mean {where}, recall {mode:<6}: hit {mean['hit']:.3f}, KL "
                  f"{mean['kl']:.4f}, top-1 {mean['top1']:.0%}, TTFT {mean['ttft_ms']:.0f} ms "
                  f"({mean['ttft_ms'] / mean['full_ttft_ms']:.2f}x the full cache's "
                  f"{mean['full_ttft_ms']:.0f} ms)")
        off = [r["ttft_ms"] for r in chosen["off"]]
        for mode in ("budget", "guard"):
            on = [r["ttft_ms"] for r in chosen[mode]]
            if off and on:
                t_off, t_on = statistics.mean(off), statistics.mean(on)
                print(f"TTFT overhead of recall ({mode}) {where}: {t_on / t_off - 1:+.0%} "
                      f"({t_off:.0f} -> {t_on:.0f} ms from the question to its first token)")
        if chosen["off"]:
            stream_s = statistics.mean(r["stream_s"] for r in chosen["off"])
            full_s = statistics.mean(r["full_stream_s"] for r in chosen["off"])
            print(f"stream prefill {where}: {stream_s:.1f} s ({stream_s / full_s:.2f}x the "
                  f"full cache's {full_s:.1f} s)")


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def needle_case(loaded: LoadedModel, task: str, context: int, depth: float, rng: random.Random
                ) -> tuple[list[int], list[int], str]:
    """(stream ids, question ids, the expected answer) with the needle at `depth`."""
    tok = loaded.tokenizer
    if task == "passkey":
        key = f"{rng.randint(100000, 999999)}"
        needle = tok.encode(f" The pass key is {key}. Remember it. {key} is the pass key. ")
        body = stream_ids(loaded, "prose", context, seed=rng.randint(0, 20))
        question = tok.encode("\n\nWhat is the pass key? The pass key is")
    else:
        key = f"{rng.randint(1000, 9999)}"
        needle = tok.encode(f"\n[12:07] camera 3: a red van with plate KX {key} stops at "
                            f"gate 7.\n")
        body = stream_ids(loaded, "notes", context, seed=rng.randint(0, 1000))
        question = tok.encode("\n\nWhich plate did the red van at gate 7 have? It had plate KX")
    body = body[: context - len(needle) - len(question)]
    cut = int(len(body) * depth)
    return body[:cut] + needle + body[cut:], question, key


def retrieval(loaded: LoadedModel, options: RecallBenchOptions) -> dict:
    """Pass key in prose and plate in notes, at each depth: full cache, recall off, on."""
    model, tok = loaded.model, loaded.tokenizer
    context = max(options.contexts)
    fraction = 0.1 if 0.1 in options.fractions else options.fractions[0]
    budget = int(context * fraction)
    rng = random.Random(4321)
    hits: dict[tuple[str, float, str], int] = {}
    tasks = ("passkey", "notes")
    bar = tqdm(total=len(tasks) * len(options.depths) * options.trials,
               desc="benchmarks kv recall retrieval", leave=False)
    for task in tasks:
        for depth in options.depths:
            for _ in range(options.trials):
                ids, question, key = needle_case(loaded, task, context, depth, rng)
                for cache, labels in retrieval_caches(loaded, options, context, budget):
                    cache.add_sequence(0)
                    feed(model, cache, 0, ids, chunk=options.chunk)
                    for mode, label in labels.items():
                        text = tok.decode(greedy_answer(model, cache, question, 8, mode))
                        hits[(task, depth, label)] = hits.get((task, depth, label), 0) + (
                            key in text)
                    del cache
                bar.update()
    bar.close()
    print(f"\n[recall retrieval] context {context}, budget {fraction:.0%} ({budget} tokens "
          f"resident per layer), policy {options.policy}, {options.trials} trials per depth; "
          f"correct answers")
    columns = ["full", "off", "on"] + (["stream"] if True in options.in_stream else [])
    print(f"{'task':<8} {'depth':>5} " + " ".join(f"{c:>6}" for c in columns)
          + "   (stream: on, with recall in the stream too)")
    for task in tasks:
        for depth in options.depths:
            cells = [f"{hits.get((task, depth, m), 0)}/{options.trials}" for m in columns]
            print(f"{task:<8} {depth:>5.0%} " + " ".join(f"{c:>6}" for c in cells))
    return {f"{t}@{d}@{m}": n for (t, d, m), n in hits.items()}


def retrieval_caches(loaded: LoadedModel, options: RecallBenchOptions, context: int,
                     budget: int):
    """The retrieval part's caches, one at a time, each with {recall mode: column}: the full
    cache; the evicting one with recall off and on; with recall in the stream too, when the
    options ask for it."""
    host = host_gib_for(loaded, context)
    yield bench_cache(loaded, "full", None), {"off": "full"}
    yield (bench_cache(loaded, options.policy, budget, host_tier_gib=host),
           {"off": "off", "guard": "on"})
    if True in options.in_stream:
        yield (bench_cache(loaded, options.policy, budget, host_tier_gib=host,
                           recall_in_stream=True), {"guard": "stream"})


def greedy_answer(model, cache: PagedKVCache, question: list[int], tokens: int,
                  mode: str) -> list[int]:
    cache.fork(0, 9)
    if mode != "off":
        cache.recall_next_pass(9, room=tokens + 1, min_hit_rate=MODES[mode])
    logits = prefill(model, cache, 9, question)
    out = [int(logits[-1].argmax())]
    while len(out) < tokens:
        out.append(int(prefill(model, cache, 9, out[-1:])[-1].argmax()))
    cache.remove_sequence(9)
    return out


def long_stream(loaded: LoadedModel, options: RecallBenchOptions) -> dict:
    """Working-set pages, host tier and RSS over a long stream asking with recall on."""
    model, tok = loaded.model, loaded.tokenizer
    total = options.flat_tokens
    host_gib = host_gib_for(loaded, 4 * options.budget)  # the tier fills and drops
    in_stream = True in options.in_stream  # the chunks' recalls are transients to keep flat
    cache = bench_cache(loaded, options.policy, options.budget, host_tier_gib=host_gib,
                        recall_in_stream=in_stream)
    cache.add_sequence(0)
    question = tok.encode(QUESTIONS["prose"])
    ids = long_ids(tok, prose_text, total)
    process = psutil.Process()
    every = total // options.flat_questions
    rows = []
    # each row is printed as it is measured, so a stream stopped early still shows its rows
    print(f"\n[recall long stream] {total} tokens of prose, budget {options.budget}, host "
          f"tier {host_gib:.2f} GiB, a question with recall every {every} tokens, recall "
          f"in the stream {_on(in_stream)}", flush=True)
    print(f"{'tokens':>9} {'pages':>7} {'KV MiB':>8} {'host MiB':>9} {'dropped':>10} "
          f"{'RSS MiB':>8} {'s':>6}", flush=True)
    bar = tqdm(total=total, desc="benchmarks kv recall long stream", unit="tok", leave=False)
    started = time.perf_counter()
    for start in range(0, total, every):
        feed(model, cache, 0, ids[start : start + every], chunk=options.chunk)
        bar.update(min(every, total - start))
        forced_answer(model, cache, 5, question, question[:4], "guard")
        row = (min(start + every, total), cache.pool.used_pages, cache.tier.used_bytes,
               cache.tier.stats.dropped_tokens, process.memory_info().rss)
        rows.append(row)
        done, pages, host, dropped, rss = row
        tqdm.write(f"{done:>9} {pages:>7} {pages * cache.page_bytes / 2**20:>8.1f} "
                   f"{host / 2**20:>9.1f} {dropped:>10} {rss / 2**20:>8.0f} "
                   f"{time.perf_counter() - started:>6.0f}")
    bar.close()
    print(f"{total} tokens in {time.perf_counter() - started:.0f} s")
    # from the first question after the host tier filled (it drops pages from then on):
    # before that it grows by design
    full = next((row for row in rows if row[3] > 0), rows[0])
    last = rows[-1]
    drift = {"pages": last[1] / full[1] - 1, "host": last[2] / max(1, full[2]) - 1,
             "rss": last[4] / full[4] - 1}
    print(f"drift from the question at {full[0]} tokens (the host tier full) to the last: "
          f"working set {drift['pages']:+.1%}, host tier {drift['host']:+.1%}, RSS "
          f"{drift['rss']:+.1%} (flat = within 5%)")
    return {"rows": rows, "drift": drift}


def _plot(rows: list[dict], options: RecallBenchOptions, out_dir) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for metric, ax, label in (("hit", axes[0], "exact KV hit rate"),
                              ("top1", axes[1], "top-1 agreement with the full cache")):
        for (mode, style, colour), in_stream in itertools.product(
                (("off", "--", "tab:gray"), ("budget", ":", "tab:blue"),
                 ("guard", "-", "tab:red")), options.in_stream):
            xs = list(options.fractions)
            ys = [100 * statistics.mean(r[metric] for r in rows if r["fraction"] == f
                                        and r["recall"] == mode and r["in_stream"] == in_stream)
                  for f in xs]
            ax.plot([x * 100 for x in xs], ys, style, marker="o" if in_stream else "x",
                    color=colour, alpha=1.0 if in_stream else 0.45,
                    label=f"recall {mode}, in stream {_on(in_stream)}")
        ax.set_xlabel("resident budget (% of the context)")
        ax.set_ylabel(f"{label} (%)")
        ax.set_ylim(0, 105)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "kv_recall.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")
