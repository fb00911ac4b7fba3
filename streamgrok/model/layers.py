"""The building blocks every decoder shares: linears and embeddings that stay
uninitialised on the meta device, RMSNorm, and the SwiGLU MLP (a dense layer or one
expert)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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


class FeedForward(nn.Module):
    """SwiGLU MLP."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.w_gate = Linear(hidden_size, intermediate_size, bias=False)
        self.w_up = Linear(hidden_size, intermediate_size, bias=False)
        self.w_down = Linear(intermediate_size, hidden_size, bias=False)
        self.w_gate_up: nn.Module | None = None  # gate and up in one matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w_gate_up is not None:
            if (fused := swiglu_w8a8(self.w_gate_up, self.w_down, x)) is not None:
                return fused
            gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        else:
            gate, up = self.w_gate(x), self.w_up(x)
        return self.w_down(F.silu(gate) * up)
