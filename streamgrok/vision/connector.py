"""Connectors from vision features to language-model token vectors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from streamgrok.vision.config import ConnectorConfig, VisionConfig


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[B, S*S, D] -> [B, S*S/scale^2, D*scale^2]: each scale x scale block of neighbouring
    patches becomes one vector (Idefics3's ordering of the merged features)."""
    b, seq, d = x.shape
    side = int(seq ** 0.5)
    x = x.view(b, side, side // scale, d * scale).permute(0, 2, 1, 3)
    x = x.reshape(b, side // scale, side // scale, d * scale * scale).permute(0, 2, 1, 3)
    return x.reshape(b, seq // scale ** 2, d * scale * scale)


class ModalityProjection(nn.Module):
    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_dim, out_dim, bias=False)


class PixelShuffleConnector(nn.Module):
    """Idefics3 / SmolVLM: pixel shuffle, then one linear map without bias."""

    def __init__(self, connector: ConnectorConfig, vision: VisionConfig) -> None:
        super().__init__()
        self.scale = connector.scale_factor
        self.modality_projection = ModalityProjection(
            vision.hidden_size * self.scale ** 2, connector.text_hidden)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.modality_projection.proj(pixel_shuffle(features, self.scale))


class MlpConnector(nn.Module):
    """LLaVA's multi-modal projector: linear, GELU, linear."""

    def __init__(self, connector: ConnectorConfig, vision: VisionConfig) -> None:
        super().__init__()
        hidden = connector.text_hidden
        self.linear_1 = nn.Linear(vision.hidden_size, hidden, bias=connector.bias)
        self.linear_2 = nn.Linear(hidden, hidden, bias=connector.bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(features)))


def build_connector(connector: ConnectorConfig, vision: VisionConfig) -> nn.Module:
    if connector.kind == "pixel_shuffle":
        return PixelShuffleConnector(connector, vision)
    return MlpConnector(connector, vision)
