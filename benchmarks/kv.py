"""`python -m benchmarks kv`: flat memory, passkey retrieval under budgets, streaming perplexity,
eviction overhead. Every part runs its baseline (the full cache) in the same invocation."""

from __future__ import annotations

import argparse
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch
from tqdm import tqdm

from benchmarks.caches import bench_cache
from benchmarks.corpus import long_ids, stdlib_text
from benchmarks.recall import RecallBenchOptions
from streamgrok.bench.timing import median, timed
from streamgrok.cache.config import CacheConfig
from streamgrok.cache.streaming import feed, greedy_continue
from streamgrok.cli.options import DEFAULTS, POLICIES, add_model_options, load_from_args
from streamgrok.loading.loader import LoadedModel
from streamgrok.model.batch import BatchMetadata

EVICTING = ("sink_window", "h2o", "snapkv", "redundancy", "pyramid")
PASSKEY_FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)


@dataclass
class KvBenchOptions:
    """What `python -m benchmarks kv` runs."""

    parts: tuple[str, ...] = ("flat", "passkey", "ppl", "overhead")
    tokens: int = 100_000
    budget: int = 2048
    flat_policy: str = "h2o"
    contexts: tuple[int, ...] = (2048, 4096, 7168)
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    budget_fractions: tuple[float, ...] = (0.1, 0.25, 0.5)
    policies: tuple[str, ...] = EVICTING
    ppl_tokens: int = 16_384
    chunk: int = 512
    kvp_ranks: tuple[int, ...] = (1, 2, 4)
    kvp_contexts: tuple[int, ...] = (1024, 4096)
    kvp_decode_steps: int = 8
    recall: RecallBenchOptions = field(default_factory=RecallBenchOptions)
    weights: str = "auto"
    out_dir: Path = Path("bench-results")
    results: dict = field(default_factory=dict)


def run_kv_bench(loaded: LoadedModel, options: KvBenchOptions) -> dict:
    """Run the chosen parts, print their tables, return the numbers."""
    print(f"model {loaded.name}  dtype {str(loaded.model.dtype).removeprefix('torch.')}  "
          f"threads {torch.get_num_threads()}")
    options.out_dir.mkdir(parents=True, exist_ok=True)
    runners = {"flat": flat_memory, "passkey": passkey, "ppl": perplexity,
               "overhead": eviction_overhead, "kvp": kv_parallel, "recall": recall,
               "paged": paged, "moe": experts_spread, "dtypes": kv_dtypes}
    for part in options.parts:
        if part not in runners:
            raise ValueError(f"unknown kv part {part!r} (choose from {', '.join(runners)})")
        options.results[part] = runners[part](loaded, options)
    return options.results


def kv_parallel(loaded: LoadedModel, options: KvBenchOptions) -> dict:
    """Decode step time with one sequence's KV sharded over 1, 2, 4 ranks (see bench.kvp)."""
    from benchmarks.kvp import run_kvp

    return run_kvp(loaded, options.weights, options.kvp_ranks, options.kvp_contexts,
                   options.kvp_decode_steps, options.chunk, options.out_dir)


def experts_spread(loaded: LoadedModel, options: KvBenchOptions) -> dict:
    """A mixture of experts with its experts and KV over 1, 2, 4 ranks (see bench.moe)."""
    from benchmarks.moe import run_moe

    return run_moe(loaded, options.weights, options.kvp_ranks, max(options.kvp_contexts),
                   options.kvp_decode_steps, options.chunk, options.out_dir)


def recall(loaded: LoadedModel, options: KvBenchOptions) -> dict:
    """The host tier and recall: fidelity, retrieval, cost, long stream (see bench.recall)."""
    from benchmarks.recall import run_recall

    return run_recall(loaded, options.recall, options.out_dir)


