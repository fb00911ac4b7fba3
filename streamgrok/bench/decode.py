"""`streamgrok bench decode`: prefill throughput and batched decode throughput.

Batch 1 is the baseline measured in the same run; every other batch size prints its ratio to
it, and every row prints the weight-read bandwidth a decode step achieves (gpt-fast habit).
"""

from __future__ import annotations

import torch

from streamgrok.bench.timing import median, timed
from streamgrok.model.batch import BatchMetadata
from streamgrok.model.contiguous_cache import ContiguousKVCache
from streamgrok.model.loader import LoadedModel

_TEXT = (
    "Streams of video and audio arrive for hours; the engine keeps a bounded cache of what "
    "matters and answers questions about it as they come. "
)


def prompt_ids(loaded: LoadedModel, length: int) -> list[int]:
    """`length` token ids of repeated real text."""
    ids = loaded.tokenizer.encode(_TEXT)
    return (ids * (length // len(ids) + 1))[:length]


@torch.inference_mode()
def run_decode_bench(
    loaded: LoadedModel,
    prompt_tokens: int = 512,
    batch_sizes: list[int] | None = None,
    steps: int = 12,
    repeats: int = 3,
    decode_context: int = 64,
) -> dict[str, float]:
    """Print and return prefill tok/s and decode tok/s + GB/s per batch size."""
    batch_sizes = batch_sizes or [1, 8, 32]
    model, device = loaded.model, loaded.model.device
    dtype_name = str(model.dtype).removeprefix("torch.")
    print(
        f"model {loaded.source.name}  dtype {dtype_name}  device {device}  "
        f"threads {torch.get_num_threads()}  weights {model.weight_bytes() / 1e6:.0f} MB"
    )
    results: dict[str, float] = {}

    ids = torch.tensor(prompt_ids(loaded, prompt_tokens), device=device)
    cache = ContiguousKVCache(loaded.config, 1, prompt_tokens, model.dtype, device)

    def prefill() -> None:
        cache.reset(0)
        model(ids, BatchMetadata.build([0], [prompt_tokens], device), cache)

    prefill()  # warm-up
    prefill_s = median([timed(prefill, device) for _ in range(repeats)])
    results["prefill_tok_s"] = prompt_tokens / prefill_s
    print(f"prefill  {prompt_tokens} tokens  {prefill_s * 1e3:8.1f} ms  "
          f"{results['prefill_tok_s']:8.1f} tok/s  (median of {repeats})")

    read_bytes = model.decode_read_bytes()
    baseline = None
    print(f"{'batch':>5} {'step ms':>9} {'tok/s':>9} {'weight GB/s':>12} {'vs batch 1':>11}")
    for batch_size in batch_sizes:
        step_s = _decode_step_time(loaded, batch_size, decode_context, steps)
        tok_s = batch_size / step_s
        baseline = baseline or (tok_s if batch_size == 1 else None)
        ratio = f"{tok_s / baseline:10.2f}x" if baseline else f"{'n/a':>11}"
        print(f"{batch_size:>5} {step_s * 1e3:9.1f} {tok_s:9.1f} "
              f"{read_bytes / step_s / 1e9:12.2f} {ratio}")
        results[f"decode_b{batch_size}_tok_s"] = tok_s
    return results


def _decode_step_time(
    loaded: LoadedModel, batch_size: int, context: int, steps: int
) -> float:
    model, device = loaded.model, loaded.model.device
    capacity = context + steps + 2
    cache = ContiguousKVCache(loaded.config, batch_size, capacity, model.dtype, device)
    ids = prompt_ids(loaded, context)
    seqs = list(range(batch_size))
    model(
        torch.tensor(ids * batch_size, device=device),
        BatchMetadata.build(seqs, [context] * batch_size, device),
        cache,
    )
    step_batch = BatchMetadata.build(seqs, [1] * batch_size, device)
    tokens = torch.full((batch_size,), ids[0], device=device)
    model(tokens, step_batch, cache)  # warm-up
    times = [timed(lambda: model(tokens, step_batch, cache), device) for _ in range(steps)]
    return median(times)
