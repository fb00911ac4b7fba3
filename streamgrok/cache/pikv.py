"""PiKV's expert-sharded KV layout (arXiv 2508.06526), for measuring what it costs in
fidelity: approximate attention.

The layout: over `world` ranks holding a mixture's experts in contiguous blocks (as
`streamgrok.model.expert_parallel`), in each MoE layer a token's K/V is kept by the rank
holding the token's most probable expert, and a query attends only over the ranks holding
its top-k experts (plus its own key). The choice is the layer's own router applied to the
attention's input (attention runs before the layer's feed-forward, so the router sees the
token as the attention does); dense layers attend over everything.

`ExpertShardedKV` is an attention backend that plays this layout in one process for one
sequence: each query sees exactly the keys the ranks it selects hold, so its output is what
the ranks' partial attentions, merged by log-sum-exp (`shard_attention.merge_partials`,
exact), give. It is a measuring tool, not a serving cache: `python -m benchmarks kv --parts moe`
compares its logits with the full cache's on a long stream (top-1 agreement, KL).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from streamgrok.model.batch import BatchMetadata
from streamgrok.model.expert_parallel import expert_owner
from streamgrok.model.moe import MoEFeedForward
from streamgrok.model.rotary import Rotary


@dataclass
class _LayerKV:
    keys: list[torch.Tensor] = field(default_factory=list)  # rotated [n, kv_heads, D] chunks
    values: list[torch.Tensor] = field(default_factory=list)
    shards: list[torch.Tensor] = field(default_factory=list)  # [n] rank holding each key


@dataclass
class ShardedKVStats:
    """Keys each query could see under the layout, as a share of the full cache's (sparse
    layers only), over every query so far."""

    visible: int = 0
    total: int = 0

    @property
    def visible_fraction(self) -> float:
        return self.visible / self.total if self.total else 1.0


class ExpertShardedKV:
    """One sequence's KV laid out by expert routing over `world` ranks (see the module)."""

    def __init__(self, model: nn.Module, world: int) -> None:
        """`model`: a `Transformer` with MoE layers; the backend watches its attentions'
        inputs (forward pre-hooks, removed by `close`)."""
        if model.config.moe is None:
            raise ValueError("the expert-sharded layout needs a mixture-of-experts model")
        self.world = world
        self.num_experts = model.config.moe.num_experts
        self.top_k = model.config.moe.experts_per_token
        if world > self.num_experts:
            raise ValueError(f"{world} ranks for {self.num_experts} experts")
        self.rotary = Rotary(model.config, model.device)
        self.routers: dict[int, nn.Module] = {
            i: block.ffn.router for i, block in enumerate(model.layers)
            if isinstance(block.ffn, MoEFeedForward)}
        self.owners = torch.tensor([expert_owner(e, self.num_experts, world)
                                    for e in range(self.num_experts)])
        self.layers = [_LayerKV() for _ in model.layers]
        self.length = 0
        self.stats = ShardedKVStats()
        self._inputs: dict[int, torch.Tensor] = {}
        self._hooks = [block.attn.register_forward_pre_hook(self._watcher(i))
                       for i, block in enumerate(model.layers)]

    def _watcher(self, layer: int):
        def watch(module: nn.Module, args: tuple) -> None:
            self._inputs[layer] = args[0]
        return watch

    def close(self) -> None:
        """Stop watching the model."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def prepare(self, batch: BatchMetadata) -> None:
        if batch.seq_ids != [0]:
            raise ValueError("ExpertShardedKV holds one sequence (id 0)")
        count = batch.query_lens[0]
        positions = torch.arange(self.length, self.length + count,
                                 device=self.rotary.inv_freq.device)
        batch.backend_state = positions
        self.length += count

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               batch: BatchMetadata) -> torch.Tensor:
        positions: torch.Tensor = batch.backend_state
        q = self.rotary.rotate(q, positions)
        store = self.layers[layer]
        store.keys.append(self.rotary.rotate(k, positions))
        store.values.append(v)
        router = self.routers.get(layer)
        selected = None
        if router is not None:
            probs = torch.softmax(router(self._inputs[layer]).float(), dim=-1)
            chosen = probs.topk(self.top_k, dim=-1).indices  # [n, k]
            store.shards.append(self.owners[chosen[:, 0].cpu()])
            selected = torch.zeros(q.shape[0], self.world, dtype=torch.bool)
            selected.scatter_(1, self.owners[chosen.cpu()], True)
        keys, values = torch.cat(store.keys), torch.cat(store.values)
        key_positions = torch.arange(keys.shape[0], device=q.device)
        visible = key_positions[None, :] <= positions[:, None]
        if selected is not None:
            shards = torch.cat(store.shards)
            own = key_positions[None, :] == positions[:, None]
            held = selected[:, shards].to(q.device) | own
            self.stats.visible += int((visible & held).sum())
            self.stats.total += int(visible.sum())
            visible = visible & held
        return _masked_attention(q, keys, values, visible).to(q.dtype)


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      visible: torch.Tensor) -> torch.Tensor:
    """Attention of q [n, H, D] over k, v [m, kv_heads, D] where `visible` [n, m]."""
    n, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    qg = q.float().reshape(n, kv_heads, group, dim).permute(1, 2, 0, 3)  # [kvh, g, n, D]
    scores = (qg @ k.float().permute(1, 2, 0)[:, None]) / math.sqrt(dim)  # [kvh, g, n, m]
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v.float().transpose(0, 1)[:, None]
    return out.permute(2, 0, 1, 3).reshape(n, heads, dim)