def flat_memory(loaded: LoadedModel, options: KvBenchOptions) -> dict:
    """Pages in use and process RSS at 10%, 50%, 100% of a long stream."""
    ids = long_ids(loaded.tokenizer, stdlib_text, options.tokens)
    cache = bench_cache(loaded, options.flat_policy, options.budget)
    cache.add_sequence(0)
    marks = {max(options.chunk, round(options.tokens * f / options.chunk) * options.chunk): f
             for f in (0.1, 0.5, 1.0)}
    marks[options.tokens] = 1.0
    rows = []
    process = psutil.Process()
    bar = tqdm(total=options.tokens, desc="benchmarks kv flat", unit="tok", leave=False)
    started = time.perf_counter()

    def record(done: int, _logits) -> None:
        bar.update(done - bar.n)
        if done in marks:
            rows.append((marks[done], done, cache.pool.used_pages, process.memory_info().rss,
                         max(cache.layer_lengths(0))))

    feed(loaded.model, cache, 0, ids, chunk=options.chunk, on_chunk=record)
    bar.close()
    elapsed = time.perf_counter() - started
    print(f"\n[flat memory] policy {options.flat_policy}, budget {options.budget} tokens/layer, "
          f"{options.tokens} tokens streamed in {elapsed:.0f} s "
          f"({options.tokens / elapsed:.0f} tok/s)")
    print(f"{'stream':>7} {'tokens':>9} {'pages':>7} {'KV MiB':>8} {'RSS MiB':>9} "
          f"{'max layer len':>14}")
    for frac, done, pages, rss, longest in rows:
        print(f"{frac:>6.0%} {done:>9} {pages:>7} {pages * cache.page_bytes / 2**20:>8.1f} "
              f"{rss / 2**20:>9.0f} {longest:>14}")
    first, last = rows[0], rows[-1]
    pages_drift = last[2] / first[2] - 1
    rss_drift = last[3] / first[3] - 1
    print(f"drift 10% -> 100%: pages {pages_drift:+.1%}, RSS {rss_drift:+.1%} "
          f"(flat = within 5%)")
    return {"rows": rows, "pages_drift": pages_drift, "rss_drift": rss_drift}


