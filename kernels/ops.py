"""The one dispatch point between streamgrok and its kernels: Triton on CUDA, PyTorch elsewhere.

The cache's attention backend and the model call `KernelOps` methods; each has a Triton
implementation and a PyTorch reference with the same contract (the CPU path and the tests'
oracle). `backend="auto"` uses Triton for CUDA tensors when Triton is importable; "torch" and
"triton" force one side (Triton on CPU tensors needs TRITON_INTERPRET=1, which only tests and
`python -m streamgrok_kernels.check` set).
"""

from __future__ import annotations

import os

import torch

from streamgrok_kernels import (
    kv_append,
    kv_compact,
    paged_decode_attention,
    paged_prefill_attention,
    rmsnorm,
    rotary,
)
from streamgrok_kernels.common import triton
from streamgrok_kernels.cpu_attention import NativePagedAttention, cpu_paged_attention
from streamgrok_kernels.paged_kv import PagedKV
from streamgrok_kernels.paged_read import PagedReader

BACKENDS = ("auto", "torch", "triton")
# Prefill chunks of at most this many queries per sequence attend by the native CPU kernel
# (many sessions' short prompts and streamed notes, packed in one step); longer ones by the
# PyTorch path, whose dense attention is faster on long chunks over long contexts
# (docs/cpu-performance.md has the measurements).
NATIVE_PREFILL_MAX_QUERIES = 128


class KernelOps:
    """Chooses Triton or the PyTorch reference per call, from the backend and the tensor."""

    def __init__(self, backend: str = "auto", compiled_reads: bool | None = None,
                 native_attention: bool | None = None) -> None:
        """`compiled_reads`: the PyTorch attention path reads paged K/V through
        torch.compile (see kernels.paged_read); False reads them eagerly; None: compiled
        unless STREAMGROK_COMPILED_READS=0. `native_attention`: decode attention on CPU
        tensors runs the native kernel once it is built (kernels.cpu_attention); None: on
        unless STREAMGROK_NATIVE_ATTENTION=0."""
        if backend not in BACKENDS:
            raise ValueError(f"kernel backend must be one of {BACKENDS}, not {backend!r}")
        if backend == "triton" and triton is None:
            raise RuntimeError("kernel backend 'triton' asked for, but triton is not installed")
        self.backend = backend
        self.paged_reader = PagedReader(compiled=compiled_reads)
        self.native = NativePagedAttention(native_attention)

    def uses_triton(self, tensor: torch.Tensor) -> bool:
        """Whether calls on `tensor` run the Triton kernels."""
        if self.backend == "torch" or triton is None:
            return False
        if self.backend == "auto":
            return tensor.is_cuda
        if not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "kernel backend 'triton' on CPU tensors needs TRITON_INTERPRET=1 set before "
                "the kernels are imported"
            )
        return True

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(x + residual) * weight, x + residual); see kernels.rmsnorm."""
        impl = rmsnorm.rms_norm if self.uses_triton(x) else rmsnorm.reference
        return impl(x, weight, eps, residual)

    def rotate(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """x [tokens, heads, D] rotated by positions, cos/sin from tables; see kernels.rotary."""
        impl = rotary.rotate if self.uses_triton(x) else rotary.reference
        return impl(x, positions, cos, sin)

    def kv_append(
        self, kv: PagedKV, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store new K/V at slots (-1 skips); see kernels.kv_append."""
        impl = kv_append.kv_append if self.uses_triton(kv.k) else kv_append.reference
        impl(kv, slots, k, v)

    def kv_compact(self, kv: PagedKV, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move entries from src to dst slots in place; see kernels.kv_compact."""
        impl = kv_compact.kv_compact if self.uses_triton(kv.k) else kv_compact.reference
        impl(kv, src, dst)

    def decode_attention(
        self, q: torch.Tensor, kv: PagedKV, block_tables: torch.Tensor, lengths: torch.Tensor,
        cos: torch.Tensor, sin: torch.Tensor, want_mass: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One query per sequence over its pages; see kernels.paged_decode_attention."""
        if self.uses_triton(q):
            return paged_decode_attention.paged_decode_attention(
                q, kv, block_tables, lengths, cos, sin, want_mass)
        if self.native.serves(q, kv):  # each row's query sits at its last position
            rows = torch.arange(q.shape[0] + 1, device=q.device)
            return cpu_paged_attention(q, kv, block_tables, rows, lengths.long() - 1, cos, sin,
                                       1 if want_mass else None)
        return paged_decode_attention.reference(q, kv, block_tables, lengths, cos, sin,
                                                want_mass, self.paged_reader)

    def prefill_attention(
        self, q: torch.Tensor, kv: PagedKV, block_tables: torch.Tensor, cu_q: torch.Tensor,
        past: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, max_q: int,
        mass_window: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Chunks of several sequences over their pages; see kernels.paged_prefill_attention.
        On the CPU, chunks of at most NATIVE_PREFILL_MAX_QUERIES queries each take the native
        kernel once it is built."""
        if self.uses_triton(q):
            return paged_prefill_attention.paged_prefill_attention(
                q, kv, block_tables, cu_q, past, cos, sin, max_q, mass_window)
        if max_q <= NATIVE_PREFILL_MAX_QUERIES and self.native.serves(q, kv):
            return cpu_paged_attention(q, kv, block_tables, cu_q, past, cos, sin, mass_window)
        return paged_prefill_attention.reference(q, kv, block_tables, cu_q, past, cos, sin,
                                                 max_q, mass_window, self.paged_reader)
