"""`python -m benchmarks kv --parts paged`: the engine's decode steps on the paged streaming
cache, attention by the native CPU kernel against the PyTorch path (compiled paged reads),
the same cache and sequences, steps alternating between the two in one process; for a model
the native step serves (`--weights q4`), a third column times the whole step as one native
call (`PagedNativeDecode`), as the engine runs it.

The cache evicts by h2o, so every decode step also returns the attention mass, as in a live
session with that policy; its budget is above the contexts, so nothing is evicted while it
is timed and both paths read the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.caches import bench_cache
from benchmarks.corpus import long_ids, stdlib_text
from streamgrok.bench.timing import median, timed
from streamgrok.cache.paged_cache import PagedKVCache
from streamgrok.cache.streaming import feed
from streamgrok.loading.loader import LoadedModel
from streamgrok.model.batch import BatchMetadata
from streamgrok_kernels.ops import KernelOps

SHAPES = ((1, 512), (1, 2048), (8, 512), (8, 2048), (32, 512))  # (sequences, cached tokens)
STEPS = 12  # timed steps per path and shape, alternating


@dataclass
class PagedDecodeRow:
    sequences: int
    context: int
    native_ms: float
    torch_ms: float
    kv_bytes: int  # K/V one step reads, all layers
    step_ms: float | None = None  # the whole step as one native call, where it serves

    @property
    def speedup(self) -> float:
        return self.torch_ms / self.native_ms

    def gbps(self, ms: float) -> float:
        return self.kv_bytes / (ms * 1e-3) / 1e9


def paged_decode(loaded: LoadedModel, out_dir: Path, chunk: int = 512) -> dict:
    """Time decode steps with each attention path; print the table, plot it, return rows."""
    native_ops = KernelOps("torch", native_attention=True)
    torch_ops = KernelOps("torch", native_attention=False)
    if not native_ops.native.wait_ready():
        print(f"\n[paged decode] the native kernel is not available here "
              f"({native_ops.native.error}); nothing to compare")
        return {}
    ids = long_ids(loaded.tokenizer, stdlib_text, max(c for _, c in SHAPES))
    print(f"\n[paged decode] h2o cache (mass read every step), {STEPS} steps per path, "
          f"alternating; K/V GB/s = K/V bytes a step reads / whole step time")
    print(f"{'seqs':>5} {'context':>8} {'native ms':>10} {'torch ms':>9} {'speedup':>8} "
          f"{'native tok/s':>13} {'torch tok/s':>12} {'native GB/s':>12} {'torch GB/s':>11} "
          f"{'one-call ms':>12} {'one-call tok/s':>15}")
    rows = []
    for sequences, context in tqdm(SHAPES, desc="paged decode", leave=False):
        cache = _filled_cache(loaded, sequences, ids[:context], chunk)
        row = _time_paths(loaded, cache, sequences, context, native_ops, torch_ops)
        rows.append(row)
        tqdm.write(f"{sequences:>5} {context:>8} {row.native_ms:>10.1f} {row.torch_ms:>9.1f} "
              f"{row.speedup:>7.2f}x {sequences / row.native_ms * 1e3:>13.1f} "
              f"{sequences / row.torch_ms * 1e3:>12.1f} {row.gbps(row.native_ms):>12.1f} "
              f"{row.gbps(row.torch_ms):>11.1f} "
              + (f"{row.step_ms:>12.1f} {sequences / row.step_ms * 1e3:>15.1f}"
                 if row.step_ms else f"{'-':>12} {'-':>15}"))
    _plot(rows, out_dir / "paged_decode.png")
    return {f"{r.sequences}x{r.context}": {"native_ms": r.native_ms, "torch_ms": r.torch_ms,
                                           "speedup": r.speedup, "one_call_ms": r.step_ms}
            for r in rows}


def _filled_cache(loaded: LoadedModel, sequences: int, ids: list[int],
                  chunk: int) -> PagedKVCache:
    element = torch.empty(0, dtype=loaded.model.dtype).element_size()
    kv_bytes = _kv_bytes(loaded, sequences * (len(ids) + 2 * STEPS + 64), element)
    cache = bench_cache(loaded, "h2o", len(ids) + 4 * STEPS + 256,
                        memory_gib=1.5 * kv_bytes / 2**30)
    with torch.inference_mode():
        cache.add_sequence(0)
        feed(loaded.model, cache, 0, ids, chunk)  # under the budget: nothing is evicted
        for seq in range(1, sequences):  # the same context: a fork shares its pages
            cache.fork(0, seq)
    return cache


def _time_paths(loaded: LoadedModel, cache: PagedKVCache, sequences: int, context: int,
                native_ops: KernelOps, torch_ops: KernelOps) -> PagedDecodeRow:
    device = loaded.model.device
    seq_ids = list(range(sequences))
    tokens = torch.full((sequences,), 42, dtype=torch.long, device=device)

    def step() -> None:
        loaded.model(tokens, BatchMetadata.build(seq_ids, [1] * sequences, device), cache.attention)

    whole = loaded.model.paged_native
    paths = [("native", native_ops, False), ("torch", torch_ops, False)]
    with torch.inference_mode():
        whole.enabled = True
        cache.kernels = native_ops
        step()  # untimed: whether the model fits the one-call step
        if whole.steps:
            paths.append(("step", native_ops, True))
        for _, ops, one_call in paths:  # untimed: starts the compiled reads' compilation
            cache.kernels, whole.enabled = ops, one_call
            step()
        torch_ops.paged_reader.wait_compiled()
        times: dict[str, list[float]] = {name: [] for name, _, _ in paths}
        for _ in range(STEPS):
            for name, ops, one_call in paths:
                cache.kernels, whole.enabled = ops, one_call
                times[name].append(timed(step, device))
        whole.enabled = True
    kv_bytes = _kv_bytes(loaded, sequences * (context + STEPS),
                         cache.pool.paged_kv().k.element_size())
    return PagedDecodeRow(sequences, context, median(times["native"]) * 1e3,
                          median(times["torch"]) * 1e3, kv_bytes,
                          median(times["step"]) * 1e3 if "step" in times else None)


def _kv_bytes(loaded: LoadedModel, tokens: int, element: int) -> int:
    """Bytes of K and V that `tokens` cached tokens hold in every layer."""
    config = loaded.config
    return 2 * tokens * config.num_layers * config.num_kv_heads * config.head_dim * element


def _plot(rows: list[PagedDecodeRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.sequences} x {r.context}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.bar([i - 0.2 for i in x], [r.torch_ms for r in rows], 0.4, label="PyTorch path")
    ax.bar([i + 0.2 for i in x], [r.native_ms for r in rows], 0.4, label="native kernel")
    for i, r in zip(x, rows):
        ax.annotate(f"{r.speedup:.2f}x", (i + 0.2, r.native_ms), ha="center", va="bottom",
                    fontsize=8)
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("sequences x cached tokens")
    ax.set_ylabel("decode step ms (lower is better)")
    ax.set_title("Paged decode steps: native CPU attention vs the PyTorch path")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")