def passkey_prompt(tok, context: int, depth: float, key: str) -> list[int]:
    """A plain completion prompt of ~`context` tokens with the key inserted at `depth`."""
    needle = tok.encode(f" The pass key is {key}. Remember it. {key} is the pass key. ")
    question = tok.encode(" What is the pass key? The pass key is")
    filler = tok.encode(PASSKEY_FILLER)
    room = context - len(needle) - len(question)
    body = (filler * (room // len(filler) + 1))[:room]
    cut = int(len(body) * depth)
    return body[:cut] + needle + body[cut:] + question


def passkey(loaded: LoadedModel, options: KvBenchOptions) -> dict:
    """Passkey accuracy for every policy and budget, against the full cache."""
    tok = loaded.tokenizer
    rng = random.Random(1234)
    configs = [("full", None)] + [(p, f) for p in options.policies
                                   for f in options.budget_fractions]
    cases = [(c, d, f"{rng.randint(10000, 99999)}") for c in options.contexts
             for d in options.depths]
    accuracy: dict[tuple[str, float | None, int], float] = {}
    bar = tqdm(total=len(configs) * len(cases), desc="benchmarks kv passkey", leave=False)
    for policy, fraction in configs:
        for context in options.contexts:
            hits = 0
            for ctx, depth, key in cases:
                if ctx != context:
                    continue
                budget = None if fraction is None else int(context * fraction)
                cache = bench_cache(loaded, policy, budget, memory_gib=0.5)
                cache.add_sequence(0)
                ids = passkey_prompt(tok, context, depth, key)
                logits = feed(loaded.model, cache, 0, ids, chunk=options.chunk)
                answer = tok.decode(greedy_continue(loaded.model, cache, 0, logits, 7))
                hits += key in answer
                bar.update()
            accuracy[(policy, fraction, context)] = hits / len(options.depths)
    bar.close()
    print(f"\n[passkey] accuracy over depths {', '.join(f'{d:.0%}' for d in options.depths)}; "
          f"budget = fraction of the context kept per layer (mean over layers)")
    header = f"{'policy':<12} {'budget':>6} " + " ".join(f"{c:>6}" for c in options.contexts)
    print(header + f" {'mean':>6}")
    for policy, fraction in configs:
        values = [accuracy[(policy, fraction, c)] for c in options.contexts]
        label = "100%" if fraction is None else f"{fraction:.0%}"
        print(f"{policy:<12} {label:>6} " + " ".join(f"{v:>6.0%}" for v in values)
              + f" {sum(values) / len(values):>6.0%}")
    _plot_passkey(accuracy, options)
    return {f"{p}@{f}@{c}": a for (p, f, c), a in accuracy.items()}


def _plot_passkey(accuracy, options: KvBenchOptions) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(options.contexts), figsize=(4 * len(options.contexts), 3.4),
                             sharey=True)
    axes = [axes] if len(options.contexts) == 1 else list(axes)
    for ax, context in zip(axes, options.contexts):
        xs = list(options.budget_fractions)
        for policy in options.policies:
            ax.plot([x * 100 for x in xs], [accuracy[(policy, f, context)] * 100 for f in xs],
                    marker="o", label=policy)
        ax.axhline(accuracy[("full", None, context)] * 100, color="black", linestyle="--",
                   label="full cache")
        ax.set_title(f"context {context}")
        ax.set_xlabel("KV budget (% of context)")
        ax.set_ylim(-5, 105)
    axes[0].set_ylabel("passkey accuracy (%)")
    axes[-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path = options.out_dir / "kv_passkey.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")


def perplexity(loaded: LoadedModel, options: KvBenchOptions) -> dict:
    """Perplexity per 4k-token window of a long real text, streamed through each cache."""
    tok = loaded.tokenizer
    ids = tok.encode(stdlib_text(options.ppl_tokens * 5, skip_chars=3_000_000))
    ids = ids[: options.ppl_tokens + 1]
    window = 4096
    trained = loaded.config.max_positions
    configs = [("full", None)] + [(p, options.budget) for p in options.policies]
    table: dict[str, list[float]] = {}
    for policy, budget in configs:
        cache = bench_cache(loaded, policy, budget, memory_gib=2.0)
        cache.add_sequence(0)
        nll = torch.zeros(options.ppl_tokens)
        bar = tqdm(total=options.ppl_tokens, desc=f"benchmarks kv ppl {policy}", leave=False)

        def score(done: int, logits: torch.Tensor, nll=nll, bar=bar) -> None:
            start = done - logits.shape[0]
            targets = torch.tensor(ids[start + 1 : done + 1])
            n = targets.numel()
            nll[start : start + n] = torch.nn.functional.cross_entropy(
                logits[:n].float(), targets, reduction="none")
            bar.update(done - bar.n)

        feed(loaded.model, cache, 0, ids[:-1], chunk=options.chunk, all_logits=True,
             on_chunk=score)
        bar.close()
        table[policy] = [math.exp(float(nll[s : s + window].mean()))
                         for s in range(0, options.ppl_tokens, window)]
    print(f"\n[perplexity] {options.ppl_tokens} tokens of Python stdlib source; budget "
          f"{options.budget} tokens/layer; the model was trained on {trained} positions")
    spans = [f"{s // 1024}-{(s + window) // 1024}k" for s in range(0, options.ppl_tokens, window)]
    print(f"{'cache':<12} " + " ".join(f"{s:>9}" for s in spans))
    for policy, values in table.items():
        cells = []
        for s, v in zip(range(0, options.ppl_tokens, window), values):
            mark = "*" if policy == "full" and s + window > trained else " "
            cells.append(f"{v:>8.2f}{mark}")
        print(f"{policy:<12} " + " ".join(cells))
    print("* full cache past the trained context (absolute positions beyond "
          f"{trained})")
    return table


def paged(loaded: LoadedModel, options: KvBenchOptions) -> dict:
    """Paged decode steps, native CPU attention vs the PyTorch path (bench.paged_decode)."""
    from benchmarks.paged_decode import paged_decode

    return paged_decode(loaded, options.out_dir, options.chunk)


def kv_dtypes(loaded: LoadedModel, options: KvBenchOptions) -> dict:
    """Accuracy and step time of bfloat16 and int8 K/V against float32 (bench.kv_dtypes)."""
    from benchmarks.kv_dtypes import kv_dtypes as run_kv_dtypes

    return run_kv_dtypes(loaded, options.out_dir)


def eviction_overhead(loaded: LoadedModel, options: KvBenchOptions) -> dict:
    """Time per eviction pass and its share of decode time, per policy."""
    tok = loaded.tokenizer
    ids = tok.encode(stdlib_text(60_000))[: options.budget * 2]
    slack = CacheConfig(budget_tokens=options.budget).slack
    steps = 2 * (slack + 1)  # two eviction passes at the default slack
    results = {}
    print(f"\n[eviction overhead] budget {options.budget}, {steps} decode steps after "
          f"{len(ids)} tokens; evict when a layer exceeds budget + {slack} (the default slack)")
    print(f"{'policy':<12} {'step ms':>8} {'passes':>7} {'ms/pass':>8} {'share':>7} "
          f"{'vs full step':>13}")
    baseline = None
    for policy in ("full",) + tuple(options.policies):
        cache = bench_cache(loaded, policy, None if policy == "full" else options.budget)
        cache.add_sequence(0)
        feed(loaded.model, cache, 0, ids, chunk=options.chunk)
        before = (cache.stats.eviction_passes, cache.stats.eviction_seconds)
        step_times = []
        device = loaded.model.device
        token = torch.tensor([ids[-1]], device=device)
        with torch.inference_mode():
            for _ in range(steps):
                step_times.append(timed(
                    lambda token=token, cache=cache: loaded.model(
                        token, BatchMetadata.build([0], [1]), cache.attention), device))
                cache.evict([0])
        passes = cache.stats.eviction_passes - before[0]
        evict_s = cache.stats.eviction_seconds - before[1]
        step = median(step_times)
        baseline = baseline or step
        per_pass = evict_s / passes * 1e3 if passes else 0.0
        share = evict_s / (sum(step_times) + evict_s)
        print(f"{policy:<12} {step * 1e3:>8.1f} {passes:>7} {per_pass:>8.1f} {share:>7.1%} "
              f"{step / baseline:>12.2f}x")
        results[policy] = {"step_ms": step * 1e3, "ms_per_pass": per_pass, "share": share}
    return results


def register(benches: argparse._SubParsersAction) -> None:
    """Add `kv` and its arguments to the `python -m benchmarks` commands."""
    kv = benches.add_parser("kv", formatter_class=DEFAULTS,
                            help="KV cache: flat memory, passkey, perplexity, overhead")
    kv.add_argument("--parts", default="flat,passkey,ppl,overhead",
                    help="which parts to run (also: kvp, KV parallelism over local ranks; "
                         "recall, the host tier and recall; paged, decode steps with the "
                         "native CPU attention kernel vs the PyTorch path; moe, a mixture "
                         "of experts with experts and KV over the kvp ranks; dtypes, the "
                         "accuracy and step time of bfloat16 and int8 K/V vs float32)")
    kv.add_argument("--tokens", type=int, default=100_000, help="tokens streamed (flat part)")
    kv.add_argument("--budget", type=int, default=2048, help="tokens per layer")
    kv.add_argument("--flat-policy", default="h2o", choices=POLICIES,
                    help="policy of the flat-memory part")
    kv.add_argument("--contexts", default="2048,4096,7168", help="passkey context lengths")
    kv.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="passkey depths")
    kv.add_argument("--budget-fractions", default="0.1,0.25,0.5",
                    help="budgets as fractions of the context")
    kv.add_argument("--policies", default="sink_window,h2o,snapkv,redundancy,pyramid",
                    help="policies compared")
    kv.add_argument("--ppl-tokens", type=int, default=16_384, help="perplexity text length")
    kv.add_argument("--kvp-ranks", default="1,2,4", help="rank counts of the kvp part")
    kv.add_argument("--kvp-contexts", default="1024,4096",
                    help="contexts of the kvp part (the moe part: the largest)")
    kv.add_argument("--recall-contexts", default="4096,7168",
                    help="stream lengths of the recall part (within the trained context)")
    kv.add_argument("--recall-fractions", default="0.05,0.1,0.25",
                    help="resident budgets of the recall part, as fractions of the context")
    kv.add_argument("--recall-policy", default="redundancy", choices=POLICIES[1:],
                    help="eviction policy of the recall part")
    kv.add_argument("--recall-trials", type=int, default=2,
                    help="needles per task and depth in the recall part")
    kv.add_argument("--recall-stream-tokens", type=int, default=200_000,
                    help="tokens of the recall part's long stream")
    kv.add_argument("--recall-stream-questions", type=int, default=5,
                    help="questions (and measured rows) along the long stream")
    kv.add_argument("--recall-in-stream", default="off,on",
                    help="the recall part's fidelity with streamed chunks recalling off, on "
                         "or both (off,on)")
    kv.add_argument("--recall-parts", default="stream,fidelity,retrieval",
                    help="what the recall part runs")
    kv.add_argument("--out", default="bench-results", help="folder for plots")
    add_model_options(kv)
    kv.set_defaults(dtype="bfloat16")
    kv.set_defaults(run=run_from_args)


