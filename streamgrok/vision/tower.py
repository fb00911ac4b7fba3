"""A vision transformer in plain PyTorch (SigLIP and CLIP variants), module names as in the
Hugging Face checkpoints' `vision_model` so their weights load by name."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from streamgrok.vision.config import VisionConfig


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """The MLP activation: exact GELU, tanh-approximated GELU, or CLIP's quick GELU."""
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    return x * torch.sigmoid(1.702 * x)


class PatchEmbeddings(nn.Module):
    """Patches (a strided convolution) plus learned positions, and CLIP's class token."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, config.hidden_size, config.patch_size,
                                         stride=config.patch_size, bias=config.patch_bias)
        positions = config.patches_per_side ** 2 + (1 if config.class_token else 0)
        self.position_embedding = nn.Embedding(positions, config.hidden_size)
        self.class_embedding = (nn.Parameter(torch.zeros(config.hidden_size))
                                if config.class_token else None)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [B, patches, D]
        if self.class_embedding is not None:
            cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)
            x = torch.cat([cls, x], dim=1)
        return x + self.position_embedding.weight[: x.shape[1]].to(x.dtype)


class SelfAttention(nn.Module):
    """Bidirectional multi-head attention with biased projections."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.heads = config.num_heads
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.v_proj, self.out_proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)),
                                             heads(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class MLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.act = config.activation
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(activation(self.act, self.fc1(x)))


class EncoderLayer(nn.Module):
    """Pre-norm block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = SelfAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.layers_run))


class VisionTower(nn.Module):
    """[B, 3, S, S] normalised pixels -> [B, patches(+1), hidden] features of the configured
    layer (only the layers up to it are built and run)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = PatchEmbeddings(config)
        d, eps = config.hidden_size, config.layer_norm_eps
        self.pre_layrnorm = nn.LayerNorm(d, eps=eps) if config.pre_norm else None
        self.encoder = Encoder(config)
        self.post_layernorm = nn.LayerNorm(d, eps=eps) if config.post_norm else None

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels.to(self.embeddings.patch_embedding.weight.dtype))
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        for layer in self.encoder.layers:
            x = layer(x)
        if self.post_layernorm is not None:
            x = self.post_layernorm(x)
        if self.config.class_token and self.config.drop_class_token:
            x = x[:, 1:]
        return x
