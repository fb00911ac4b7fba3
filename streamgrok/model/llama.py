"""A Llama-family decoder in plain PyTorch: one readable file, gpt-fast style.

Attention delegates K/V storage, positions and the attention computation to an
`AttentionBackend`, so the same modules run on the contiguous cache, the paged streaming
cache, or Triton kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from streamgrok.model.batch import AttentionBackend, BatchMetadata
from streamgrok.model.compiled_decode import CompiledDecode
from streamgrok.model.config import ModelConfig
from streamgrok.model.native_decode import PagedNativeDecode
from streamgrok.model.quantized import swiglu_w8a8
from streamgrok_kernels import rmsnorm
from streamgrok_kernels.ops import KernelOps


class Linear(nn.Linear):
    """`nn.Linear` whose weight, on the meta device (a model built before its weights are
    read), is left uninitialised: PyTorch's random fills of meta tensors are Python refs that
    import the compiler (dynamo, ~1400 modules, over 100 MB resident) for values that do not
    exist."""

    def reset_parameters(self) -> None:
        if self.weight.device.type != "meta":
            super().reset_parameters()


class Embedding(nn.Embedding):
    """`nn.Embedding` left uninitialised on the meta device, as `Linear`."""

    def reset_parameters(self) -> None:
        if self.weight.device.type != "meta":
            super().reset_parameters()


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32, through `ops` (fused on GPU)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, ops: KernelOps | None = None) -> torch.Tensor:
        return self.with_residual(x, None, ops)[0]

    def with_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None, ops: KernelOps | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one fused pass."""
        if ops is None:
            return rmsnorm.reference(x, self.weight, self.eps, residual)
        return ops.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    """Grouped-query attention with optional q/k/v bias (Qwen2)."""

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
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        # q and k go unrotated: the backend applies rotary at cache positions
        out = backend.attend(self.layer, q, k, v, batch)
        return self.wo(out.reshape(tokens, self.num_heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU MLP."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w_gate = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w_up = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w_down = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.w_gate_up: nn.Module | None = None  # gate and up in one matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w_gate_up is not None:
            if (fused := swiglu_w8a8(self.w_gate_up, self.w_down, x)) is not None:
                return fused
            gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        else:
            gate, up = self.w_gate(x), self.w_up(x)
        return self.w_down(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, layer)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn = FeedForward(config)

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
    are removed; loading into a fused model is not supported (fuse after loading)."""
    for block in model.layers:
        attn, ffn = block.attn, block.ffn
        if attn.wqkv is None:
            attn.wqkv = _concatenated([attn.wq, attn.wk, attn.wv])
            del attn.wq, attn.wk, attn.wv
        if ffn.w_gate_up is None:
            ffn.w_gate_up = _concatenated([ffn.w_gate, ffn.w_up])
            del ffn.w_gate, ffn.w_up
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