def run_from_args(args: argparse.Namespace) -> int:
    """Run the bench with the parsed command-line arguments."""
    run_kv_bench(
        load_from_args(args),
        KvBenchOptions(
            parts=tuple(args.parts.split(",")),
            tokens=args.tokens,
            budget=args.budget,
            flat_policy=args.flat_policy,
            contexts=tuple(int(x) for x in args.contexts.split(",")),
            depths=_floats(args.depths),
            budget_fractions=_floats(args.budget_fractions),
            policies=tuple(args.policies.split(",")),
            ppl_tokens=args.ppl_tokens,
            kvp_ranks=tuple(int(x) for x in args.kvp_ranks.split(",")),
            kvp_contexts=tuple(int(x) for x in args.kvp_contexts.split(",")),
            recall=RecallBenchOptions(
                contexts=tuple(int(x) for x in args.recall_contexts.split(",")),
                fractions=_floats(args.recall_fractions), policy=args.recall_policy,
                trials=args.recall_trials, flat_tokens=args.recall_stream_tokens,
                flat_questions=args.recall_stream_questions,
                parts=tuple(args.recall_parts.split(",")),
                in_stream=_on_off(args.recall_in_stream, "--recall-in-stream"),
                budget=args.budget),
            weights=args.weights,
            out_dir=Path(args.out),
        ),
    )
    return 0


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


def _on_off(text: str, option: str) -> tuple[bool, ...]:
    values = text.split(",")
    if set(values) - {"on", "off"}:
        raise ValueError(f"{option} takes off, on or off,on, not {text!r}")
    return tuple(value == "on" for value in values)
