"""The mixture-of-experts feed-forward (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE).

A router scores every expert for each token; each token goes to its top-k experts and
their outputs are summed, weighted by the router's probabilities. The batch's tokens are
grouped by expert, so each active expert runs one matmul over all the tokens that chose it
(not one per token), on whatever its projections are stored as (float, int8, int4).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
from torch import nn

from streamgrok.model.config import MoEConfig
from streamgrok.model.layers import FeedForward, Linear


class Routing(NamedTuple):
    """Each token's chosen experts [tokens, k] (most probable first) and their weights
    [tokens, k] (float32)."""

    experts: torch.Tensor
    weights: torch.Tensor


def route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> Routing:
    """Softmax over the experts (in float32), the top `top_k`, renormalised to sum to one
    where `normalize`."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(experts, weights)


class ExpertGroups(NamedTuple):
    """A batch's (token, choice) pairs sorted by expert: `tokens` [tokens*k] the token of
    each pair, `weights` its weight, `counts` [num_experts] how many pairs each expert has."""

    tokens: torch.Tensor
    weights: torch.Tensor
    counts: list[int]


def grouped_by_expert(routing: Routing, num_experts: int) -> ExpertGroups:
    """The routing's pairs in expert order (stable: tokens ascending within an expert)."""
    flat = routing.experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    top_k = routing.experts.shape[-1]
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return ExpertGroups(order // top_k, routing.weights.reshape(-1)[order], counts)


class ExpertDispatch(Protocol):
    """Runs a layer's routed experts somewhere else (`expert_parallel.ExpertShard`: the
    experts spread over ranks)."""

    def output(self, ffn: MoEFeedForward, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The layer's whole output for `x` [tokens, hidden] (routed and shared experts)."""
        ...


class MoEFeedForward(nn.Module):
    """Router, experts and (Qwen2-MoE) a gated shared expert. Keeps the last call's routing
    (`last_routing`) and a running count of the tokens each expert has taken
    (`tokens_per_expert`, on the CPU; None before the first call; a native decode step,
    `streamgrok.model.native_decode`, counts into it too but leaves `last_routing` as the
    last call's here). With a `dispatch` (see
    `streamgrok.model.expert_parallel`) the experts run where it sends them."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.top_k = moe.experts_per_token
        self.normalize = moe.normalize_weights
        self.router = Linear(hidden_size, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(
            FeedForward(hidden_size, moe.expert_intermediate_size)
            for _ in range(moe.num_experts))
        self.shared = (FeedForward(hidden_size, moe.shared_intermediate_size)
                       if moe.shared_intermediate_size else None)
        self.shared_gate = Linear(hidden_size, 1, bias=False) if moe.shared_gated else None
        self.last_routing: Routing | None = None
        # made on first use: a model is built on the meta device before its weights are read
        self.tokens_per_expert: torch.Tensor | None = None
        self.dispatch: ExpertDispatch | None = None

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = route(self.router(x), self.top_k, self.normalize)
        self.last_routing = routing
        if self.tokens_per_expert is None:
            self.tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.long)
        self.tokens_per_expert += torch.bincount(routing.experts.reshape(-1).cpu(),
                                                 minlength=self.num_experts)
        if self.dispatch is not None:
            return self.dispatch.output(self, x, routing)
        return self.shared_added(x, self.routed_output(x, routing))

    def routed_output(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The chosen experts' outputs summed with their weights, each expert one matmul
        over its tokens (experts in index order)."""
        groups = grouped_by_expert(routing, self.num_experts)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(groups.counts):
            if not count:
                continue
            tokens = groups.tokens[start:start + count]
            weights = groups.weights[start:start + count, None]
            out.index_add_(0, tokens, (self.experts[expert](x[tokens]) * weights).to(x.dtype))
            start += count
        return out

    def shared_added(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """`routed` plus the shared expert's output for `x` (gated), where there is one."""
        if self.shared is None:
            return routed
        shared = self.shared(x)
        if self.shared_gate is not None:
            shared = torch.sigmoid(self.shared_gate(x)) * shared
        return routed + shared
