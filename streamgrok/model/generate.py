"""Plain synchronous generation on the contiguous cache: streaming and batched.

The async engine serves many sessions; this is what `streamgrok chat` and the decode
benchmark use, and the reference the engine's outputs are compared with.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from streamgrok.model.batch import BatchMetadata
from streamgrok.model.config import ModelConfig
from streamgrok.model.contiguous_cache import ContiguousKVCache
from streamgrok.model.detokenizer import IncrementalDetokenizer
from streamgrok.model.llama import Transformer
from streamgrok.model.quantized import cache_dtype, prefill_attention_dtype
from streamgrok.model.sampling import SamplingParams, new_generator, sample
from streamgrok.model.tokenizer import Tokenizer


class ReadyModel(Protocol):
    """What generation needs of a loaded model (`streamgrok.loading.loader.LoadedModel`)."""

    model: Transformer
    tokenizer: Tokenizer
    config: ModelConfig


@dataclass
class Generation:
    """Token ids generated for one prompt and why generation ended."""

    token_ids: list[int]
    finish_reason: str  # "stop" or "length"


# the contiguous cache's K/V dtypes by name (int8 with a scale per token and head)
KV_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}


def kv_cache_dtype(name: str) -> torch.dtype:
    """The contiguous cache's K/V dtype called `name`: float32, bfloat16 or int8."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown K/V cache dtype {name!r} "
                         f"(choose from {', '.join(KV_CACHE_DTYPES)})")
    return KV_CACHE_DTYPES[name]


class Generator:
    """Runs prompts through a loaded model on its own contiguous cache."""

    def __init__(self, loaded: ReadyModel, max_batch: int = 1, capacity: int | None = None,
                 kv_dtype: torch.dtype | None = None):
        """`kv_dtype`: the cache's K/V dtype (float32, bfloat16, or int8 with a scale per
        token and head); None: `streamgrok.model.quantized.cache_dtype`."""
        self.loaded = loaded
        self.capacity = capacity or loaded.config.max_positions
        self.cache = ContiguousKVCache(
            loaded.config, max_batch, self.capacity, kv_dtype or cache_dtype(loaded.model),
            loaded.model.device, prefill_attention_dtype(loaded.model))

    def chat_prompt(self, question: str, system: str | None = None) -> list[int]:
        """Token ids of a one-turn chat prompt in the model's own template."""
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": question})
        return self.loaded.tokenizer.encode(self.loaded.tokenizer.render_chat(messages))

    @torch.inference_mode()
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Generation]:
        """Generate for several prompts at once (batched decode); returns ids per prompt."""
        results = [Generation([], "length") for _ in prompts]
        for step in self._steps(prompts, params):
            for i, token in step:
                results[i].token_ids.append(token)
                if token in self._stops(params):
                    results[i].finish_reason = "stop"
        return results

    @torch.inference_mode()
    def stream(self, prompt: Sequence[int], params: SamplingParams) -> Iterator[str]:
        """Yield text deltas of one answer as tokens are produced."""
        detok = IncrementalDetokenizer(self.loaded.tokenizer)
        for step in self._steps([prompt], params):
            for _, token in step:
                if token not in self._stops(params):
                    delta = detok.push(token)
                    if delta:
                        yield delta
        tail = detok.flush()
        if tail:
            yield tail

    def _stops(self, params: SamplingParams) -> frozenset[int]:
        return self.loaded.tokenizer.stop_ids | params.stop_token_ids

    def _steps(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> Iterator[list[tuple[int, int]]]:
        """Yield, per decode step, (prompt index, new token) for each still-running prompt."""
        if len(prompts) > len(self.cache.lengths):
            raise ValueError(f"{len(prompts)} prompts exceed max_batch {len(self.cache.lengths)}")
        model, device = self.loaded.model, self.loaded.model.device
        stops = self._stops(params)
        for slot in range(len(prompts)):
            self.cache.reset(slot)
        generators = [None if params.greedy else new_generator(params, device) for _ in prompts]
        ids = torch.tensor([t for p in prompts for t in p], device=device)
        batch = BatchMetadata.build(range(len(prompts)), [len(p) for p in prompts], device)
        logits = model(ids, batch, self.cache)
        running = list(range(len(prompts)))
        produced: list[list[int]] = [[] for _ in prompts]
        for step in range(params.max_tokens):
            tokens = sample(logits, [params] * len(running), [generators[i] for i in running],
                            [produced[i] for i in running])
            new = list(zip(running, tokens.tolist()))
            for i, token in new:
                produced[i].append(token)
            yield new
            if step == params.max_tokens - 1:
                return
            running = [
                i for i, t in new
                if t not in stops and self.cache.length(i) < self.capacity
            ]
            if not running:
                return
            alive = torch.tensor([t for i, t in new if i in running], device=device)
            batch = BatchMetadata.build(running, [1] * len(running), device)
            logits = model(alive, batch, self.cache)
