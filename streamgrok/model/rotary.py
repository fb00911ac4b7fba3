"""Rotary position embeddings in the half-split layout (x[:d/2] pairs with x[d/2:])."""

from __future__ import annotations

import math

import torch

from streamgrok.model.config import ModelConfig, RopeScaling
from streamgrok_kernels.rotary import apply_rotary


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Per-pair rotation frequencies, with linear or Llama-3 style scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling.kind == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.kind == "llama3":
        low_wavelen = scaling.original_max_positions / scaling.low_freq_factor
        high_wavelen = scaling.original_max_positions / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (scaling.original_max_positions / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        scaled = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
        inv_freq = torch.where(
            wavelen > low_wavelen,
            inv_freq / scaling.factor,
            torch.where(wavelen < high_wavelen, inv_freq, scaled),
        )
    elif scaling.kind != "none":
        raise ValueError(f"unknown rope scaling kind {scaling.kind!r}")
    return inv_freq.to(torch.float32)


class Rotary:
    """Computes cos/sin for integer positions and rotates query/key heads.

    Tables grow on demand, so positions are bounded only by what the caller asks for;
    with cache-relative positions they stay below the cache capacity.
    """

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        self.head_dim = config.head_dim
        self.inv_freq = inverse_frequencies(
            config.head_dim, config.rope_theta, config.rope_scaling
        ).to(device)
        self._cos = torch.empty(0, config.head_dim // 2, device=device)
        self._sin = torch.empty(0, config.head_dim // 2, device=device)

    def _grow(self, length: int) -> None:
        size = max(length, 2 * self._cos.shape[0], 256)
        angles = torch.outer(
            torch.arange(size, dtype=torch.float32, device=self.inv_freq.device), self.inv_freq
        )
        self._cos, self._sin = angles.cos(), angles.sin()

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [len(positions), head_dim/2] for integer positions."""
        if positions.numel() and int(positions.max()) >= self._cos.shape[0]:
            self._grow(int(positions.max()) + 1)
        return self._cos[positions], self._sin[positions]

    def tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cos and sin tables [>= length, head_dim/2] (float32, no copy), for
        kernels that look positions up themselves."""
        if length > self._cos.shape[0]:
            self._grow(length)
        return self._cos, self._sin

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x of shape [tokens, heads, head_dim] by the given per-token positions."""
        cos, sin = self.cos_sin(positions)
        return apply_rotary(x, cos, sin)

