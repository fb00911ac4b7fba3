"""`python -m benchmarks kv --parts dtypes`: what storing the engine's paged cache in bfloat16
or int8 costs in accuracy and wins in step time, against float32 K/V, on the loaded model.

One sequence of prose is prefilled, then decoded teacher-forced token by token through the
paged cache with each K/V dtype (decode steps as the engine runs them: one native call each
where the model fits, `PagedNativeDecode`); each step's logits are compared with the float32
cache's: top-1 agreement and KL(float32 || dtype) in nats. Then the decode step is timed at
the end of that context, the dtypes in turn, alternating.
"""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.corpus import long_ids, stdlib_text
from streamgrok.bench.timing import median, timed
from streamgrok.cache.config import CacheConfig
from streamgrok.cache.paged_cache import PagedKVCache
from streamgrok.loading.loader import LoadedModel
from streamgrok.model.batch import BatchMetadata

DTYPES = ("float32", "bfloat16", "int8")
TIMED_ROUNDS = 5  # rounds of timed steps, each dtype once a round
STEPS_PER_ROUND = 6


def kv_dtypes(loaded: LoadedModel, out_dir: Path, tokens: int = 600, prefix: int = 88) -> dict:
    """Print and plot each K/V dtype's accuracy and decode step time; return them."""
    ids = long_ids(loaded.tokenizer, stdlib_text, tokens)[:tokens]
    prefix = min(prefix, len(ids) // 2)
    print(f"\n[kv dtypes] one sequence: {prefix} tokens prefilled, {len(ids) - prefix - 1} "
          f"decoded teacher-forced; logits against float32 K/V's")
    caches, logits = {}, {}
    with torch.inference_mode():
        for dtype in DTYPES:
            caches[dtype] = _cache(loaded, dtype, len(ids) + TIMED_ROUNDS * STEPS_PER_ROUND * 2)
            logits[dtype] = _teacher_forced(loaded, caches[dtype], ids, prefix)
        times: dict[str, list[float]] = {dtype: [] for dtype in DTYPES}
        token = torch.tensor(ids[-1:], device=loaded.model.device)
        for _ in range(TIMED_ROUNDS):
            for dtype in DTYPES:
                for _ in range(STEPS_PER_ROUND):
                    times[dtype].append(timed(lambda d=dtype: _step(loaded, caches[d], token),
                                              loaded.model.device))
    reference = logits["float32"].log_softmax(-1)
    results = {}
    print(f"{'K/V':>9} {'top-1':>7} {'KL nats':>9} {'step ms':>8} {'bytes/token/layer':>18}")
    for dtype in DTYPES:
        log_probs = logits[dtype].log_softmax(-1)
        top1 = float((log_probs.argmax(-1) == reference.argmax(-1)).float().mean())
        kl = float((reference.exp() * (reference - log_probs)).sum(-1).mean())
        step_ms = median(times[dtype]) * 1e3
        cache = caches[dtype]
        results[dtype] = {"top1": top1, "kl": kl, "step_ms": step_ms,
                          "bytes_per_token_layer": cache.page_bytes // cache.config.page_size}
        print(f"{dtype:>9} {top1:>7.3f} {kl:>9.5f} {step_ms:>8.2f} "
              f"{results[dtype]['bytes_per_token_layer']:>18}")
    _plot(results, out_dir / "kv_dtypes.png")
    return results


def _cache(loaded: LoadedModel, dtype: str, tokens: int) -> PagedKVCache:
    config = CacheConfig(policy="full", budget_tokens=None, kv_dtype=dtype,
                         memory_gib=0.01 + 2 * tokens * _bytes_per_token(loaded) / 2**30)
    cache = PagedKVCache(loaded.config, config, loaded.model.dtype, loaded.model.device,
                         kernels=loaded.model.kernels)
    cache.add_sequence(0)
    return cache


def _bytes_per_token(loaded: LoadedModel) -> int:
    config = loaded.config
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4


def _step(loaded: LoadedModel, cache: PagedKVCache, ids: torch.Tensor) -> torch.Tensor:
    batch = BatchMetadata.build([0], [len(ids)], loaded.model.device)
    return loaded.model(ids, batch, cache.attention)


def _teacher_forced(loaded: LoadedModel, cache: PagedKVCache, ids: list[int],
                    prefix: int) -> torch.Tensor:
    device = loaded.model.device
    _step(loaded, cache, torch.tensor(ids[:prefix], device=device))
    rows = [_step(loaded, cache, torch.tensor(ids[t:t + 1], device=device)).float()[-1]
            for t in range(prefix, len(ids) - 1)]
    return torch.stack(rows).cpu()


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.4))
    left.bar(names, [results[n]["kl"] for n in names])
    left.set_ylabel("KL vs float32 K/V (nats)")
    left.set_title("accuracy")
    right.bar(names, [results[n]["step_ms"] for n in names])
    right.set_ylabel("decode step ms")
    right.set_title("step at the end of the context")
    fig.suptitle("Paged cache K/V dtypes")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")
