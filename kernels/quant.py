"""Symmetric int8 quantization of K/V with one scale per (token, head).

Scales are stored in float16 by the page pool: 2 bytes per 64-value head, so int8 K/V take
52% of the bfloat16 bytes at head_dim 64. Rounding is half away from zero, which the Triton
`kv_append` kernel reproduces exactly."""

from __future__ import annotations

import torch

INT8_MAX = 127.0
MIN_ABS_MAX = 1e-4  # keeps the scale of an all-zero head finite


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (int8 values, float32 scales [...] exactly representable in fp16)."""
    scale = x.float().abs().amax(dim=-1).clamp_min(MIN_ABS_MAX) / INT8_MAX
    scale = scale.to(torch.float16).float()  # quantize against the scale that is stored
    scaled = x.float() / scale[..., None]
    q = (torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)).clamp_(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scale


def dequantized(stored: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """Stored K or V [..., D] as float32: int8 times its row's scale [...] (`quantize_int8`'s
    inverse), floats as they are."""
    if scales is None:
        return stored.float()
    return stored.float() * scales.float()[..., None]

