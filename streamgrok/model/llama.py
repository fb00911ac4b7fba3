"""A Llama-family decoder in plain PyTorch: one readable file, gpt-fast style.

Attention delegates K/V storage, positions and the attention computation to an
`AttentionBackend`, so the same modules run on the contiguous cache, the paged streaming
cache, or Triton kernels.
"""

from __future__ import annotations

import torch
from torch import nn

from streamgrok.model.batch import AttentionBackend, BatchMetadata
from streamgrok.model.compiled_decode import CompiledDecode
from streamgrok.model.config import ModelConfig
from streamgrok.model.layers import Embedding, FeedForward, Linear, RMSNorm
from streamgrok.model.moe import MoEFeedForward
from streamgrok.model.native_decode import PagedNativeDecode
from streamgrok_kernels.ops import KernelOps


class Attention(nn.Module):
    """Grouped-query attention with optional q/k/v bias (Qwen2), RMSNorm of q and k per head
    (Qwen3) or of their whole projections (OLMoE), and q/k/v clamping (`clip_qkv`)."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.wq = Linear(config.hidden_size, config.num_heads * config.head_dim, bias=bias)
        self.wk = Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=bias)
        self.wv = Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=bias)
        self.wo = Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)
        self.wqkv: nn.Module | None = None  # q, k and v in one matmul (see fuse_projections)
        self.qk_norm = config.qk_norm
        self.clip = config.clip_qkv
        self.q_norm = self.k_norm = None
        if config.qk_norm != "none":
            per_head = config.qk_norm == "head"
            self.q_norm = RMSNorm(config.head_dim if per_head else
                                  config.num_heads * config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim if per_head else
                                  config.num_kv_heads * config.head_dim, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, batch: BatchMetadata, backend: AttentionBackend
    ) -> torch.Tensor:
        tokens = x.shape[0]
        if self.wqkv is not None:
            q, k, v = self.wqkv(x).split(
                [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                 self.num_kv_heads * self.head_dim], dim=-1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        # q and k go unrotated: the backend applies rotary at cache positions
        out = backend.attend(self.layer, q, k, v, batch)
        return self.wo(out.reshape(tokens, self.num_heads * self.head_dim))


class Block(nn.Module):
    """Pre-norm transformer block; its feed-forward a SwiGLU MLP or a mixture of experts."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, layer)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        moe = config.moe
        self.ffn: nn.Module = (
            MoEFeedForward(config.hidden_size, moe) if moe is not None and moe.is_sparse(layer)
            else FeedForward(config.hidden_size, config.intermediate_size))

    def forward(
        self, x: torch.Tensor, batch: BatchMetadata, backend: AttentionBackend, ops: KernelOps
    ) -> torch.Tensor:
        h = self.attn_norm(x, ops)
        h, x = self.ffn_norm.with_residual(self.attn(h, batch, backend), x, ops)
        return x + self.ffn(h)


class Transformer(nn.Module):
    """Token embedding, decoder blocks, final norm and output head (tied or not)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.kernels = KernelOps()  # Triton on CUDA, PyTorch elsewhere; tests may force one
        self.compiled_decode = CompiledDecode()  # CPU decode steps as one graph, once compiled
        self.paged_native = PagedNativeDecode()  # paged-cache decode steps as one native call
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.output = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.embed.weight

    def tie_weights(self) -> None:
        """Share the output head with the embedding (after `load_state_dict(assign=True)`)."""
        if self.config.tie_embeddings:
            self.output.weight = self.embed.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: BatchMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Logits [len(batch.logit_rows), vocab] (all rows when logit_rows is None).

        input_ids is the packed [tokens] id tensor; rows listed in `batch.embed_rows` take
        `batch.embed_values` instead of their token embedding.
        """
        compiled = self.compiled_decode.wants(self, input_ids, batch, backend)
        backend.prepare(batch)
        if compiled and (logits := self.compiled_decode.run(self, input_ids, batch,
                                                            backend)) is not None:
            return logits
        if (logits := self.paged_native.run(self, input_ids, batch, backend)) is not None:
            return logits
        x = self.embed_tokens(input_ids, batch)
        for layer in self.layers:
            x = layer(x, batch, backend, self.kernels)
        return self.logits(x, batch)

    def embed_tokens(self, input_ids: torch.Tensor, batch: BatchMetadata) -> torch.Tensor:
        """Token embeddings, with `batch.embed_values` in the rows `batch.embed_rows`."""
        x = self.embed(input_ids)
        if batch.embed_rows is not None and batch.embed_values is not None:
            x = x.index_copy(0, batch.embed_rows, batch.embed_values.to(x.dtype))
        return x

    def logits(self, x: torch.Tensor, batch: BatchMetadata) -> torch.Tensor:
        """Final norm and output head on `batch.logit_rows` (all rows when None)."""
        if batch.logit_rows is not None:
            x = x.index_select(0, batch.logit_rows)
        return self.output(self.norm(x, self.kernels)).float()

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the norms' weights are kept in it whatever the projections'
        storage)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def weight_bytes(self) -> int:
        """Bytes of distinct parameters and quantized weight buffers (a tied head counted
        once)."""
        seen, total = set(), 0
        for p in [*self.parameters(), *self.buffers(recurse=True)]:
            if id(p) not in seen and p.data_ptr() not in seen:
                seen.update((id(p), p.data_ptr()))
                total += p.numel() * p.element_size()
        return total

    def decode_read_bytes(self) -> int:
        """Bytes of weights one decode step reads: all except the unused embedding rows."""
        total = self.weight_bytes()
        table = getattr(self.embed, "weight", None)
        if table is None or getattr(self.output, "weight", None) is not table:
            total -= sum(t.numel() * t.element_size()
                         for t in [*self.embed.parameters(), *self.embed.buffers()])
        return total


def fuse_projections(model: Transformer) -> Transformer:
    """Concatenate each layer's q/k/v and gate/up weights so each group is one matmul
    (fewer calls and one read of the activations; the same numbers). The separate modules
    are removed; loading into a fused model is not supported (fuse after loading). Every
    SwiGLU MLP is fused: a dense layer's, each expert's and a shared expert's."""
    for module in list(model.modules()):
        if isinstance(module, Attention) and module.wqkv is None:
            module.wqkv = _concatenated([module.wq, module.wk, module.wv])
            del module.wq, module.wk, module.wv
        elif isinstance(module, FeedForward) and module.w_gate_up is None:
            module.w_gate_up = _concatenated([module.w_gate, module.w_up])
            del module.w_gate, module.w_up
    return model


def _concatenated(parts: list[nn.Linear]) -> nn.Linear:
    weight = torch.cat([p.weight.detach() for p in parts])
    has_bias = parts[0].bias is not None
    # built on meta: its own weight (and bias) are replaced at once, never initialised
    fused = Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta",
                   dtype=weight.dtype)
    fused.weight = nn.Parameter(weight.t().contiguous().t() if weight.device.type == "cpu"
                                else weight, requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]),
                                  requires_grad=False)
    return fused
