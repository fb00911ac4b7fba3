"""Feed a long token stream through a model and a paged cache, evicting between chunks.

This is the engine's append path reduced to one sequence, used by `python -m benchmarks kv`
and by tests; the engine's scheduler does the same for many sessions at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from streamgrok.cache.paged_cache import PagedKVCache
from streamgrok.model.batch import BatchMetadata
from streamgrok.model.llama import Transformer
from streamgrok.stream_tokens import TokenInfo


@torch.inference_mode()
def feed(
    model: Transformer,
    cache: PagedKVCache,
    seq_id: int,
    token_ids: Sequence[int],
    chunk: int = 512,
    info: TokenInfo | None = None,
    all_logits: bool = False,
    on_chunk: Callable[[int, torch.Tensor | None], None] | None = None,
) -> torch.Tensor:
    """Append `token_ids` in chunks; returns the logits of the last token (or, with
    `all_logits`, passes every chunk's logits to `on_chunk(tokens_done, logits)`)."""
    logits = torch.empty(0)
    ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=model.device)
    for start in range(0, ids.numel(), chunk):
        part = ids[start : start + chunk]
        batch = BatchMetadata.build([seq_id], [part.numel()], model.device)
        if all_logits:
            batch.logit_rows = None
        if info is not None:
            batch.token_info = info.slice(start, start + part.numel())
        logits = model(part, batch, cache.attention)
        cache.evict([seq_id])
        if on_chunk is not None:
            on_chunk(start + part.numel(), logits if all_logits else None)
    return logits[-1:]


@torch.inference_mode()
def greedy_continue(
    model: Transformer,
    cache: PagedKVCache,
    seq_id: int,
    last_logits: torch.Tensor,
    max_tokens: int,
    stop_ids: frozenset[int] = frozenset(),
) -> list[int]:
    """Greedy tokens after a fed stream, each appended to the cache (and evicted as needed)."""
    out: list[int] = []
    logits = last_logits
    for _ in range(max_tokens):
        token = int(logits[-1].argmax())
        if token in stop_ids:
            break
        out.append(token)
        batch = BatchMetadata.build([seq_id], [1], model.device)
        logits = model(torch.tensor([token], device=model.device), batch, cache.attention)
        cache.evict([seq_id])
    return out
