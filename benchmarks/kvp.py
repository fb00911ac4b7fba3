"""`python -m benchmarks kv --parts kvp`: KV-parallel decode on CPU ranks, measured, and a labelled
projection of what the same sharding gives on GPUs.

Measured: one sequence prefilled to each context (full cache, real text), then greedy decode
steps; the decode step time with 1 rank (a plain `PagedKVCache`: the baseline) and with N
gloo ranks on this machine (threads split between them), every one in its own process with
OpenMP's default wait policy, and the bytes each rank sends per decoded token.
Projected: time per token for a Llama-3-8B shape on H200s from a bandwidth model whose inputs
are printed (no GPU measured them here)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.corpus import stdlib_text
from benchmarks.kv_ranks import StreamResult, StreamScenario, run_ranks
from streamgrok.bench.timing import measurement_env, median
from streamgrok.cache.config import CacheConfig
from streamgrok.loading.loader import LoadedModel, load_model
from streamgrok.model.llama import Transformer


@dataclass(frozen=True)
class GpuShape:
    """The model and machine the projection assumes (printed with it)."""

    name: str = "Llama-3-8B on H200"
    layers: int = 32
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    kv_bytes: int = 2  # bf16
    weight_gb: float = 16.1
    memory_gb: float = 141.0
    hbm_tbs: float = 4.8
    kernel_efficiency: float = 0.55  # paged decode at ~55% of peak (DESIGN.md, FA3 paged)
    link_gbs: float = 450.0  # NVLink per direction
    collective_us: float = 15.0  # latency of one small all-gather


def run_kvp(loaded: LoadedModel, weights: str, ranks: tuple[int, ...],
            contexts: tuple[int, ...], decode_steps: int, chunk: int, out_dir: Path) -> dict:
    """Measure decode step time per (context, ranks); print the table, the projection and a
    plot; return the numbers."""
    ids = loaded.tokenizer.encode(stdlib_text(max(contexts) * 6))
    if len(ids) < max(contexts):
        raise ValueError(f"the corpus gave {len(ids)} tokens, fewer than {max(contexts)}")
    cores = os.cpu_count() or 1
    build = functools.partial(_load_transformer, str(loaded.source),
                              loaded.model.dtype, weights)
    rows = []
    jobs = [(c, r) for c in contexts for r in ranks]
    for context, world in tqdm(jobs, desc="kvp", unit="run"):
        tokens = torch.tensor(ids[:context])
        chunks = [[tokens[i:i + chunk]] for i in range(0, context, chunk)]
        pages = ((context + decode_steps) // 16 + 4) * loaded.config.num_layers
        scenario = StreamScenario(chunks, decode_steps,
                                  CacheConfig(policy="full", budget_tokens=None), pages)
        threads = max(1, cores // world)
        result = run_ranks(world, build, scenario, timeout_s=1800, threads=threads,
                           env=measurement_env())[0]
        rows.append(_row(loaded, context, world, threads, result, decode_steps))
    _print_table(loaded, rows, cores)
    projection = project(GpuShape(), (131_072, 1_048_576, 10_485_760), (1, 2, 4, 8, 16))
    _plot(rows, out_dir / "kv_parallel.png")
    return {"measured": rows, "projected": projection}


def _load_transformer(path: str, dtype: torch.dtype, weights: str) -> Transformer:
    return load_model(path, dtype, weights=weights).model


def _row(loaded, context, world, threads, result: StreamResult, steps) -> dict:
    step_ms = median(result.decode_seconds) * 1000
    cfg = loaded.config
    kv_bytes = (context * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
                * loaded.model.dtype.itemsize)
    return {"context": context, "ranks": world, "threads": threads, "step_ms": step_ms,
            "kv_mb_per_rank": kv_bytes / world / 2**20,
            "sent_kb_per_token": result.decode_exchanged_bytes / steps / 1024}


def _print_table(loaded, rows, cores) -> None:
    print(f"\n[kvp] one sequence, full cache, decode step (median of the decode steps); "
          f"{cores} cores split between ranks; 1 rank = PagedKVCache in one process (baseline)")
    print(f"{'context':>8} {'ranks':>5} {'thr/rank':>8} {'step ms':>9} {'vs 1 rank':>9} "
          f"{'KV MB/rank':>10} {'sent KB/token/rank':>18}")
    base = {r["context"]: r["step_ms"] for r in rows if r["ranks"] == 1}
    for r in rows:
        ratio = base.get(r["context"], float("nan")) / r["step_ms"]
        print(f"{r['context']:>8} {r['ranks']:>5} {r['threads']:>8} {r['step_ms']:>9.1f} "
              f"{ratio:>8.2f}x {r['kv_mb_per_rank']:>10.1f} {r['sent_kb_per_token']:>18.1f}")


def project(shape: GpuShape, contexts: tuple[int, ...], ranks: tuple[int, ...]) -> list[dict]:
    """Time per decoded token on `ranks` GPUs, by a bandwidth model (printed, labelled):
    weights read once per rank + this rank's share of the KV + one all-gather per layer of
    (heads x (head_dim + 1)) float32 partials from every rank."""
    bandwidth = shape.hbm_tbs * 1e12 * shape.kernel_efficiency
    kv_per_token = shape.layers * shape.kv_heads * shape.head_dim * 2 * shape.kv_bytes
    partial = shape.heads * (shape.head_dim + 1) * 4
    print(f"\n[kvp] PROJECTION (a model, not a measurement): {shape.name}, bf16 KV, HBM "
          f"{shape.hbm_tbs} TB/s x {shape.kernel_efficiency:.0%} kernel efficiency, NVLink "
          f"{shape.link_gbs:g} GB/s, {shape.collective_us:g} us per all-gather, "
          f"{shape.weight_gb} GB weights per rank")
    print(f"{'context':>10} " + " ".join(f"{f'{r} GPU':>12}" for r in ranks))
    out = []
    for context in contexts:
        cells = []
        for world in ranks:
            kv_gb = context * kv_per_token / world / 1e9
            if kv_gb + shape.weight_gb > shape.memory_gb:
                cells.append(f"{'no fit':>12}")
                continue
            seconds = ((shape.weight_gb * 1e9 + kv_gb * 1e9) / bandwidth
                       + (shape.layers * (shape.collective_us * 1e-6
                                          + world * partial / (shape.link_gbs * 1e9))
                          if world > 1 else 0.0))
            out.append({"context": context, "ranks": world, "ms": seconds * 1000})
            cells.append(f"{seconds * 1000:>9.1f} ms")
        print(f"{context:>10} " + " ".join(cells))
    return out


def _plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for world in sorted({r["ranks"] for r in rows}):
        mine = [r for r in rows if r["ranks"] == world]
        ax.plot([r["context"] for r in mine], [r["step_ms"] for r in mine], marker="o",
                label=f"{world} rank{'s' if world > 1 else ''}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode step (ms)")
    ax.set_title("KV-parallel decode on CPU ranks (gloo)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")
