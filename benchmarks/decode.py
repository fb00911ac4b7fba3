"""`python -m benchmarks decode`: prefill, batch-1 decode and aggregate decode of N sequences at
a real context, per weight format (each in its own process, so peak RSS is its own), with
teacher-forced accuracy against float32 and, with `--peer llama.cpp`, the same rows measured
by llama.cpp's own benchmarks on the same GGUF and threads. Ratios are from the same run."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.decode_worker import QUESTIONS
from streamgrok.bench.llama_cpp_peer import PeerUnavailable, find_binaries, run_peer
from streamgrok.bench.timing import measurement_env
from streamgrok.cli.options import CHAT_KV_DTYPES, DEFAULTS, add_model_options
from streamgrok.model.generate import KV_CACHE_DTYPES
from streamgrok.model.quantized import WEIGHT_FORMATS

AGREEMENT_TOKENS = 512

CHECKOUT = Path(__file__).resolve().parents[1]


def run_decode_bench(model: str | None, weights: list[str], threads: int | None,
                     prompt_tokens: int = 512, batches: list[int] | None = None,
                     context: int = 512, batch1_context: int = 64, steps: int = 12,
                     repeats: int = 3, peer: str | None = None, peer_bin: str | None = None,
                     kv_dtype: str = "auto", out: str = "bench-results") -> list[dict]:
    """Print one row per measurement, one column per weight format (and the peer); every
    format's K/V cache in `kv_dtype` (auto: `streamgrok.model.quantized.cache_dtype`)
    unless its entry names its own, `FORMAT:KV` (`q4:int8`: q4 weights, int8 K/V)."""
    import torch

    from streamgrok.loading.loader import default_model_path

    model_path = Path(model) if model else default_model_path()
    threads = threads or torch.get_num_threads()
    batches = batches or [1, 8, 32]
    weights = ["f32", *[w for w in weights if w != "f32"]]  # the accuracy reference first
    for column in weights:
        fmt, _, kv = column.partition(":")
        if fmt not in WEIGHT_FORMATS or (kv and kv not in KV_CACHE_DTYPES):
            raise ValueError(f"unknown format {column!r}: FORMAT or FORMAT:KV, FORMAT one of "
                             f"{', '.join(WEIGHT_FORMATS)}, KV one of "
                             f"{', '.join(KV_CACHE_DTYPES)}")
    from streamgrok_kernels.cpu_native import CPU_ISA_ENV, isa_cap, simd_flags

    print(f"cpu: {simd_flags()} ({CPU_ISA_ENV}={isa_cap()})")
    print(f"model {model_path.name}  torch {torch.__version__}  threads {threads}  "
          f"prefill {prompt_tokens} tokens  "
          f"batch 1 at {batch1_context} tokens, sequences at {context}+{steps} tokens  "
          f"median of {repeats} rounds, each system in turn; K/V cache {kv_dtype}; "
          f"accuracy teacher-forced over {AGREEMENT_TOKENS} tokens of prose and as "
          f"{len(QUESTIONS)} greedy chat answers", flush=True)
    binaries = None
    if peer == "llama.cpp":
        try:
            binaries = find_binaries(peer_bin)
        except PeerUnavailable as exc:
            print(f"peer llama.cpp: {exc}")
    # Rounds, not one system after another: on a shared machine the speed drifts by tens of
    # percent within minutes, and a ratio of numbers measured apart would carry the drift.
    rounds: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        reference = str(Path(scratch) / "f32_logprobs.npy")
        for round_number in range(repeats):
            for column in weights:
                fmt, _, own_kv = column.partition(":")
                spec = {"model": str(model_path), "weights": fmt, "threads": threads,
                        "prompt_tokens": prompt_tokens, "batches": batches,
                        "context": context, "batch1_context": batch1_context,
                        "steps": steps, "kv_dtype": own_kv or kv_dtype,
                        "reference_logprobs": reference if round_number == 0 else None,
                        "agreement_tokens": AGREEMENT_TOKENS}
                result = _worker(spec, Path(scratch))
                rounds.setdefault(column, []).append({**result, "weights": column})
                print(f".. round {round_number + 1}: {column} done", file=sys.stderr,
                      flush=True)
            if binaries is not None:
                rounds.setdefault("llama.cpp", []).append(run_peer(
                    binaries, model_path, threads, prompt_tokens, 128, context,
                    [b for b in batches if b > 1], 1))
    columns = [_merged(runs) for runs in rounds.values()]
    _print_table(columns, batches, context)
    _plot(columns, batches, Path(out))
    return columns


def _merged(runs: list[dict]) -> dict:
    """One system's rounds as one column: the median of each speed, the largest peak RSS,
    the accuracy of the round that measured it."""
    merged: dict = {}
    for key in dict.fromkeys(k for run in runs for k in run):
        values = [run[key] for run in runs if run.get(key) is not None]
        if not values or not isinstance(values[0], (int, float)):
            merged[key] = values[0] if values else None
        elif key == "peak_rss_mb":
            merged[key] = max(values)
        else:
            merged[key] = statistics.median(values)
    return merged


def _worker(spec: dict, scratch: Path) -> dict:
    path = scratch / f"{spec['weights']}.json"
    path.write_text(json.dumps(spec))
    env = measurement_env()  # the worker imports this checkout's benchmarks/, from anywhere
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(CHECKOUT), env.get("PYTHONPATH"))))
    done = subprocess.run([sys.executable, "-m", "benchmarks.decode_worker", str(path)],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"the {spec['weights']} run failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _rows(batches: list[int], context: int) -> list[tuple[str, str, bool]]:
    """(label, key, higher is better)."""
    rows = [("prefill tok/s", "prefill_tok_s", True)]
    for batch in batches:
        label = "decode batch 1 tok/s" if batch == 1 else \
            f"decode {batch} seq @{context} tok/s"
        rows.append((label, f"decode_b{batch}_tok_s", True))
        rows.append(("  uncompiled (same run)", f"decode_b{batch}_eager_tok_s", True))
    rows += [("compile s (decode)", "compile_s", False), ("peak RSS MB", "peak_rss_mb", False),
             ("weights MB", "weight_mb", False),
             ("top-1 vs f32", "top1_agreement", True), ("KL vs f32 nats", "kl_nats", False),
             ("answers = f32", "greedy_same", True),
             ("answer prefix = f32", "greedy_prefix", True)]
    return rows


def _print_table(columns: list[dict], batches: list[int], context: int) -> None:
    peer = next((c for c in columns if c["weights"] == "llama.cpp"), None)
    ours = [c for c in columns if c is not peer]
    names = [c["weights"] for c in ours] + (["llama.cpp"] if peer else [])
    ratio_names = [f"{c['weights']}/peer" for c in ours] if peer else \
        [f"{c['weights']}/f32" for c in ours[1:]]
    width = max(12, 2 + max(len(n) for n in names + ratio_names))
    print(f"{'':28}" + "".join(f"{n:>{width}}" for n in names + ratio_names))
    for label, key, _ in _rows(batches, context):
        cells = [_cell(c.get(key)) for c in ours] + ([_cell(peer.get(key))] if peer else [])
        base = peer if peer else ours[0]
        compared = ours if peer else ours[1:]
        ratios = [_ratio(c.get(key), base.get(key)) for c in compared]
        print(f"{label:28}" + "".join(f"{x:>{width}}" for x in cells + ratios))


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def _ratio(value, base) -> str:
    if value is None or not base:
        return "-"
    return f"{value / base:.2f}x"


def _plot(columns: list[dict], batches: list[int], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in _rows(batches, 0)
            if r[1].endswith("tok_s") and not r[1].endswith("eager_tok_s")]
    fig, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 3.2))
    for axis, (label, key, _) in zip(axes, rows):
        names = [c["weights"] for c in columns if c.get(key) is not None]
        values = [c[key] for c in columns if c.get(key) is not None]
        axis.bar(names, values, color=["#777" if n == "llama.cpp" else "#3a63d8"
                                       for n in names])
        axis.set_title(label.replace(" @0", ""), fontsize=9)
        axis.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "decode.png", dpi=110)
    print(f"plot: {out / 'decode.png'}")


def register(benches: argparse._SubParsersAction) -> None:
    """Add `decode` and its arguments to the `python -m benchmarks` commands."""
    decode = benches.add_parser("decode", formatter_class=DEFAULTS,
                                help="prefill and batched decode throughput")
    decode.add_argument("--prompt-tokens", type=int, default=512, help="prefill length")
    decode.add_argument("--batches", default="1,8,32", help="decode batch sizes")
    decode.add_argument("--context", type=int, default=512,
                        help="context of each sequence for the batched decode rows")
    decode.add_argument("--batch1-context", type=int, default=64,
                        help="context of the batch-1 decode row (llama-bench's tg128 spans 0-128)")
    decode.add_argument("--steps", type=int, default=12, help="timed decode steps per batch")
    decode.add_argument("--repeats", type=int, default=3, help="runs per number (median)")
    decode.add_argument("--formats", default="f32,bf16,q8,q4",
                        help="weight formats compared (f32 is the accuracy reference); "
                             "FORMAT:KV gives one its own K/V cache dtype, e.g. q4:int8")
    decode.add_argument("--kv-dtype", default="auto", choices=CHAT_KV_DTYPES,
                        help="K/V cache dtype of every format: auto is bfloat16 for the "
                             "quantized formats where the CPU has native bfloat16 (llama.cpp's "
                             "default cache is float16), else the model's compute dtype; int8 "
                             "keeps a scale per token and head")
    decode.add_argument("--peer", default=None, choices=("llama.cpp",),
                        help="also measure llama.cpp's own benchmarks on the same GGUF")
    decode.add_argument("--peer-bin", default=None,
                        help="folder with llama-bench and llama-batched-bench (default: PATH)")
    decode.add_argument("--out", default="bench-results", help="folder for the plot")
    add_model_options(decode)
    decode.set_defaults(run=run_from_args)


def run_from_args(args: argparse.Namespace) -> int:
    """Run the bench with the parsed command-line arguments."""
    run_decode_bench(args.model, args.formats.split(","), args.threads,
                     prompt_tokens=args.prompt_tokens,
                     batches=[int(b) for b in args.batches.split(",")],
                     context=args.context, batch1_context=args.batch1_context,
                     steps=args.steps, repeats=args.repeats, peer=args.peer,
                     peer_bin=args.peer_bin, kv_dtype=args.kv_dtype, out=args.out)
    return 0
