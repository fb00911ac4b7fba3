"""Sampling parameters and a batched sampler (greedy, temperature, top-k, top-p, seed)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0  # > 1 discourages tokens the answer already produced
    max_tokens: int = 256
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def new_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator:
    """A random generator for one request, seeded when the request asks for it; create it on
    the device of the logits it will sample (torch.multinomial needs them to match)."""
    gen = torch.Generator(device=device)
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits [V] with top-k and top-p masked to -inf."""
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= params.top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def penalize_repeats(logits: torch.Tensor, history: list[int], penalty: float) -> None:
    """CTRL-style repetition penalty, in place on one row: tokens already produced get their
    logit divided by `penalty` (multiplied when negative)."""
    if penalty == 1.0 or not history:
        return
    seen = torch.tensor(sorted(set(history)), device=logits.device)
    values = logits[seen]
    logits[seen] = torch.where(values > 0, values / penalty, values * penalty)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    histories: list[list[int]] | None = None,
) -> torch.Tensor:
    """One token per row of logits [B, V]; greedy rows need no generator. `histories` are
    the tokens each row's answer produced so far (for the repetition penalty)."""
    if histories is not None:
        for row, (p, history) in enumerate(zip(params, histories)):
            penalize_repeats(logits[row], history, p.repetition_penalty)
    tokens = logits.argmax(-1)
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.greedy:
            continue
        probs = filter_logits(logits[row], p).softmax(-1)
        tokens[row] = torch.multinomial(probs, 1, generator=gen)[0]
    return tokens
