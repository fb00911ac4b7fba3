"""The engine across KV-parallel ranks: rank 0 runs the engine and mirrors every cache
mutation and model step to the other ranks, which replay them in the same order.

Only the engine thread of rank 0 calls the cache and the model, so one ordered command stream
(`KVGroup.send_command`) is all the followers need: they never decide anything, they repeat
rank 0's calls, and the collectives inside those calls (attention merges, eviction scores)
line up. Sampling, tokenization, sessions and the server stay on rank 0.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

import torch

from streamgrok.cache.config import CacheConfig
from streamgrok.cache.kv_group import KVGroup, KVParallelError
from streamgrok.cache.kv_parallel import KVParallelCache
from streamgrok.errors import StreamgrokError
from streamgrok.loading.loader import LoadedModel
from streamgrok.model.batch import BatchMetadata
from streamgrok.model.llama import Transformer
from streamgrok.model.quantized import paged_cache_dtype

log = logging.getLogger("streamgrok.kv_parallel")

MIRRORED = ("add_sequence", "fork", "remove_sequence", "limit_protected", "reserve", "commit",
            "rollback", "evict", "index_frame")
STOP = ("stop",)


def kv_parallel_cache(loaded: LoadedModel, cache_config: CacheConfig,
                      group: KVGroup) -> KVParallelCache:
    """This rank's shard of the engine's cache (the same on leader and followers: "auto"
    K/V resolved as the engine resolves it, `paged_cache_dtype`)."""
    config = cache_config.for_model(paged_cache_dtype(loaded.model))
    return KVParallelCache(loaded.config, group, config, loaded.model.dtype,
                           loaded.model.device, kernels=loaded.model.kernels)


class LeaderCache:
    """Rank 0's cache: each mutating call goes to the followers first, then runs here;
    everything else (reads, and the attention calls made inside the model) runs here only."""

    def __init__(self, cache: KVParallelCache) -> None:
        self._cache = cache
        self._group = cache.group

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._cache, name)
        if name not in MIRRORED:
            return target

        def mirrored(*args, **kwargs):
            self._group.send_command(("cache", name, args, _portable(kwargs)))
            return target(*args, **kwargs)

        return mirrored


class LeaderModel:
    """Rank 0's model: each forward pass goes to the followers first (they run the same
    pass on their shards), then runs here. Other attributes are the model's."""

    def __init__(self, model: Transformer, group: KVGroup) -> None:
        self._model = model
        self._group = group

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, input_ids: torch.Tensor, batch: BatchMetadata, backend) -> torch.Tensor:
        self._group.send_command(("forward", input_ids.cpu(), batch))
        return self._model(input_ids, batch, backend)


def stop_followers(group: KVGroup) -> None:
    """Tell the followers the engine has stopped (they return from `follow`)."""
    try:
        group.send_command(STOP)
    except KVParallelError as exc:
        log.warning("could not tell the KV-parallel followers to stop: %s", exc)


def follow(loaded: LoadedModel, cache_config: CacheConfig, group: KVGroup) -> None:
    """A follower rank: replay rank 0's cache calls and forward passes until it stops (or
    rank 0 is gone). SIGTERM and SIGINT are left to rank 0, which drains and then stops us."""
    if group.rank == 0:
        raise ValueError("rank 0 leads; only ranks > 0 follow")
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    cache = kv_parallel_cache(loaded, cache_config, group)
    model = loaded.model
    log.info("KV-parallel rank %d of %d following rank 0", group.rank, group.world)
    with torch.inference_mode():
        while True:
            command = group.receive_command()
            if command == STOP:
                log.info("rank 0 stopped; rank %d exits", group.rank)
                return
            try:
                if command[0] == "forward":
                    _, input_ids, batch = command
                    model(input_ids.to(model.device), _on(batch, model.device), cache.attention)
                else:
                    _, name, args, kwargs = command
                    getattr(cache, name)(*args, **kwargs)
            except StreamgrokError as exc:  # rank 0 met the same error and handles it
                log.debug("rank %d: %s failed like on rank 0: %s", group.rank, command[0], exc)
            except Exception as exc:  # the same call fails alike on rank 0, which reports it
                log.warning("rank %d: %s failed: %s", group.rank, command[0], exc)


def _portable(kwargs: dict) -> dict:
    # `failed` collects errors for the caller on rank 0; a follower gets its own dict
    return {k: ({} if k == "failed" and v is not None else v) for k, v in kwargs.items()}


def _on(batch: BatchMetadata, device: torch.device) -> BatchMetadata:
    for name in ("embed_rows", "embed_values", "logit_rows"):
        value = getattr(batch, name)
        if value is not None:
            setattr(batch, name, value.to(device))
    return batch
