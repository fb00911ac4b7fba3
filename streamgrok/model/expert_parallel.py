"""Expert parallelism: each rank holds a block of every MoE layer's experts, and tokens go to
their experts' ranks and back by all-to-all.

It runs under KV parallelism (`streamgrok.engine.kv_leader`), where every rank runs the
same forward pass on the same tokens, as NVIDIA's Helix lays out attention and experts on
one set of ranks. In each MoE layer rank r takes the r-th contiguous slice of the batch's
tokens, sends each (token, chosen expert) pair's hidden row to the rank holding that expert,
computes the pairs it receives with its own experts, and sends the results back; the
owning rank weights and sums them (experts in index order, as one process does), adds the
shared expert for its slice, and an all-gather gives every rank the whole output again.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from streamgrok.model.moe import MoEFeedForward, Routing, grouped_by_expert


class Collectives(Protocol):
    """The collectives expert parallelism needs (`streamgrok.cache.kv_group.KVGroup`)."""

    rank: int
    world: int

    def all_to_all_rows(self, tensor: torch.Tensor, send_counts: list[int]
                        ) -> tuple[torch.Tensor, list[int]]: ...

    def all_gather_rows(self, tensor: torch.Tensor) -> list[torch.Tensor]: ...


class AbsentExpert(nn.Module):
    """Stands where another rank's expert is: holds no weights, refuses to run."""

    def __init__(self, owner: int) -> None:
        super().__init__()
        self.owner = owner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"this expert's weights are on rank {self.owner}")


def expert_owner(expert: int, num_experts: int, world: int) -> int:
    """The rank holding `expert`: contiguous blocks, rank r the r-th."""
    return expert * world // num_experts


class ExpertShard:
    """One MoE layer's experts spread over the ranks of `group` (this rank's block local)."""

    def __init__(self, group: Collectives, num_experts: int) -> None:
        self.group = group
        self.owners = [expert_owner(e, num_experts, group.world) for e in range(num_experts)]
        self.sent_bytes = 0  # hidden rows this rank sent (to experts, back, all-gathered)

    def output(self, ffn: MoEFeedForward, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        group, world = self.group, self.group.world
        tokens = x.shape[0]
        lo, hi = tokens * group.rank // world, tokens * (group.rank + 1) // world
        mine = Routing(routing.experts[lo:hi], routing.weights[lo:hi])
        pairs = grouped_by_expert(mine, ffn.num_experts)  # in expert order, so rank order
        expert_of_pair = torch.repeat_interleave(
            torch.arange(ffn.num_experts), torch.tensor(pairs.counts, dtype=torch.long))
        send_counts = [0] * world
        for expert, count in enumerate(pairs.counts):
            send_counts[self.owners[expert]] += count
        rows = x[lo:hi][pairs.tokens.to(x.device)]
        received, received_counts = group.all_to_all_rows(rows, send_counts)
        their_experts, _ = group.all_to_all_rows(expert_of_pair[:, None], send_counts)
        computed = self._computed(ffn, received, their_experts[:, 0])
        results, _ = group.all_to_all_rows(computed, received_counts)
        self.sent_bytes += (rows.numel() + computed.numel()) * x.element_size()
        out = torch.zeros_like(x[lo:hi])
        start = 0
        for count in pairs.counts:
            if count:
                part = slice(start, start + count)
                weights = pairs.weights[part, None].to(x.device)
                out.index_add_(0, pairs.tokens[part].to(x.device),
                               (results[part] * weights).to(x.dtype))
                start += count
        out = ffn.shared_added(x[lo:hi], out)
        self.sent_bytes += out.numel() * x.element_size() * (world - 1)
        return torch.cat(group.all_gather_rows(out))

    @staticmethod
    def _computed(ffn: MoEFeedForward, rows: torch.Tensor, experts: torch.Tensor
                  ) -> torch.Tensor:
        """Each received row through its expert (one matmul per expert), in arrival
        order."""
        out = torch.empty_like(rows)
        order = torch.argsort(experts, stable=True)
        counts = torch.bincount(experts, minlength=ffn.num_experts).tolist()
        start = 0
        for expert, count in enumerate(counts):
            if count:
                index = order[start:start + count].to(rows.device)
                out[index] = ffn.experts[expert](rows[index])
                start += count
        return out


def shard_experts(model: nn.Module, group: Collectives) -> list[ExpertShard]:
    """Keep only this rank's block of each MoE layer's experts (the others' weights freed)
    and route the layer's tokens over `group`; the layers' shards, in order. A world of one
    changes nothing; more ranks than a layer has experts is a ValueError."""
    shards = []
    if group.world == 1:
        return shards
    for module in model.modules():
        if isinstance(module, MoEFeedForward):
            if group.world > module.num_experts:
                raise ValueError(f"{group.world} ranks for {module.num_experts} experts: "
                                 "each rank needs at least one")
            shard = ExpertShard(group, module.num_experts)
            for expert, owner in enumerate(shard.owners):
                if owner != group.rank:
                    module.experts[expert] = AbsentExpert(owner)
            module.dispatch = shard
            shards.append(shard)
    return shards
