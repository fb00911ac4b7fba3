"""Weight-only int4 matmuls of a few rows on the CPU (decode steps, short chunks).

An int4 layer (`Int4Linear`, streamgrok/model/quantized.py) keeps its weight in the layout of
PyTorch's CPU int4 kernel (`torch.ops.aten._weight_int4pack_mm_for_cpu`): blocks of 64 output
rows, each [in, 32] bytes whose byte c holds row c in its low nibble and row c + 32 in its
high one, and a (scale, zero) pair of bfloat16 per group of 32 inputs and output row,
[in / 32, out, 2]; a weight is (level - 8) * scale + zero. PyTorch's kernel turns every weight
into a float before multiplying, and a decode step of SmolLM2 q4 spent 7-10 ms in it (84 MB of
weights at 8-13 GB/s; the cores read ~22 GB/s).

The native kernel (`kernels/cpu/int4_linear.cpp`, built with the other native CPU kernels,
`kernels.cpu_native`) reads the same layout and multiplies integers: each group of 32
activations becomes int8 levels plus int8 levels of their remainder (x ~ d * (a + b / 254),
within ~1e-5 of the group's peak: PyTorch's kernel rounds activations to bfloat16, ~4e-3), and
AVX-512 VNNI (or, on CPUs without AVX-512, AVX2's maddubs) sums the level products. Where the
machine has neither, the kernel's portable loop is slower than PyTorch's, so `Int4Matmul` keeps
PyTorch's there. `int4_kernel()` names the loop this build runs (`STREAMGROK_CPU_ISA` caps it;
see kernels.cpu_native).
"""

from __future__ import annotations

import logging

import torch

from streamgrok_kernels.cpu_native import NativeBuild

log = logging.getLogger(__name__)
GROUP = 32  # inputs per (scale, zero) pair
BLOCK = 64  # output rows per block of the layout


def unpacked_transposed(packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W^T [in, out] in `dtype` from the layout above (out a multiple of 64)."""
    out_features, in_features = packed.shape[0], packed.shape[1] * 2
    blocks, groups = out_features // BLOCK, in_features // GROUP
    blocked = packed.view(blocks, groups, GROUP, BLOCK // 2)
    levels = torch.cat([blocked & 15, blocked >> 4], dim=3)  # [blocks, groups, 32, 64]
    pairs = scales_and_zeros.view(groups, blocks, 1, BLOCK, 2).transpose(0, 1).to(dtype)
    weight = (levels.to(dtype) - 8) * pairs[..., 0] + pairs[..., 1]
    return weight.permute(1, 2, 0, 3).reshape(in_features, out_features)


def int4_linear_reference(x: torch.Tensor, packed: torch.Tensor,
                          scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x [rows, in] float32 times W^T, W [out, in] as the layout above holds it, in float32
    (the native kernel's contract, which it meets within its activation levels' precision)."""
    return x.float() @ unpacked_transposed(packed, scales_and_zeros)


def int4_kernel() -> str:
    """The loop the built native int4 matmul runs: "avx512-vnni", "avx2" or "portable" (the
    native kernels must be loaded: `load_native_kernels`)."""
    return str(torch.ops.streamgrok_cpu.int4_linear_kernel())


class Int4Matmul:
    """Multiplies by int4 layers (and by a weight-only int8 output head: the native int8
    kernel, in the same build) natively where the kernel is built vectorized (AVX-512 VNNI
    or AVX2; see
    `kernels.cpu_native.NativeBuild`: until then, and where it cannot be, PyTorch's kernel
    serves; no call waits for the compiler). One per model, shared by its int4 layers."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.native = NativeBuild("int4 matmul", enabled)
        # a plain flag, set once the kernel is loaded and vectorized: a compiled graph reads
        # it while tracing (and guards on it), where the build's state cannot be asked
        self.in_use = False
        self._decided = False

    def serves(self, x: torch.Tensor) -> bool:
        """Whether a call on `x` runs natively (starting the build if need be)."""
        if torch.compiler.is_compiling():
            return self.in_use
        if not self._decided and x.device.type == "cpu" and self.native.ready():
            self._decide()
        return self.in_use and x.device.type == "cpu"

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Build now if need be and wait (benchmarks and compiled graphs, before they trace
        or time); whether calls run natively."""
        if not self._decided and self.native.wait_ready(timeout):
            self._decide()
        return self.in_use

    def _decide(self) -> None:
        self.in_use = bool(torch.ops.streamgrok_cpu.int4_linear_vectorized())
        self._decided = True
        log.info("native int4 matmul: %s loop (%s)", int4_kernel(),
                 "in use" if self.in_use else "PyTorch's kernel serves instead")

    def unpacked_transposed(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                            dtype: torch.dtype) -> torch.Tensor:
        """`unpacked_transposed(packed, scales_and_zeros, dtype)` (a prefill chunk's W^T), by
        the native kernel once it is built (its plain loop serves every CPU; float32 or
        bfloat16), else by PyTorch's elementwise ops (several times slower: a 512-token q4
        prefill of SmolLM2 spent 230 of its 355 ms in them)."""
        if (packed.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
                and not torch.compiler.is_compiling() and self.native.ready()):
            return torch.ops.streamgrok_cpu.int4_unpack_transposed(packed, scales_and_zeros,
                                                                   dtype)
        return unpacked_transposed(packed, scales_and_zeros, dtype)

    @staticmethod
    def multiply(x: torch.Tensor, packed: torch.Tensor,
                 scales_and_zeros: torch.Tensor) -> torch.Tensor:
        """`int4_linear_reference(x, packed, scales_and_zeros)` by the native kernel (call
        `serves` first)."""
        return torch.ops.streamgrok_cpu.int4_linear(x.float(), packed, scales_and_zeros)
